"""Liveness: a worker that stops talking, or whose engine has work and stops stepping, is
killed (its exit then goes through recovery like any crash).

Process exit is authoritative for death; this catches the living dead: a worker wedged in a
kernel, a deadlock, a machine swapping so hard that nothing moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from gateway.workers.slots import WorkerHandle
from shared.config import ServerConfig

log = logging.getLogger("gateway.workers.liveness")

SWEEP_S = 0.5


def note_step(handle: WorkerHandle, step: int, now: float) -> None:
    """A frame from the worker said how far its engine got."""
    handle.last_seen = now
    if step != handle.step:
        handle.step = step
        handle.step_moved_at = now


def verdict(handle: WorkerHandle, now: float, silence_s: float, wedge_s: float) -> str | None:
    """Why this worker must be killed, or None while it is alive (or still loading)."""
    if handle.exited.is_set() or handle.killed or not handle.is_ready:
        return None
    if now - handle.last_seen > silence_s:
        return f"no heartbeat for {silence_s:g}s (server.heartbeat_timeout_s)"
    hb = handle.heartbeat
    # work: what its engine holds, or requests sent that it has not taken in (an engine
    # stuck before it takes them: a sharded group's rank 0 waiting on a frozen rank)
    busy = bool(handle.streams) or (hb is not None and (hb.running + hb.waiting) > 0)
    if busy and now - handle.step_moved_at > wedge_s:
        return f"engine stalled: no step for {wedge_s:g}s with work (wedge_timeout_s)"
    return None


class Lose(Protocol):
    """What becomes of a remote worker found dead: the gateway cannot kill it, it is lost."""

    def __call__(self, handle: WorkerHandle, reason: str) -> None: ...


class Liveness:
    def __init__(self, server: ServerConfig, lose: Lose | None = None) -> None:
        self.silence_s = server.heartbeat_timeout_s
        self.wedge_s = server.wedge_timeout_s
        self.lose = lose

    def sweep(self, handles: list[WorkerHandle], now: float) -> list[WorkerHandle]:
        """Kill every local worker found dead or wedged, lose every such remote one;
        returns them."""
        killed = []
        for handle in handles:
            why = verdict(handle, now, self.silence_s, self.wedge_s)
            if why is None:
                continue
            if handle.process is None:
                if self.lose is not None:
                    self.lose(handle, why)
                killed.append(handle)
                continue
            handle.error, handle.killed = why, True
            log.error("model %s: %s; killing pid %d", handle.config.name, why, handle.pid)
            with contextlib.suppress(ProcessLookupError):
                handle.process.kill()
            killed.append(handle)
        return killed

    async def watch(self, handles: Callable[[], list[WorkerHandle]]) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep(handles(), time.monotonic())
