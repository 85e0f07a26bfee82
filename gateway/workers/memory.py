"""The memory budget: what loaded workers use, and making room for one more.

The budget is server.memory_budget_gb, or three quarters of the device's memory: unified
memory on a Mac, the GPU's under CUDA, host RAM on MLX's CPU device. It is known before the
first worker starts (gateway/workers/device.py) and follows the device memory a worker's Ready
reports, should that differ.

A worker counts for the larger of its measured footprint and its model's estimate (a worker
still loading has measured little yet). Room is made by evicting idle models, least
recently used first; when none is idle, `server.memory_policy` decides: refuse, wait for one
to become idle, or preempt a lower-priority model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from gateway.errors import GatewayError
from gateway.workers.device import Device
from gateway.workers.slots import GiB, Slot, estimate_bytes
from shared.config import ServerConfig
from shared.protocol import Ready
from shared.types import ErrorCode

log = logging.getLogger("gateway.workers.supervisor")


class Unload(Protocol):
    """Supervisor.unload."""

    async def __call__(
        self, name: str, force: bool = False, timeout: float | None = None
    ) -> bool: ...


DEVICE_SHARE = 0.75  # of the device's memory, when server.memory_budget_gb is not set


class MemoryBudget:
    def __init__(self, server: ServerConfig, device: Device) -> None:
        self.server = server
        self.total = device.memory_bytes
        self.source = device.memory_source
        self.budget = self._budget()

    def _budget(self) -> int:
        budget_gb = self.server.memory_budget_gb
        return int(budget_gb * GiB) if budget_gb else int(self.total * DEVICE_SHARE)

    def observe(self, ready: Ready) -> None:
        """A worker's Ready: the device MLX chose and its memory correct what was detected."""
        if ready.device_memory_bytes <= 0 or ready.device_memory_bytes == self.total:
            return
        log.info(
            "device memory: %.1f GiB on the worker's %s (was %.1f GiB from %s)",
            ready.device_memory_bytes / GiB,
            ready.device or "device",
            self.total / GiB,
            self.source,
        )
        self.total = ready.device_memory_bytes
        self.source = f"worker ({ready.device or 'device'})"
        self.budget = self._budget()

    def used(self, slots: Iterable[Slot], exclude: Slot | None = None) -> int:
        used = 0
        for slot in slots:
            if slot is exclude:
                continue
            for handle in ([slot.handle] if slot.handle else []) + slot.retiring:
                used += max(handle.memory_bytes(), estimate_bytes(slot.config, self.total))
        return used

    async def make_room(
        self, slot: Slot, slots: dict[str, Slot], unload: Unload, extra: int = 0
    ) -> None:
        """Evict idle models (least recently used first) until `slot` fits the budget;
        then apply server.memory_policy."""
        need = estimate_bytes(slot.config, self.total) + extra
        deadline = time.monotonic() + self.server.memory_wait_s
        while self.used(slots.values(), exclude=slot) + need > self.budget:
            others = [s for s in slots.values() if s is not slot and s.handle is not None]
            idle = [s for s in others if s.in_flight() == 0 and s.is_evictable]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                log.info("model %s: evicted (idle) to make room for %s", victim.name, slot.name)
                await unload(victim.name)
                continue
            policy = self.server.memory_policy
            if policy == "preempt":
                lower = [s for s in others if s.config.priority < slot.config.priority]
                if lower:
                    victim = min(lower, key=lambda s: (s.config.priority, s.last_used))
                    log.warning("model %s: preempted for %s", victim.name, slot.name)
                    await unload(victim.name, force=True)
                    continue
            used = self.used(slots.values(), exclude=slot)
            message = (
                f"model {slot.name!r} needs {need / GiB:.1f} GiB; "
                f"{used / GiB:.1f} of the {self.budget / GiB:.1f} GiB budget are in use by busy "
                "models (server.memory_budget_gb)"
            )
            if policy == "wait" and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                continue
            raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, message, retry_after=10)
