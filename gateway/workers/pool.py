"""The pool of workers: loading a model (single flight: concurrent requests start one
worker), unloading it (drain, or abort with force), reloading it with zero downtime, making
room in the memory budget, and finding the worker for a new request (loading on demand).

Requests hold a lease on the worker they run on (its `streams`): nothing unloads a worker
under an in-flight request except a timeout or `force`, and both end those requests with a
clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time

from gateway.errors import GatewayError
from gateway.workers.catalog import Catalog
from gateway.workers.client import ModelState
from gateway.workers.lifetime import Lifetime
from gateway.workers.memory import MemoryBudget
from gateway.workers.processes import Processes
from gateway.workers.recovery import Recovery
from gateway.workers.slots import Slot, WorkerHandle, consume
from gateway.workers.tasks import Tasks
from gateway.workers.transport import Transport
from shared.config import ServerConfig
from shared.protocol import Shutdown, ShutdownMode
from shared.types import ErrorCode

log = logging.getLogger("gateway.workers.pool")

ACQUIRE_TRIES = 3  # a worker may die between its Ready and a request's arrival
RESTART_POLL_S = 0.1


class Pool:
    def __init__(
        self,
        server: ServerConfig,
        catalog: Catalog,
        processes: Processes,
        recovery: Recovery,
        lifetime: Lifetime,
        memory: MemoryBudget,
        transport: Transport,
        tasks: Tasks,
    ) -> None:
        self.server = server
        self.catalog = catalog
        self.processes = processes
        self.recovery = recovery
        self.lifetime = lifetime
        self.memory = memory
        self.transport = transport
        self.tasks = tasks

    # ---- load -----------------------------------------------------------------------

    async def load(self, name: str, wait: bool = True) -> Slot:
        """Explicit load: also retries a failed model."""
        slot = self.catalog.slot(name)
        if slot.config.placement == "remote":
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                f"model {name!r} is served by workers on other machines (placement = "
                '"remote"): start one there with `gatewayctl worker`',
            )
        if slot.state == ModelState.UNLOADING:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE, f"model {name!r} is being unloaded", retry_after=2
            )
        if slot.state == ModelState.FAILED:
            slot.error = None
            slot.crashes.clear()
        if slot.state == ModelState.BACKOFF:  # asked for: now, not at the backoff's end
            slot.backoff_until = None
            slot.restarting = slot.restart_pending = False
        if slot.restarting:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {name!r} is restarting after a crash",
                retry_after=2,
            )
        task = self.load_task(slot)
        if wait and task is not None:
            await self._await_load(slot, task)
        return slot

    def load_task(self, slot: Slot) -> asyncio.Task[WorkerHandle] | None:
        """Single flight: the one load under way, started if none is; None if loaded."""
        if slot.handle is not None and slot.loading is None:
            return None
        if slot.loading is None:
            slot.loading = asyncio.create_task(self.bring_up(slot))
            slot.loading.add_done_callback(lambda _: setattr(slot, "loading", None))
            slot.loading.add_done_callback(consume)
        return slot.loading

    async def _await_load(self, slot: Slot, task: asyncio.Task[WorkerHandle]) -> WorkerHandle:
        timeout = self.server.load_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {slot.name!r} did not load within server.load_timeout_s={timeout:g}s",
                retry_after=5,
            ) from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.cancelled() or (current is not None and current.cancelling()):
                raise  # this waiter was cancelled (its client left), not the load
            # the load was called off under it: an unload, or the gateway shutting down
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {slot.name!r} was unloaded while it was loading",
                retry_after=2,
            ) from None

    async def bring_up(self, slot: Slot, restart: bool = False) -> WorkerHandle:
        """Room in the budget, a worker spawned, its Ready; then the requests that waited
        for it (a restart's replay) are sent, and its TTL starts."""
        slot.error = None
        try:
            await self.make_room(slot)
        except GatewayError as exc:
            if not restart:
                slot.last_error = exc.message
            raise
        handle = await self.processes.spawn(slot.config, restart)
        slot.handle = handle
        try:
            await self.processes.wait_ready(handle, self.server.load_timeout_s)
        except GatewayError as exc:
            if not handle.exited.is_set():
                handle.error = exc.message
                await self.processes.kill(handle, signal.SIGKILL, grace=0)
            if slot.handle is handle:
                slot.handle = None
            if not restart:  # a failed restart is a crash: recovery decides what follows
                slot.error = slot.last_error = handle.error or exc.message
                self.recovery.fail_replay(slot, exc.message)
            raise
        self.recovery.resubmit(slot, handle)
        self.lifetime.touch(slot)
        self.lifetime.released(slot)  # idle until a request comes: the TTL runs
        return handle

    async def make_room(self, slot: Slot, extra: int = 0) -> None:
        await self.memory.make_room(slot, self.catalog.slots, self.unload, extra)

    # ---- unload / reload ------------------------------------------------------------

    async def unload(self, name: str, force: bool = False, timeout: float | None = None) -> bool:
        """Stop new requests, drain (or abort with force), end the process. False if not loaded."""
        slot = self.catalog.slot(name)
        timeout = self.server.drain_timeout_s if timeout is None else timeout
        if slot.restarting:
            slot.restarting = slot.restart_pending = False
            self.recovery.fail_replay(slot, f"model {slot.name!r} was unloaded")
        if slot.loading is not None:
            slot.loading.cancel()
            with contextlib.suppress(BaseException):
                await slot.loading
        handle = slot.handle
        if handle is None and not slot.retiring:
            return False
        slot.unloading = True
        self.lifetime.cancel(slot)
        try:
            if handle is not None:
                slot.handle = None
                await self.retire(slot, handle, force, timeout)
            await asyncio.gather(*(w.exited.wait() for w in list(slot.retiring)))
        finally:
            slot.unloading = False
        self.recovery.fail_replay(slot, f"model {slot.name!r} was unloaded")
        log.info("model %s: unloaded", slot.name)
        return True

    async def retire(self, slot: Slot, handle: WorkerHandle, force: bool, timeout: float) -> None:
        """Drain a worker that takes no new requests, then end it."""
        handle.retiring = True
        slot.retiring.append(handle)
        if not handle.is_ready:  # still loading: nothing to drain
            await self.processes.kill(handle, signal.SIGTERM, grace=5)
            return
        mode = ShutdownMode.ABORT if force else ShutdownMode.DRAIN
        self.transport.send(handle.worker_id, Shutdown(mode, timeout))
        try:
            await asyncio.wait_for(handle.exited.wait(), timeout + 5)
        except TimeoutError:
            await self.processes.kill(handle, signal.SIGTERM, grace=5)

    async def reload(self, name: str) -> WorkerHandle:
        """Zero downtime: a new worker takes over once Ready; the old one drains."""
        slot = self.catalog.slot(name)
        old = slot.handle
        if old is None or slot.loading is not None:
            task = self.load_task(slot)
            if task is None:  # a worker, not ready yet: none of ours to wait for
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE, f"model {name!r} is starting", retry_after=2
                )
            return await self._await_load(slot, task)
        await self.make_room(slot, extra=old.memory_bytes())
        new = await self.processes.spawn(slot.config, restart=False)
        try:
            await self.processes.wait_ready(new, self.server.load_timeout_s)
        except GatewayError:
            if not new.exited.is_set():
                await self.processes.kill(new, signal.SIGKILL, grace=0)
            raise
        if slot.handle is not old:  # the old worker died while this one loaded
            return await self._after_crash(slot, new)
        slot.handle = new
        self.lifetime.touch(slot)
        self.lifetime.released(slot)
        log.info("model %s: reloaded; worker %s drains", slot.name, old.worker_id)
        self.tasks.spawn(self.retire(slot, old, False, self.server.drain_timeout_s))
        if slot.replay:  # requests a death left to be tried alone go on here
            self.recovery.resubmit(slot, new)
        return new

    async def _after_crash(self, slot: Slot, new: WorkerHandle) -> WorkerHandle:
        """A reload whose old worker crashed while `new` loaded: `new` takes what waited
        for the restart, unless the restart's own worker got there first."""
        if slot.restarting and slot.handle is None and slot.loading is None:
            slot.restarting = slot.restart_pending = False  # the restart is not needed
            slot.backoff_until = None
            slot.handle = new
            self.recovery.resubmit(slot, new)
            self.lifetime.touch(slot)
            self.lifetime.released(slot)
            log.info("model %s: reloaded; its old worker had died meanwhile", slot.name)
            return new
        await self.processes.kill(new, signal.SIGTERM, grace=5)
        if slot.loading is not None:
            return await self._await_load(slot, slot.loading)
        if slot.handle is None:  # unloaded meanwhile, or its restart failed
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {slot.name!r} lost its worker during the reload: {slot.last_error}",
                retry_after=2,
            )
        return slot.handle

    # ---- the worker for a request ---------------------------------------------------

    async def acquire(self, slot: Slot) -> WorkerHandle:
        """The worker for a new request: loading the model on demand (and waiting)."""
        for _ in range(ACQUIRE_TRIES):
            state = slot.state
            if state == ModelState.READY and slot.handle is not None:
                return slot.handle
            if state == ModelState.FAILED:
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"model {slot.name!r} failed: {slot.error}; "
                    f"`gatewayctl load {slot.name}` tries again",
                )
            if state == ModelState.BACKOFF and slot.backoff_until is not None:
                left = max(0.0, slot.backoff_until - time.monotonic())
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"model {slot.name!r} is backing off after a crash loop "
                    f"({slot.last_error}); it restarts by itself in {left:.0f}s "
                    f"(`gatewayctl load {slot.name}` now)",
                    retry_after=max(1, math.ceil(left)),
                )
            if slot.restarting and slot.loading is None:
                await asyncio.sleep(RESTART_POLL_S)
                continue
            if state == ModelState.UNLOADING:
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"model {slot.name!r} is being unloaded",
                    retry_after=2,
                )
            if state == ModelState.UNLOADED and slot.config.on_demand == "refuse":
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"model {slot.name!r} is not loaded; load it with "
                    f"`gatewayctl load {slot.name}`",
                    retry_after=30,
                )
            task = self.load_task(slot)
            if task is not None:
                await self._await_load(slot, task)
            elif slot.handle is not None and not slot.handle.is_ready:
                await self.processes.wait_ready(slot.handle, self.server.load_timeout_s)
        raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {slot.name!r} keeps failing")
