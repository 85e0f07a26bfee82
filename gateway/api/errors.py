"""GatewayError: an error value with a code; each protocol router renders it in its own shape."""

from __future__ import annotations

import re

import msgspec
from litestar import Request, Response

from shared.types import ErrorCode, RequestError

STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.WORKER_DIED: 503,
    ErrorCode.WORKER_UNAVAILABLE: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.INTERNAL: 500,
    ErrorCode.CANCELLED: 499,  # the client went away; nobody reads this one
}


class GatewayError(Exception):
    def __init__(
        self,
        code: ErrorCode,
        message: str,
        param: str | None = None,
        retry_after: int | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.headers = headers or []  # extra response headers (RateLimit-*)

    @property
    def status(self) -> int:
        return STATUS.get(self.code, 500)

    @classmethod
    def from_request_error(cls, error: RequestError) -> GatewayError:
        retry = 1 if STATUS.get(error.code) == 503 else None
        return cls(error.code, error.message, error.param, retry)


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
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


_AT_PATH = re.compile(r" - at `\$((?:\.[A-Za-z_]\w*|\[\d+\])*)`")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


def _join(where: str, path: str) -> str:
    """`where` (e.g. "messages[0].content[1]") extended by a msgspec path (".text", "[2]")."""
    path = path if where else path.lstrip(".")
    return where + path if where or path else ""


def validation_error(exc: msgspec.ValidationError, where: str = "") -> GatewayError:
    """A msgspec validation failure as a 400 naming the field: the body's own path, below
    `where` when a part of a body is converted on its own. Every protocol uses this."""
    text = str(exc)
    at = _AT_PATH.search(text)
    param = _join(where, at.group(1) if at else "") or None
    unknown = _UNKNOWN_FIELD.search(text)
    if unknown:
        name = unknown.group(1)
        param = f"{param}.{name}" if param else name
        return GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"unsupported parameter `{param}`: this gateway does not implement it",
            param,
        )
    if where:  # msgspec's path is relative to the part: name the whole one
        text = f"{_AT_PATH.sub('', text)} - at `{param}`"
    return GatewayError(ErrorCode.INVALID_REQUEST, f"invalid request: {text}", param)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_json(path: str, error: GatewayError) -> bytes:
    """The error body in the shape of the protocol that `path` belongs to."""
    if is_anthropic_path(path):
        # overloaded_error means "at capacity, retry": not a dead worker or an unload.
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        if error.status == 503 and error.code != ErrorCode.OVERLOADED:
            kind = "api_error"
        body: dict[str, object] = {
            "type": "error",
            "error": {"type": kind, "message": error.message},
        }
    else:
        from gateway.api.openai.translate import error_body

        body = msgspec.to_builtins(error_body(error))
    return msgspec.json.encode(body)


def error_response(request: Request, exc: GatewayError) -> Response[bytes]:
    """A GatewayError in the shape of the protocol the request's path belongs to."""
    headers = {name.decode(): value.decode() for name, value in exc.headers}
    if exc.retry_after:
        headers["Retry-After"] = str(exc.retry_after)
    return Response(
        error_json(request.url.path, exc),
        status_code=exc.status,
        media_type="application/json",
        headers=headers or None,
    )
