"""GatewayError: an error value with a code; each protocol router renders it in its own shape."""

from __future__ import annotations

from shared.types import ErrorCode, RequestError

STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.MODEL_NOT_FOUND: 404,
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
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after = retry_after

    @property
    def status(self) -> int:
        return STATUS.get(self.code, 500)

    @classmethod
    def from_request_error(cls, error: RequestError) -> GatewayError:
        retry = 1 if STATUS.get(error.code) == 503 else None
        return cls(error.code, error.message, error.param, retry)
