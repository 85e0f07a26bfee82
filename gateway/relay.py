"""Relay a RequestStream to a client: protocol-neutral, with deadline and abort on exit.

A Formatter (one per protocol) turns deltas into encoded bodies. Errors that happen before
the first byte are raised as GatewayError (the router renders a status and body); after the
first byte they become an error event, then the stream's end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.stream import RequestStream
from gateway.supervisor import Supervisor
from shared.types import ErrorCode, FinishReason, RequestError, RequestOutput, Usage

ABORTED_BY_SERVER = RequestError(
    ErrorCode.SHUTTING_DOWN, "the request was aborted because its model is being unloaded"
)


class Formatter(Protocol):
    def role_chunk(self) -> bytes | None: ...
    def text_chunk(self, text: str) -> bytes: ...
    def finish_chunk(self, reason: FinishReason | None) -> bytes: ...
    def usage_chunk(self, usage: Usage | None) -> bytes: ...
    def response(self, text: str, reason: FinishReason | None, usage: Usage | None) -> bytes: ...


class Relay:
    """One request's consumption of its stream, bounded by a deadline.

    Until a streaming response takes over (Litestar's Stream listens for the disconnect
    itself), a watcher on the ASGI receive channel turns a client disconnect into an abort.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        stream: RequestStream,
        timeout_s: float,
        receive: Callable[[], Awaitable[Any]] | None = None,
        ctx: RequestContext | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.stream = stream
        self.ctx = ctx
        self.timeout_s = timeout_s
        # One timer per request, not one per token: expiry aborts and ends the stream.
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)
        self._watcher = asyncio.create_task(self._watch(receive)) if receive else None

    def _expire(self) -> None:
        if not self.stream.finished:
            self.supervisor.abort(self.stream)
            self.stream.fail(
                ErrorCode.TIMEOUT,
                f"the request timed out (server.request_timeout_s={self.timeout_s:g})",
            )

    async def _watch(self, receive: Callable[[], Awaitable[Any]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.close()
        self.stream.fail(ErrorCode.CANCELLED, "the client disconnected")

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def next(self) -> RequestOutput:
        output = await self.stream.get()
        if output.finish_reason == FinishReason.ABORT:
            output.error = ABORTED_BY_SERVER
        ctx = self.ctx
        if ctx is not None:
            if output.token_ids:
                ctx.token(len(output.token_ids))
            if output.finish_reason is not None:
                ctx.finish_reason = output.finish_reason.value
                if output.usage is not None:
                    ctx.prompt_tokens = output.usage.prompt_tokens
                    ctx.completion_tokens = output.usage.completion_tokens
                    ctx.cached_tokens = output.usage.cached_tokens
                if output.error is not None:
                    ctx.error_code = output.error.code.value
        return output

    async def first(self) -> RequestOutput:
        """The first delta; a failure here is still a plain HTTP error."""
        try:
            output = await self.next()
        except BaseException:
            self.close()
            self.stop_watching()
            raise
        if output.error is not None:
            self.stop_watching()
            raise GatewayError.from_request_error(output.error)
        return output

    def close(self) -> None:
        """Abort in the worker unless the request already finished there."""
        self._timer.cancel()
        if not self.stream.finished:
            self.supervisor.abort(self.stream)

    async def collect(self, fmt: Formatter) -> bytes:
        try:
            output = await self.first()
            parts = [output.text]
            while output.finish_reason is None:
                output = await self.next()
                parts.append(output.text)
            if output.error is not None:
                raise GatewayError.from_request_error(output.error)
            return fmt.response("".join(parts), output.finish_reason, output.usage)
        finally:
            self.close()
            self.stop_watching()

    async def sse(
        self,
        fmt: Formatter,
        first: RequestOutput,
        include_usage: bool,
        error_event: Callable[[GatewayError], bytes],
    ) -> AsyncIterator[bytes]:
        """Complete SSE events only; a client disconnect lands in `finally` as an abort."""
        try:
            role = fmt.role_chunk()
            if role is not None:
                yield _event(role)
            output = first
            while True:
                if output.text:
                    yield _event(fmt.text_chunk(output.text))
                if output.finish_reason is not None:
                    break
                output = await self.next()
            if output.error is not None:
                yield _event(error_event(GatewayError.from_request_error(output.error)))
            else:
                yield _event(fmt.finish_chunk(output.finish_reason))
                if include_usage:
                    yield _event(fmt.usage_chunk(output.usage))
            yield DONE
        finally:
            self.close()


DONE = b"data: [DONE]\n\n"


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
