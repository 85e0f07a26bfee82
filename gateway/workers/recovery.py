"""Recovery: what a worker's exit means, and what follows.

An exit asked for (unload, reload) ends whatever that worker still held with a clear error.
A worker that never got Ready failed to load: its waiters see why. Any other exit is a
crash. Requests that had produced nothing yet wait for the next worker (replay); text
requests that had produced tokens go on there from them (a continuation: the client sees a
pause); the others (speech) end with `worker_died`.

Blame, so that a poison request fails alone: a request a death touched is a suspect, and
goes to the next worker on probation until it makes output (continuations go first in the
worker's queue). A death while exactly one request is on probation is that request's
strike alone; a death while several are is nobody's, and each of those is tried alone on
the next worker (one at a time, once the others sent there made output), so the next such
death points at one; a death with nobody on probation is everyone's strike. A request with
more strikes than `server.resume_max` (a replayed one: more than one) ends with
`worker_died` and is not sent again: it cannot crash-loop its model nor take the others
with it. While a continuation waits, its client hears an SSE comment every few seconds.

The model restarts after an exponential backoff (doubling per crash in the window; a worker
that had made output starts the count over: a kill from outside or a poison request is not
a broken model); one that crashed `server.crash_loop_count` times within
`server.crash_loop_window_s`, no worker after the first of them having made output, backs
off longer (`server.crash_backoff_s`, doubling per loop in a row up to `crash_backoff_max_s`: state
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
from gateway.workers.stream import RequestStream
from gateway.workers.tasks import Tasks
from gateway.workers.transport import Transport
from shared.config import ServerConfig
from shared.paths import RunDir
from shared.types import ErrorCode

log = logging.getLogger("gateway.workers.recovery")

PAUSE_KEEPALIVE_S = 5.0  # a paused stream's client hears from the gateway this often

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
        self.pause_keepalive_s = PAUSE_KEEPALIVE_S

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
        if handle.served:  # it made output: the model works, whatever killed this worker
            slot.crashes.clear()
            slot.loops = 0
        slot.crashes.append(now)
        slot.last_crash = now
        message = f"the worker of model {slot.name!r} died: {reason}"
        self.calls.fail(handle.worker_id, message)
        fresh, again = self.blame(slot, list(handle.streams.values()), message)
        handle.streams.clear()
        slot.replay.extend(again)
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
            slot.died += self.fail_replay(slot, f"{message}; {slot.last_error}")
            self.tasks.spawn(self._restart(slot, delay))
            return
        log.error(
            "model %s: %s; restarting in %.1fs (%d request(s) to replay, %d to resume)",
            slot.name,
            reason,
            delay,
            fresh,
            len(again) - fresh,
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
                self._give_up(slot, reason)
        except Exception as exc:  # no worker to wait for: a spawn that failed (descriptors)
            log.exception("model %s: restarting it failed", slot.name)
            if slot.restarting:
                self._give_up(slot, f"{type(exc).__name__}: {exc}")

    def _give_up(self, slot: Slot, reason: str) -> None:
        """A restart that cannot go on: the model fails, and what waited for it ends."""
        slot.restarting = slot.restart_pending = False
        slot.error = slot.last_error = f"restart failed: {reason}"
        slot.died += self.fail_replay(slot, slot.error)

    def blame(
        self, slot: Slot, held: list[RequestStream], message: str
    ) -> tuple[int, list[RequestStream]]:
        """Who a death is laid on, and what goes to the next worker: (how many of those
        had made nothing yet, the requests to send again)."""
        suspects = [s for s in held if s.probation]
        if len(suspects) == 1:
            charged = suspects  # it alone was being tried: the death is its own
        elif suspects:
            charged = []  # one of them, nobody knows which: each is tried alone next
            for stream in suspects:
                stream.alone = True
        else:
            charged = held  # nobody on trial: everyone it held shares the death
        again: list[RequestStream] = []
        for stream in held:
            ended = stream.finished
            stream.probation = False
            stream.crashes += 1
            if stream in charged:
                stream.strikes += 1
            if stream.received and not stream.resumable:  # audio: nothing to go on from
                stream.fail(ErrorCode.WORKER_DIED, message)
            elif stream.resumable and stream.strikes > self.server.resume_max:
                self._failed_alone(slot, stream, len(charged) == 1)
                stream.fail(
                    ErrorCode.WORKER_DIED,
                    f"{message}; this request was resumed {stream.resumes} times and its "
                    "worker died with it again, so it is not resumed again "
                    f"(server.resume_max={self.server.resume_max}): it may be what kills "
                    "the worker",
                )
            elif not stream.resumable and stream.strikes > 1:
                self._failed_alone(slot, stream, len(charged) == 1)
                stream.fail(
                    ErrorCode.WORKER_DIED,
                    f"{message}; it was the second worker to die while serving this request, "
                    "which is not sent again",
                )
            else:
                if stream.resumable:
                    stream.resumes += 1
                    stream.paused = True
                    slot.resumed += 1
                else:
                    slot.replayed += 1
                again.append(stream)
            slot.died += stream.finished and not ended
        again.sort(key=lambda s: s.resumable)  # those that had made nothing first
        paused = [s for s in again if s.paused]
        if paused:
            self.tasks.spawn(self._keep_alive(paused))
        return sum(not s.resumable for s in again), again

    async def _keep_alive(self, paused: list[RequestStream]) -> None:
        """Every `pause_keepalive_s` while they wait, the paused streams' readers hear of
        it (an SSE comment to their clients: a pause, not a dead connection)."""
        while paused:
            await asyncio.sleep(self.pause_keepalive_s)
            paused = [s for s in paused if s.paused and not s.finished]
            for stream in paused:
                stream.nudge()

    @staticmethod
    def _failed_alone(slot: Slot, stream: RequestStream, alone: bool) -> None:
        log.error(
            "model %s: request %s is not sent again: its worker died with it %d times%s",
            slot.name,
            stream.request_id,
            stream.crashes,
            " (this time it alone was on trial)" if alone else "",
        )

    def resubmit(self, slot: Slot, handle: WorkerHandle) -> None:
        """The requests waiting for a new worker go to `handle`: new ones at once, those a
        death touched on probation, all together but for those on probation at a death
        nobody could be blamed for: those are tried one at a time once the others made
        output, each once the one before did."""
        replay = slot.replay
        slot.replay = [s for s in replay if s.alone]
        together = [s for s in replay if not s.alone]
        for stream in together:
            self.send(slot, handle, stream)
        if slot.replay:
            trial = [s for s in together if s.probation]
            self.tasks.spawn(self._one_at_a_time(slot, handle, trial))
        if replay:
            log.info("model %s: replayed %d request(s)", slot.name, len(replay))

    async def _one_at_a_time(
        self, slot: Slot, handle: WorkerHandle, trial: list[RequestStream]
    ) -> None:
        """Once `trial` (sent together) made output, the suspects to try alone go singly,
        those with the fewest strikes first, while `handle` serves; what it has not sent
        when that worker dies waits for the next one."""
        exited = asyncio.ensure_future(handle.exited.wait())
        try:
            while slot.handle is handle and not exited.done():
                if not trial:
                    waiting = [s for s in slot.replay if s.alone]
                    if not waiting:
                        return
                    stream = min(waiting, key=lambda s: s.strikes)
                    slot.replay.remove(stream)
                    if not self.send(slot, handle, stream):
                        continue
                    trial = [stream]
                waits: set[asyncio.Future[Any]] = {
                    asyncio.ensure_future(s.cleared()) for s in trial
                }
                try:
                    while waits and not exited.done():
                        _, waits = await asyncio.wait(
                            waits | {exited}, return_when=asyncio.FIRST_COMPLETED
                        )
                        waits.discard(exited)
                finally:
                    for wait in waits:
                        wait.cancel()
                if not waits and len(trial) == 1:
                    trial[0].alone = False  # it made output alone: not the killer
                trial = []
        finally:
            exited.cancel()

    def send(self, slot: Slot, handle: WorkerHandle, stream: RequestStream) -> bool:
        """One waiting request to `handle` (on probation if a death touched it)."""
        if stream.finished:
            return False
        if stream.crashes:
            stream.on_probation()
        try:
            sent = lease(self.transport, handle, stream)
        except GatewayError as exc:
            stream.fail(exc.code, exc.message)
            return False
        if not sent:
            stream.fail(ErrorCode.WORKER_UNAVAILABLE, f"model {slot.name!r} is unreachable")
        return sent

    def fail_replay(self, slot: Slot, message: str) -> int:
        """Ends the requests waiting for a new worker; how many there were."""
        replay, slot.replay = slot.replay, []
        for stream in replay:
            stream.fail(ErrorCode.WORKER_DIED, message)
        return len(replay)
