"""ClientDeadlines: one request's bounds on a slow client, around its ASGI receive and send.

- The body: it must be in, whole, within `body_timeout_s` of the request's head; a body
  still coming then ends the request with 408 (a client trickling its body cannot hold a
  connection and a task for ever). Granian bounds the head itself (server.header_read_timeout_s).
- The response: a client that takes none of it for `send_timeout_s` (one send blocked that
  long: its socket's buffers are full and it reads nothing) is treated as gone. The app's
  next or pending receive says `http.disconnect`, which ends a streaming response and aborts
  its request in the worker the way a closed connection does; later sends are dropped.

One timer per request, armed by a send and re-armed only while sends keep blocking: the
per-token send path pays a clock read, not a timer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from litestar.exceptions import HTTPException

log = logging.getLogger("gateway")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REQUEST_TIMEOUT = 408


class ClientDeadlines:
    __slots__ = (
        "_body_deadline",
        "_body_done",
        "_loop",
        "_receive",
        "_send",
        "_sending_since",
        "_stalled",
        "_timer",
        "body_timeout_s",
        "request_id",
        "send_timeout_s",
    )

    def __init__(
        self,
        receive: Receive,
        send: Send,
        body_timeout_s: float,
        send_timeout_s: float,
        request_id: str = "",
    ) -> None:
        self._receive = receive
        self._send = send
        self._loop = asyncio.get_running_loop()
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s
        self.request_id = request_id
        self._body_deadline = self._loop.time() + body_timeout_s
        self._body_done = False
        self._sending_since: float | None = None  # the send in progress began then
        self._timer: asyncio.TimerHandle | None = None
        self._stalled: asyncio.Future[None] | None = None  # set once the client stalled

    @property
    def stalled(self) -> bool:
        return self._stalled is not None and self._stalled.done()

    async def receive(self) -> Message:
        if not self._body_done:
            return await self._body_part()
        if self.stalled:
            return {"type": "http.disconnect"}
        # The body is in: whoever waits now waits for the disconnect. A stalled client
        # counts as one.
        stalled = self._stall_future()
        message = asyncio.ensure_future(self._receive())
        try:
            await asyncio.wait((message, stalled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not message.done():  # stalled, or the caller gave up waiting
                message.cancel()
        if message.done() and not message.cancelled():
            return message.result()
        return {"type": "http.disconnect"}

    async def _body_part(self) -> Message:
        left = self._body_deadline - self._loop.time()
        try:
            message = await asyncio.wait_for(self._receive(), max(left, 0.0))
        except TimeoutError:
            self._body_done = True  # what follows (the 408's own wait) is not the body
            raise HTTPException(
                status_code=REQUEST_TIMEOUT,
                detail="the request body did not arrive in time "
                f"(server.body_read_timeout_s={self.body_timeout_s:g})",
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self._body_done = True
        return message

    async def send(self, message: Message) -> None:
        if self.stalled:
            return  # the client is gone as far as the app knows
        self._sending_since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_later(self.send_timeout_s, self._check)
        try:
            await self._send(message)
        finally:
            self._sending_since = None

    def _check(self) -> None:
        """The timer: a send blocked send_timeout_s means a stalled client; one still
        blocked, less long, is checked again when it would be; none, no timer until the
        next send."""
        self._timer = None
        since = self._sending_since
        if since is None:
            return
        waited = self._loop.time() - since
        if waited < self.send_timeout_s:
            self._timer = self._loop.call_later(self.send_timeout_s - waited, self._check)
            return
        log.warning(
            "request %s: the client took none of the response for %gs "
            "(server.send_timeout_s): treated as gone",
            self.request_id,
            self.send_timeout_s,
        )
        stalled = self._stall_future()
        if not stalled.done():
            stalled.set_result(None)

    def _stall_future(self) -> asyncio.Future[None]:
        if self._stalled is None:
            self._stalled = self._loop.create_future()
        return self._stalled

    def close(self) -> None:
        """The request is over: no timer outlives it."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
