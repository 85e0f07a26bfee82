"""Admission: whether a request may go to its model's worker, and sending it there.

A request is refused before anything is sent when the gateway is shutting down, when the
model cannot serve it (capabilities), or when the model's queue is full (the worker's own
bound or `server.max_queued`). While a crashed model restarts, requests queue for the new
worker (bounded the same way); so does one sent to a worker that turns out to have died
before the gateway saw it go (its socket refused the request and its exit follows within
`DEATH_WAIT_S`). Aborting is idempotent and frees the request's place.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from gateway.errors import GatewayError
from gateway.workers.capabilities import check_capabilities, with_template_defaults
from gateway.workers.catalog import Catalog
from gateway.workers.client import Submission
from gateway.workers.control import ControlCalls
from gateway.workers.lifetime import Lifetime
from gateway.workers.pool import Pool
from gateway.workers.routing import Router, first_block
from gateway.workers.slots import Slot, WorkerHandle, lease
from gateway.workers.stream import RequestStream
from gateway.workers.transport import Transport
from shared.config import ServerConfig
from shared.protocol import Abort, Add
from shared.types import CanonicalRequest, ErrorCode, RequestKind

# How long a request that a local worker's socket refused waits to see that worker's exit
# (a killed process is seen going within milliseconds; a loaded machine may take longer).
DEATH_WAIT_S = 2.0


def shutting_down() -> GatewayError:
    return GatewayError(ErrorCode.SHUTTING_DOWN, "the gateway is shutting down", retry_after=5)


class Admission:
    def __init__(
        self,
        server: ServerConfig,
        catalog: Catalog,
        pool: Pool,
        find: Callable[[str], WorkerHandle | None],
        router: Router,
        lifetime: Lifetime,
        transport: Transport,
        calls: ControlCalls,
        draining: Callable[[], bool],
    ) -> None:
        self.server = server
        self.catalog = catalog
        self.pool = pool
        self.find = find
        self.router = router
        self.lifetime = lifetime
        self.transport = transport
        self.calls = calls
        self.draining = draining

    def check(self, name: str, needs: Sequence[str]) -> None:
        check_capabilities(self.catalog.slot(name), list(needs))

    async def submit(self, sub: Submission, retried: bool = False) -> RequestStream:
        """Send one request to its model's worker (loading it on demand)."""
        slot = self.catalog.slot(sub.model)
        if self.draining():
            raise shutting_down()
        if sub.keep_alive is not None:
            slot.keep_alive_s = sub.keep_alive
        request_id = sub.request_id or uuid.uuid4().hex
        request = with_template_defaults(slot.config, sub.kind, sub.request)
        needs = list(sub.needs)
        if needs:
            check_capabilities(slot, needs)
        add = Add(request_id, sub.kind, request, sub.sampling, sub.priority)
        elsewhere = bool(slot.ready_remotes())  # another machine serves it meanwhile
        if slot.backoff_until is not None and not elsewhere:  # refused until it restarts
            await self.pool.acquire(slot)  # raises the 503 with the time left
        if slot.restarting and not elsewhere:  # queued: it runs on the new worker once Ready
            if len(slot.replay) >= self.server.max_queued:
                raise self._queue_full(slot, len(slot.replay))
            stream = RequestStream(request_id, slot.name, "")
            stream.add = add
            slot.replay.append(stream)
            slot.served += 1
            self.lifetime.touch(slot)
            return stream
        handle = await self.worker_for(slot, sub.affinity, request)
        if needs:
            check_capabilities(slot, needs, handle.info)
        capacity = handle.capacity
        assert capacity is not None
        queued = len(handle.streams) - capacity.max_running
        if queued >= min(capacity.max_waiting, self.server.max_queued):
            raise self._queue_full(slot, len(handle.streams))
        stream = RequestStream(request_id, slot.name, handle.worker_id)
        stream.add = add
        if not lease(self.transport, handle, stream):
            if not retried and await self._gone(handle):  # queued for its successor
                return await self.submit(sub, retried=True)
            raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {slot.name!r} is unreachable")
        slot.served += 1
        self.lifetime.touch(slot)
        return stream

    async def _gone(self, handle: WorkerHandle) -> bool:
        """Whether a local worker whose socket refused a request has exited (its exit seen
        within DEATH_WAIT_S: the model is then restarting)."""
        if handle.remote is not None or handle.process is None:
            return False
        try:
            await asyncio.wait_for(handle.exited.wait(), DEATH_WAIT_S)
        except TimeoutError:
            return False
        return True

    async def worker_for(
        self, slot: Slot, affinity: str | None, request: CanonicalRequest | None = None
    ) -> WorkerHandle:
        """The replica a request goes to: among those serving now (routing.py) when the
        model has workers on other machines, else its own worker, loaded on demand. The
        conversation's key (`affinity`, else the prompt's first block) is only worked out
        when there is a choice to make."""
        replicas = slot.replicas()
        if slot.remotes and replicas:
            if len(replicas) > 1 and affinity is None and request is not None:
                affinity = first_block(request)
            return self.router.choose(replicas, affinity)
        if slot.config.placement == "remote":
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {slot.name!r} is served by workers on other machines and none is "
                "connected now (start one with `gatewayctl worker`)",
                retry_after=5,
            )
        return await self.pool.acquire(slot)

    def _queue_full(self, slot: Slot, in_flight: int) -> GatewayError:
        return GatewayError(
            ErrorCode.OVERLOADED,
            f"model {slot.name!r} is at capacity ({in_flight} requests in flight, its queue is "
            f"full: server.max_queued={self.server.max_queued}); retry shortly",
            retry_after=1,
        )

    def abort(self, stream: RequestStream) -> None:
        """The client went away or timed out: free its place in the worker (idempotent)."""
        stream.off_probation()  # whoever waits for it to make output waits no more
        slot = self.catalog.slots.get(stream.model)
        if slot is not None and stream in slot.replay:
            slot.replay.remove(stream)
            self.lifetime.released(slot)
            return
        handle = self.find(stream.worker_id)
        if handle is None or handle.streams.pop(stream.request_id, None) is None:
            return
        self.transport.send(handle.worker_id, Abort([stream.request_id]))
        self.lifetime.released(self.catalog.slots.get(handle.config.name))

    async def call(
        self, name: str, method: str, args: dict[str, Any], timeout: float = 30.0
    ) -> dict[str, Any]:
        """A control call to the model's worker (loading it on demand), e.g. tokenize."""
        if self.draining():
            raise shutting_down()
        slot = self.catalog.slot(name)
        handle = await self.worker_for(slot, None)
        result = await self.calls.call(
            self.transport, handle.worker_id, name, method, args, timeout
        )
        self.lifetime.touch(slot)
        return result

    async def tokenize(
        self, name: str, kind: RequestKind, request: CanonicalRequest, with_text: bool
    ) -> dict[str, Any]:
        slot = self.catalog.slot(name)
        check_capabilities(slot, ["tokenize", "chat"] if kind == RequestKind.CHAT else ["tokenize"])
        request = with_template_defaults(slot.config, kind, request)
        args = {"kind": kind.value, "request": msgspec.to_builtins(request), "with_text": with_text}
        return await self.call(name, "tokenize", args)
