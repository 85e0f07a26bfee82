"""Control calls to workers (tokenize, detokenize, stats): each awaits its ControlReply, or
fails at once when its worker dies."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.errors import GatewayError
from gateway.workers.transport import Transport
from shared.protocol import Control, ControlReply
from shared.types import ErrorCode


class ControlCalls:
    def __init__(self) -> None:
        self._pending: dict[int, tuple[str, asyncio.Future[ControlReply]]] = {}
        self._seq = 0

    async def call(
        self,
        transport: Transport,
        worker_id: str,
        model: str,
        method: str,
        args: dict[str, Any],
        timeout: float,
    ) -> dict[str, Any]:
        self._seq += 1
        call_id = self._seq
        future: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (worker_id, future)
        try:
            if not transport.send(worker_id, Control(call_id, method, args)):
                raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {model!r} is unreachable")
            try:
                reply = await asyncio.wait_for(asyncio.shield(future), timeout)
            except TimeoutError:
                raise GatewayError(
                    ErrorCode.TIMEOUT, f"model {model!r} did not answer {method} in {timeout:g}s"
                ) from None
        finally:
            self._pending.pop(call_id, None)
        if not reply.ok:
            code = reply.result.get("code", ErrorCode.INTERNAL.value)
            raise GatewayError(ErrorCode(code), reply.error or method, reply.result.get("param"))
        return reply.result

    def resolve(self, reply: ControlReply, worker_id: str) -> None:
        """A reply from `worker_id` (the frame's sender, as the transport knows it): it
        answers only a call made to that worker."""
        entry = self._pending.get(reply.call_id)
        if entry is not None and entry[0] == worker_id and not entry[1].done():
            entry[1].set_result(reply)

    def fail(self, worker_id: str, message: str) -> None:
        """The worker is gone: its pending calls end now, not at their timeout."""
        for wid, future in list(self._pending.values()):
            if wid == worker_id and not future.done():
                future.set_exception(GatewayError(ErrorCode.WORKER_DIED, message))
