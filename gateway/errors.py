"""GatewayError: an error value with a code, raised anywhere in the gateway; each protocol
renders it in its own shape (gateway/api/*/errors.py)."""

from __future__ import annotations

import re

import msgspec

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
        context: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.headers = headers or []  # extra response headers (RateLimit-*)
        # a context overflow's figures (shared.types.context_error), for protocols that say
        # it their own way
        self.context = context or []

    @property
    def status(self) -> int:
        return STATUS.get(self.code, 500)

    @classmethod
    def from_request_error(cls, error: RequestError) -> GatewayError:
        retry = 1 if STATUS.get(error.code) == 503 else None
        return cls(error.code, error.message, error.param, retry, context=error.context)


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
