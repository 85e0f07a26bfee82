"""OpenAI's error body (also the Responses API's) and its handler."""

from __future__ import annotations

import msgspec
from litestar import Request, Response

from gateway.api import http
from gateway.api.openai.schemas import ErrorBody, ErrorDetail
from gateway.errors import GatewayError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    499: "request_cancelled",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(error: GatewayError) -> ErrorBody:
    kind = ERROR_TYPES.get(error.status, "server_error")
    return ErrorBody(ErrorDetail(error.message, kind, error.param, error.code.value))


def error_json(error: GatewayError) -> bytes:
    return msgspec.json.encode(error_body(error))


def error_response(request: Request, exc: GatewayError) -> Response[bytes]:
    return http.error_response(error_json(exc), exc)
