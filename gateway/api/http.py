"""An error as an HTTP response: its status, its headers (Retry-After, RateLimit-*) and a body
in some protocol's shape."""

from __future__ import annotations

from litestar import Response

from gateway.errors import GatewayError


def error_response(body: bytes, exc: GatewayError) -> Response[bytes]:
    headers = {name.decode(): value.decode() for name, value in exc.headers}
    if exc.retry_after:
        headers["Retry-After"] = str(exc.retry_after)
    return Response(
        body, status_code=exc.status, media_type="application/json", headers=headers or None
    )
