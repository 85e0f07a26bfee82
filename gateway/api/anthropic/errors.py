"""Anthropic's error body (https://docs.anthropic.com/en/api/errors) and its handler."""

from __future__ import annotations

import msgspec
from litestar import Request, Response

from gateway.api import http
from gateway.api.anthropic.schemas import ErrorBody, ErrorDetail
from gateway.errors import GatewayError
from shared.types import ErrorCode

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def error_json(error: GatewayError) -> bytes:
    # overloaded_error means "at capacity, retry": not a dead worker or an unload.
    kind = TYPES.get(error.status, "api_error")
    if error.status == 503 and error.code != ErrorCode.OVERLOADED:
        kind = "api_error"
    return msgspec.json.encode(ErrorBody(ErrorDetail(kind, error.message)))


def error_response(request: Request, exc: GatewayError) -> Response[bytes]:
    return http.error_response(error_json(exc), exc)
