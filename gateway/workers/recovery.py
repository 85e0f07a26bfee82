"""Recovery: what a worker's exit means, and what follows.

An exit asked for (unload, reload) ends whatever that worker still held with a clear error.
A worker that never got Ready failed to load: its waiters see why. Any other exit is a
crash. Requests that had produced nothing yet wait for the next worker (replay, once: a
request whose worker dies twice while holding it ends with `worker_died`, so that a request
that kills every worker it reaches cannot crash-loop its model). Text requests that had
produced tokens go on there from them (a continuation: the client sees a pause), at most
`server.resume_max` times, then `worker_died`. The others (speech) end with `worker_died`.
The model restarts after an exponential backoff; one that crashed
`server.crash_loop_count` times within `server.crash_loop_window_s` backs off longer
(`server.crash_backoff_s`, doubling per loop in a row up to `crash_backoff_max_s`: state
`backoff`, its requests refused with Retry-After), then restarts by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gateway.errors import GatewayError
from gateway.workers.control import ControlCalls
from gateway.workers.slots import Slot, WorkerHandle, describe_exit, lease, tail
from gateway.workers.tasks import Tasks
from gateway.workers.transport import Transport
from shared.config import ServerConfig
from shared.paths import RunDir
from shared.types import ErrorCode

log = logging.getLogger("gateway.workers.recovery")

# Brings a crashed model's next worker up (the pool's load, marked as a restart).
Restart = Callable[[Slot], Coroutine[Any, Any, WorkerHandle]]


def crash_backoff_s(server: ServerConfig, loops: int) -> float:
    """The wait after the `loops`-th crash loop in a row."""
    return min(server.crash_backoff_s * 2 ** max(loops - 1, 0), server.crash_backoff_max_s)


def backoff_s(server: ServerConfig, crashes: int) -> float:
    """The wait before restarting after the `crashes`-th crash in the window."""
    return min(server.restart_backoff_s * 2 ** max(crashes - 1, 0), server.restart_backoff_max_s)


class Recovery:
    def __init__(
        self,
        server: ServerConfig,
        run_dir: RunDir,
        transport: Transport,
        calls: ControlCalls,
        tasks: Tasks,
        restart: Restart,
    ) -> None:
        self.server = server
        self.run_dir = run_dir
        self.transport = transport
        self.calls = calls
        self.tasks = tasks
        self.restart = restart

    def exited(self, slot: Slot, handle: WorkerHandle) -> None:
        """`handle`'s process has exited (its code is known)."""
        name = slot.name
        if handle in slot.retiring:
            slot.retiring.remove(handle)
        if handle.retiring:
            message = f"the request was aborted because model {name!r} was unloaded"
            for stream in list(handle.streams.values()):
                stream.fail(ErrorCode.SHUTTING_DOWN, message)
            handle.streams.clear()
            return
        # An exit nobody asked for.
        if slot.handle is handle:
            slot.handle = None
        reason = handle.error or f"the worker exited ({describe_exit(handle.exit_code)})"
        slot.exit_code = handle.exit_code
        slot.log_tail = tail(self.run_dir.worker_log(name))
        slot.last_error = reason
        if not handle.info and not handle.restart:
            # It never got Ready: a load failure, not a crash. Its waiters see the reason.
            log.error("model %s: load failed: %s", name, reason)
            return
        self.crashed(slot, handle, reason)

    def crashed(self, slot: Slot, handle: WorkerHandle, reason: str) -> None:
        now = time.monotonic()
        window = self.server.crash_loop_window_s
        while slot.crashes and now - slot.crashes[0] > window:
            slot.crashes.popleft()
        if slot.last_crash is not None and now - slot.last_crash > window:
            slot.loops = 0  # it served a whole window since its last crash
        slot.crashes.append(now)
        slot.last_crash = now
        limit = self.server.resume_max
        sent = [s for s in handle.streams.values() if s.received]
        resumed = [s for s in sent if s.resumable and s.resumes < limit]
        again = [s for s in handle.streams.values() if not s.received and s.replays]
        fresh = [s for s in handle.streams.values() if not s.received and not s.replays]
        handle.streams.clear()
        message = f"the worker of model {slot.name!r} died: {reason}"
        self.calls.fail(handle.worker_id, message)
        for stream in sent:
            if stream in resumed:
                stream.resumes += 1
            elif stream.resumable:  # resumed as often as allowed: it may be what kills them
                stream.fail(
                    ErrorCode.WORKER_DIED,
                    f"{message}; the worker serving this request died {stream.resumes + 1} "
                    "times while it ran, and it is not resumed again (server.resume_max)",
                )
            else:
                stream.fail(ErrorCode.WORKER_DIED, message)
        for stream in again:
            stream.fail(
                ErrorCode.WORKER_DIED,
                f"{message}; it was the second worker to die while serving this request, "
                "which is not sent again",
            )
        for stream in fresh:
            stream.replays += 1
        slot.replay.extend(fresh + resumed)
        slot.restarting = slot.restart_pending = True
        delay = backoff_s(self.server, len(slot.crashes))
        if len(slot.crashes) >= self.server.crash_loop_count:
            slot.loops += 1
            delay = crash_backoff_s(self.server, slot.loops)
            slot.backoff_until = now + delay
            slot.last_error = (
                f"crash loop: {len(slot.crashes)} crashes within "
                f"{self.server.crash_loop_window_s:g}s; last: {reason}"
            )
            slot.crashes.clear()  # the next loop counts crashes after this backoff
            log.error(
                "model %s: %s; backing off %.0fs before the next attempt",
                slot.name,
                slot.last_error,
                delay,
            )
            self.fail_replay(slot, f"{message}; {slot.last_error}")
            self.tasks.spawn(self._restart(slot, delay))
            return
        log.error(
            "model %s: %s; restarting in %.1fs (%d request(s) to replay, %d to resume)",
            slot.name,
            reason,
            delay,
            len(fresh),
            len(resumed),
        )
        self.tasks.spawn(self._restart(slot, delay))

    async def _restart(self, slot: Slot, delay: float) -> None:
        await asyncio.sleep(delay)
        slot.backoff_until = None
        if not slot.restart_pending or slot.handle is not None or slot.loading is not None:
            return
        slot.restart_pending = False
        slot.restarts += 1
        task = asyncio.create_task(self.restart(slot))
        slot.loading = task
        task.add_done_callback(lambda _: setattr(slot, "loading", None))
        try:
            await task
            slot.restarting = False
        except (GatewayError, asyncio.CancelledError) as exc:
            if not slot.restart_pending and slot.restarting:
                # Not a crash of the new worker (that schedules the next attempt): give up.
                reason = getattr(exc, "message", "the restart was cancelled")
                slot.restarting = False
                slot.error = slot.last_error = f"restart failed: {reason}"
                self.fail_replay(slot, slot.error)

    def resubmit(self, slot: Slot, handle: WorkerHandle) -> None:
        """The requests waiting for a new worker go to `handle`."""
        replay, slot.replay = slot.replay, []
        for stream in replay:
            if stream.finished:
                continue
            try:
                sent = lease(self.transport, handle, stream)
            except GatewayError as exc:
                stream.fail(exc.code, exc.message)
                continue
            if not sent:
                stream.fail(ErrorCode.WORKER_UNAVAILABLE, f"model {slot.name!r} is unreachable")
        if replay:
            log.info("model %s: replayed %d request(s)", slot.name, len(replay))

    def fail_replay(self, slot: Slot, message: str) -> None:
        replay, slot.replay = slot.replay, []
        for stream in replay:
            stream.fail(ErrorCode.WORKER_DIED, message)
