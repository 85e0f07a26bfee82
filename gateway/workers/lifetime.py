"""A model's lifetime when idle: its TTL (time to live) runs from the moment its last
request leaves and stops when the next arrives; when it runs out, the model is unloaded.

The TTL is the last request's `keep_alive` if one was given, else the model's `ttl`, else
`server.default_ttl`; a negative one keeps the model loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.errors import GatewayError
from gateway.workers.slots import Slot
from gateway.workers.tasks import Tasks
from shared.config import ServerConfig, parse_duration

log = logging.getLogger("gateway.workers.lifetime")


class Lifetime:
    def __init__(
        self, server: ServerConfig, tasks: Tasks, unload: Callable[[str], Awaitable[bool]]
    ) -> None:
        self.server = server
        self.tasks = tasks
        self.unload = unload

    def ttl_of(self, slot: Slot) -> float:
        if slot.keep_alive_s is not None:
            return slot.keep_alive_s
        return parse_duration(
            slot.config.ttl if slot.config.ttl is not None else self.server.default_ttl
        )

    def touch(self, slot: Slot) -> None:
        """A request arrived: the model is in use."""
        slot.last_used = time.monotonic()
        self.cancel(slot)

    def cancel(self, slot: Slot) -> None:
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
            slot.idle_timer = None
        slot.idle_since = None

    def released(self, slot: Slot | None) -> None:
        """A request left its worker: a model with none left starts its TTL."""
        if slot is None or slot.in_flight() or slot.handle is None or slot.unloading:
            return
        slot.last_used = time.monotonic()
        ttl = self.ttl_of(slot)
        self.cancel(slot)
        if ttl < 0:
            return
        slot.idle_since = time.monotonic()
        slot.idle_timer = asyncio.get_running_loop().call_later(ttl, self._expire, slot)

    def _expire(self, slot: Slot) -> None:
        slot.idle_timer = None
        if slot.in_flight() or slot.handle is None:
            return
        log.info("model %s: idle for %gs (ttl); unloading", slot.name, self.ttl_of(slot))
        self.tasks.spawn(self._unload_quietly(slot.name))

    async def _unload_quietly(self, name: str) -> None:
        with contextlib.suppress(GatewayError):
            await self.unload(name)
