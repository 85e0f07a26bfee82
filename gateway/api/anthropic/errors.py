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
    return msgspec.json.encode(ErrorBody(ErrorDetail(kind, _message(error))))


def _message(error: GatewayError) -> str:
    """The message; a context overflow in Anthropic's own words, which clients read: Claude
    Code retries with a smaller max_tokens on the first, and compacts its conversation on
    the second."""
    if error.code != ErrorCode.CONTEXT_LENGTH_EXCEEDED or len(error.context) != 3:
        return error.message
    limit, prompt, requested = error.context
    if prompt >= limit:
        return f"prompt is too long: {prompt} tokens > {limit} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {prompt} + {requested} > "
        f"{limit}, decrease input length or `max_tokens` and try again"
    )


def error_response(request: Request, exc: GatewayError) -> Response[bytes]:
    return http.error_response(error_json(exc), exc)
