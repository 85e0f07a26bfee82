"""Supervisor: the model catalog and one worker process per loaded model.

Each configured model has a Slot: its state (unloaded, loading, ready, unloading, failed),
the worker serving new requests, older workers still draining (reload, unload), and its
history (crashes, restarts, requests served). Requests hold a lease on the worker they run
on (its `streams`): nothing unloads a worker under an in-flight request except a timeout or
`--force`, and both end those requests with a clear error.

Liveness: process exit is authoritative. A worker that dies is restarted with exponential
backoff; its requests that had produced nothing yet are replayed on the new worker, the
others end with a terminal error; a crash loop marks the model failed with the worker's exit
status and the tail of its log. Heartbeat silence, or an engine with work whose step counter
stands still, gets a worker killed (and so restarted).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import msgspec

from gateway.api.stream import RequestStream
from gateway.errors import GatewayError
from gateway.workers.capabilities import check_capabilities, with_template_defaults
from gateway.workers.control import ControlCalls
from gateway.workers.device import detect_device
from gateway.workers.leftovers import reap_leftovers, save_pids
from gateway.workers.memory import MemoryBudget
from gateway.workers.slots import (
    ModelState,
    Slot,
    WorkerHandle,
    consume,
    describe_exit,
    remove_sockets,
    status_row,
    tail,
)
from gateway.workers.transport import Transport
from shared.blas import worker_env
from shared.config import Config, ModelConfig, parse_duration
from shared.paths import RunDir
from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Add,
    ControlReply,
    FromWorker,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    ShutdownMode,
    StepOutputs,
    WorkerDead,
)
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    RequestKind,
    SamplingParams,
)

log = logging.getLogger("gateway.workers.supervisor")


class Supervisor:
    def __init__(self, config: Config, run_dir: RunDir) -> None:
        self.config = config
        self.server = config.server
        self.run_dir = run_dir
        self.slots: dict[str, Slot] = {m.name: Slot(m) for m in config.models}
        self.aliases = {a: m.name for m in config.models for a in m.aliases}
        self._by_id: dict[str, WorkerHandle] = {}
        self._serial = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.draining = False  # shutting down: new requests get 503 shutting_down
        self.calls = ControlCalls()  # control calls awaiting their workers' replies
        self._stopping: asyncio.Future[None] | None = None
        self.started_at = time.time()
        self.transport = Transport(run_dir.requests_ipc, run_dir.outputs_ipc)
        self.device = detect_device()
        self.memory = MemoryBudget(self.server, self.device)

    @property
    def models(self) -> dict[str, ModelConfig]:
        return {name: slot.config for name, slot in self.slots.items()}

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self.run_dir.create()
        reap_leftovers(self.run_dir.workers_file)
        self.transport.bind(self._on_frame)
        self._spawn_task(self._watch_liveness())
        for slot in self.slots.values():
            if slot.config.preload:
                self._load_task(slot)
        loads = [s.loading for s in self.slots.values() if s.loading is not None]
        await asyncio.gather(*loads, return_exceptions=True)

    async def stop(self) -> None:
        """Refuse new requests, drain every model for server.drain_timeout_s, end the workers.
        Idempotent: a server's shutdown hook and the app's lifespan may both call it."""
        self.draining = True
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._drain_all())
        await asyncio.shield(self._stopping)

    async def _drain_all(self) -> None:
        timeout = self.server.drain_timeout_s
        log.info("shutting down: draining in-flight requests for up to %gs", timeout)
        await asyncio.gather(
            *(self.unload(name, timeout=timeout) for name in self.slots), return_exceptions=True
        )
        for task in list(self._tasks):
            task.cancel()
        await self.transport.close()
        remove_sockets(self.run_dir)

    # ---- catalog --------------------------------------------------------------------

    def resolve(self, name: str) -> ModelConfig:
        return self._slot(name).config

    def _slot(self, name: str) -> Slot:
        slot = self.slots.get(self.aliases.get(name, name))
        if slot is None:
            available = ", ".join(sorted(self.slots)) or "none"
            raise GatewayError(
                ErrorCode.MODEL_NOT_FOUND,
                f"The model `{name}` does not exist. Available models: {available}.",
                "model",
            )
        return slot

    def state_of(self, name: str) -> ModelState:
        return self._slot(name).state

    def add_model(self, model: ModelConfig) -> None:
        """`gatewayctl load NAME --source ...`: a catalog entry made at run time."""
        if model.name in self.slots or model.name in self.aliases:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST, f"model {model.name!r} is already configured"
            )
        for alias in model.aliases:
            if alias in self.slots or alias in self.aliases:
                raise GatewayError(ErrorCode.INVALID_REQUEST, f"alias {alias!r} is taken")
        self.slots[model.name] = Slot(model)
        self.aliases.update({a: model.name for a in model.aliases})

    def must_load(self, name: str) -> bool:
        """A request for this model would wait for a worker to load or restart."""
        slot = self._slot(name)
        return slot.state in (ModelState.UNLOADED, ModelState.LOADING) and not (
            slot.state == ModelState.UNLOADED and slot.config.on_demand == "refuse"
        )

    def worker_info(self, name: str) -> Ready | None:
        slot = self.slots.get(name)
        return slot.handle.info if slot and slot.handle else None

    # ---- load / unload / reload -----------------------------------------------------

    async def load(self, name: str, wait: bool = True) -> Slot:
        """Explicit load: also retries a failed model."""
        slot = self._slot(name)
        if slot.state == ModelState.UNLOADING:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE, f"model {name!r} is being unloaded", retry_after=2
            )
        if slot.state == ModelState.FAILED:
            slot.error = None
            slot.crashes.clear()
        if slot.restarting:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {name!r} is restarting after a crash",
                retry_after=2,
            )
        task = self._load_task(slot)
        if wait and task is not None:
            await self._await_load(slot, task)
        return slot

    def _load_task(self, slot: Slot) -> asyncio.Task[WorkerHandle] | None:
        """Single flight: concurrent requests for an unloaded model start one worker."""
        if slot.handle is not None and slot.loading is None:
            return None
        if slot.loading is None:
            slot.loading = asyncio.create_task(self._bring_up(slot))
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

    async def _bring_up(self, slot: Slot, restart: bool = False) -> WorkerHandle:
        slot.error = None
        try:
            await self._make_room(slot)
        except GatewayError as exc:
            if not restart:
                slot.last_error = exc.message
            raise
        handle = await self._spawn(slot.config, restart)
        slot.handle = handle
        try:
            await self._wait_ready(handle, self.server.load_timeout_s)
        except GatewayError as exc:
            if not handle.exited.is_set():
                handle.error = exc.message
                await self._kill(handle, signal.SIGKILL, grace=0)
            if slot.handle is handle:
                slot.handle = None
            if not restart:  # a failed restart is a crash: _crashed decides what follows
                slot.error = slot.last_error = handle.error or exc.message
                self._fail_replay(slot, exc.message)
            raise
        self._resubmit_replay(slot, handle)
        self._touch(slot)
        self._released(slot)  # idle until a request comes: the TTL runs
        return handle

    def _worker_model(self, model: ModelConfig) -> ModelConfig:
        """The model's config as its worker sees it: server-wide request limits filled in."""
        limit = self.server.max_prompt_tokens
        if limit is None or model.engine.max_prompt_tokens is not None:
            return model
        engine = msgspec.structs.replace(model.engine, max_prompt_tokens=limit)
        return msgspec.structs.replace(model, engine=engine)

    async def _spawn(self, model: ModelConfig, restart: bool) -> WorkerHandle:
        worker_id = f"{model.name}-{next(self._serial)}-{uuid.uuid4().hex[:6]}"
        server = self.server
        log_file = open(self.run_dir.worker_log(model.name), "ab")  # noqa: SIM115
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "worker",
                "--id",
                worker_id,
                "--requests",
                self.transport.requests_addr,
                "--outputs",
                self.transport.outputs_addr,
                "--model",
                msgspec.json.encode(self._worker_model(model)).decode(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=worker_env(server.blas, server.blas_threads, device=self.device.kind),
                start_new_session=True,
            )
        finally:
            log_file.close()
        handle = WorkerHandle(model, worker_id, process, restart=restart)
        self._by_id[worker_id] = handle
        self._save_pids()
        self._spawn_task(self._watch_exit(handle))
        log.info("model %s: worker %s spawned (pid %d)", model.name, worker_id, process.pid)
        return handle

    async def _wait_ready(self, handle: WorkerHandle, timeout: float) -> None:
        ready = asyncio.ensure_future(handle.ready.wait())
        exited = asyncio.ensure_future(handle.exited.wait())
        try:
            await asyncio.wait({ready, exited}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            ready.cancel()
            exited.cancel()
        if handle.is_ready:
            return
        name = handle.config.name
        if not handle.exited.is_set():
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {name!r} did not load within server.load_timeout_s={timeout:g}s",
                retry_after=5,
            )
        reason = handle.error or f"the worker exited ({describe_exit(handle.exit_code)})"
        raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {name!r} failed to load: {reason}")

    async def unload(self, name: str, force: bool = False, timeout: float | None = None) -> bool:
        """Stop new requests, drain (or abort with force), end the process. False if not loaded."""
        slot = self._slot(name)
        timeout = self.server.drain_timeout_s if timeout is None else timeout
        if slot.restarting:
            slot.restarting = slot.restart_pending = False
            self._fail_replay(slot, f"model {slot.name!r} was unloaded")
        if slot.loading is not None:
            slot.loading.cancel()
            with contextlib.suppress(BaseException):
                await slot.loading
        handle = slot.handle
        if handle is None and not slot.retiring:
            return False
        slot.unloading = True
        self._cancel_idle(slot)
        try:
            if handle is not None:
                slot.handle = None
                await self._retire(slot, handle, force, timeout)
            await asyncio.gather(*(w.exited.wait() for w in list(slot.retiring)))
        finally:
            slot.unloading = False
        self._fail_replay(slot, f"model {slot.name!r} was unloaded")
        log.info("model %s: unloaded", slot.name)
        return True

    async def _retire(self, slot: Slot, handle: WorkerHandle, force: bool, timeout: float) -> None:
        """Drain a worker that takes no new requests, then end it."""
        handle.retiring = True
        slot.retiring.append(handle)
        if not handle.is_ready:  # still loading: nothing to drain
            await self._kill(handle, signal.SIGTERM, grace=5)
            return
        mode = ShutdownMode.ABORT if force else ShutdownMode.DRAIN
        self.transport.send(handle.worker_id, Shutdown(mode, timeout))
        try:
            await asyncio.wait_for(handle.exited.wait(), timeout + 5)
        except TimeoutError:
            await self._kill(handle, signal.SIGTERM, grace=5)

    async def reload(self, name: str) -> WorkerHandle:
        """Zero downtime: a new worker takes over once Ready; the old one drains."""
        slot = self._slot(name)
        old = slot.handle
        if old is None or slot.loading is not None:
            task = self._load_task(slot)
            if task is None:  # a worker, not ready yet: none of ours to wait for
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE, f"model {name!r} is starting", retry_after=2
                )
            return await self._await_load(slot, task)
        await self._make_room(slot, extra=old.memory_bytes())
        new = await self._spawn(slot.config, restart=False)
        try:
            await self._wait_ready(new, self.server.load_timeout_s)
        except GatewayError:
            if not new.exited.is_set():
                await self._kill(new, signal.SIGKILL, grace=0)
            raise
        slot.handle = new
        self._touch(slot)
        self._released(slot)
        log.info("model %s: reloaded; worker %s drains", slot.name, old.worker_id)
        self._spawn_task(self._retire(slot, old, False, self.server.drain_timeout_s))
        return new

    async def _kill(self, handle: WorkerHandle, sig: int, grace: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            handle.process.send_signal(sig)
        try:
            await asyncio.wait_for(handle.exited.wait(), grace or 0.001)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                handle.process.kill()
            await handle.exited.wait()

    # ---- memory budget --------------------------------------------------------------

    def memory_used(self, exclude: Slot | None = None) -> int:
        return self.memory.used(self.slots.values(), exclude)

    async def _make_room(self, slot: Slot, extra: int = 0) -> None:
        await self.memory.make_room(slot, self.slots, self.unload, extra)

    # ---- requests ---------------------------------------------------------------------

    async def submit(
        self,
        name: str,
        kind: RequestKind,
        request: CanonicalRequest,
        sampling: SamplingParams,
        keep_alive: float | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        needs: list[str] | None = None,
    ) -> RequestStream:
        """Send one request to `name`'s worker (loading it on demand). `needs`: capabilities
        the request relies on; a model without one is a 400 before anything is sent."""
        slot = self._slot(name)
        if self.draining:
            raise GatewayError(
                ErrorCode.SHUTTING_DOWN, "the gateway is shutting down", retry_after=5
            )
        if keep_alive is not None:
            slot.keep_alive_s = keep_alive
        request_id = request_id or uuid.uuid4().hex
        request = with_template_defaults(slot.config, kind, request)
        if needs:
            check_capabilities(slot, needs)
        if slot.restarting:  # queued: it runs on the new worker once that is Ready
            if len(slot.replay) >= self.server.max_queued:
                raise self._queue_full(slot, len(slot.replay))
            stream = RequestStream(request_id, slot.name, "")
            stream.add = Add(stream.request_id, kind, request, sampling, priority)
            slot.replay.append(stream)
            slot.served += 1
            self._touch(slot)
            return stream
        handle = await self._acquire(slot)
        if needs:
            check_capabilities(slot, needs, handle.info)
        capacity = handle.capacity
        assert capacity is not None
        queued = len(handle.streams) - capacity.max_running
        if queued >= min(capacity.max_waiting, self.server.max_queued):
            raise self._queue_full(slot, len(handle.streams))
        stream = RequestStream(request_id, slot.name, handle.worker_id)
        stream.add = Add(stream.request_id, kind, request, sampling, priority)
        if not self._send_add(handle, stream):
            raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {slot.name!r} is unreachable")
        slot.served += 1
        self._touch(slot)
        return stream

    async def call(
        self, name: str, method: str, args: dict[str, Any], timeout: float = 30.0
    ) -> dict[str, Any]:
        """A control call to the model's worker (loading it on demand), e.g. tokenize."""
        if self.draining:
            raise GatewayError(
                ErrorCode.SHUTTING_DOWN, "the gateway is shutting down", retry_after=5
            )
        slot = self._slot(name)
        handle = await self._acquire(slot)
        result = await self.calls.call(
            self.transport, handle.worker_id, name, method, args, timeout
        )
        self._touch(slot)
        return result

    def _queue_full(self, slot: Slot, in_flight: int) -> GatewayError:
        return GatewayError(
            ErrorCode.OVERLOADED,
            f"model {slot.name!r} is at capacity ({in_flight} requests in flight, its queue is "
            f"full: server.max_queued={self.server.max_queued}); retry shortly",
            retry_after=1,
        )

    async def _acquire(self, slot: Slot) -> WorkerHandle:
        """The worker for a new request: loading the model on demand (and waiting)."""
        for _ in range(3):  # a worker may die between Ready and this request
            state = slot.state
            if state == ModelState.READY and slot.handle is not None:
                return slot.handle
            if state == ModelState.FAILED:
                raise GatewayError(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"model {slot.name!r} failed: {slot.error}; "
                    f"`gatewayctl load {slot.name}` tries again",
                )
            if slot.restarting and slot.loading is None:
                await asyncio.sleep(0.1)
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
            task = self._load_task(slot)
            if task is not None:
                await self._await_load(slot, task)
            elif slot.handle is not None and not slot.handle.is_ready:
                await self._wait_ready(slot.handle, self.server.load_timeout_s)
        raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {slot.name!r} keeps failing")

    def _send_add(self, handle: WorkerHandle, stream: RequestStream) -> bool:
        assert stream.add is not None
        stream.worker_id = handle.worker_id
        handle.streams[stream.request_id] = stream
        try:
            if self.transport.send(handle.worker_id, stream.add):
                return True
        except (OverflowError, TypeError, ValueError) as exc:  # unencodable: never leak it
            handle.streams.pop(stream.request_id, None)
            raise GatewayError(
                ErrorCode.INVALID_REQUEST, f"a value in the request is out of range: {exc}"
            ) from exc
        handle.streams.pop(stream.request_id, None)
        return False

    def abort(self, stream: RequestStream) -> None:
        """The client went away or timed out: free its slot in the worker (idempotent)."""
        slot = self.slots.get(stream.model)
        if slot is not None and stream in slot.replay:
            slot.replay.remove(stream)
            self._released(slot)
            return
        handle = self._by_id.get(stream.worker_id)
        if handle is None or handle.streams.pop(stream.request_id, None) is None:
            return
        self.transport.send(handle.worker_id, Abort([stream.request_id]))
        self._released(self.slots.get(handle.config.name))

    # ---- idle TTL -------------------------------------------------------------------

    def _touch(self, slot: Slot) -> None:
        slot.last_used = time.monotonic()
        self._cancel_idle(slot)

    def _cancel_idle(self, slot: Slot) -> None:
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
            slot.idle_timer = None
        slot.idle_since = None

    def ttl_of(self, slot: Slot) -> float:
        if slot.keep_alive_s is not None:
            return slot.keep_alive_s
        return parse_duration(
            slot.config.ttl if slot.config.ttl is not None else self.server.default_ttl
        )

    def _released(self, slot: Slot | None) -> None:
        """A request left its worker: an idle model starts its TTL."""
        if slot is None or slot.in_flight() or slot.handle is None or slot.unloading:
            return
        slot.last_used = time.monotonic()
        ttl = self.ttl_of(slot)
        self._cancel_idle(slot)
        if ttl < 0:
            return
        slot.idle_since = time.monotonic()
        slot.idle_timer = asyncio.get_running_loop().call_later(ttl, self._expire_idle, slot)

    def _expire_idle(self, slot: Slot) -> None:
        slot.idle_timer = None
        if slot.in_flight() or slot.handle is None:
            return
        log.info("model %s: idle for %gs (ttl); unloading", slot.name, self.ttl_of(slot))
        self._spawn_task(self._unload_quietly(slot.name))

    async def _unload_quietly(self, name: str) -> None:
        with contextlib.suppress(GatewayError):
            await self.unload(name)

    # ---- frames from workers --------------------------------------------------------

    def _on_frame(self, frame: FromWorker) -> None:
        handle = self._by_id.get(frame.worker_id)
        if handle is None:
            return
        now = time.monotonic()
        handle.last_seen = now
        if isinstance(frame, StepOutputs):
            self._note_step(handle, frame.step, now)
            streams = handle.streams
            released = False
            for output in frame.outputs:
                stream = streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finish_reason is not None:
                        del streams[output.request_id]
                        released = True
            if released and not streams:
                self._released(self.slots.get(handle.config.name))
        elif isinstance(frame, Heartbeat):
            handle.heartbeat = frame
            self._note_step(handle, frame.step, now)
        elif isinstance(frame, Hello):
            if frame.protocol_version != PROTOCOL_VERSION:
                handle.error = (
                    f"protocol version {frame.protocol_version} != gateway's {PROTOCOL_VERSION}"
                )
                self.transport.send(handle.worker_id, Shutdown(ShutdownMode.ABORT, 0))
                self._spawn_task(self._kill(handle, signal.SIGTERM, grace=2))
        elif isinstance(frame, Ready):
            handle.info = frame
            slot = self.slots.get(handle.config.name)
            if slot is not None:
                slot.last_info = frame
            handle.capacity = frame.capacity
            self.memory.observe(frame)
            handle.ready.set()
            log.info("model %s ready in %.1fs", handle.config.name, frame.load_time_s)
        elif isinstance(frame, WorkerDead):
            handle.error = frame.reason
            log.error("model %s: worker failed: %s", handle.config.name, frame.reason)
        elif isinstance(frame, ControlReply):
            self.calls.resolve(frame)

    @staticmethod
    def _note_step(handle: WorkerHandle, step: int, now: float) -> None:
        if step != handle.step:
            handle.step = step
            handle.step_moved_at = now

    # ---- crashes --------------------------------------------------------------------

    async def _watch_exit(self, handle: WorkerHandle) -> None:
        code = await handle.process.wait()
        handle.exit_code = code
        name = handle.config.name
        slot = self.slots.get(name)
        self._by_id.pop(handle.worker_id, None)
        handle.exited.set()
        self._save_pids()
        self.calls.fail(handle.worker_id, f"the worker of model {name!r} exited")
        if slot is None:
            return
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
        reason = handle.error or f"the worker exited ({describe_exit(code)})"
        slot.exit_code = code
        slot.log_tail = tail(self.run_dir.worker_log(name))
        slot.last_error = reason
        if not handle.info and not handle.restart:
            # It never got Ready: a load failure, not a crash. Its waiters see the reason.
            log.error("model %s: load failed: %s", name, reason)
            return
        self._crashed(slot, handle, reason)

    def _crashed(self, slot: Slot, handle: WorkerHandle, reason: str) -> None:
        now = time.monotonic()
        slot.crashes.append(now)
        while slot.crashes and now - slot.crashes[0] > self.server.crash_loop_window_s:
            slot.crashes.popleft()
        sent = [s for s in handle.streams.values() if s.received]
        fresh = [s for s in handle.streams.values() if not s.received]
        handle.streams.clear()
        message = f"the worker of model {slot.name!r} died: {reason}"
        self.calls.fail(handle.worker_id, message)
        for stream in sent:
            stream.fail(ErrorCode.WORKER_DIED, message)
        slot.replay.extend(fresh)
        if len(slot.crashes) >= self.server.crash_loop_count:
            slot.restarting = slot.restart_pending = False
            slot.error = slot.last_error = (
                f"crash loop: {len(slot.crashes)} crashes within "
                f"{self.server.crash_loop_window_s:g}s; last: {reason}"
            )
            log.error("model %s: %s", slot.name, slot.error)
            self._fail_replay(slot, message)
            return
        slot.restarting = slot.restart_pending = True
        delay = min(
            self.server.restart_backoff_s * 2 ** (len(slot.crashes) - 1),
            self.server.restart_backoff_max_s,
        )
        log.error(
            "model %s: %s; restarting in %.1fs (%d request(s) to replay)",
            slot.name,
            reason,
            delay,
            len(fresh),
        )
        self._spawn_task(self._restart(slot, delay))

    async def _restart(self, slot: Slot, delay: float) -> None:
        await asyncio.sleep(delay)
        if not slot.restart_pending or slot.handle is not None or slot.loading is not None:
            return
        slot.restart_pending = False
        slot.restarts += 1
        task = asyncio.create_task(self._bring_up(slot, restart=True))
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
                self._fail_replay(slot, slot.error)

    def _resubmit_replay(self, slot: Slot, handle: WorkerHandle) -> None:
        replay, slot.replay = slot.replay, []
        for stream in replay:
            if stream.finished:
                continue
            try:
                sent = self._send_add(handle, stream)
            except GatewayError as exc:
                stream.fail(exc.code, exc.message)
                continue
            if not sent:
                stream.fail(ErrorCode.WORKER_UNAVAILABLE, f"model {slot.name!r} is unreachable")
        if replay:
            log.info("model %s: replayed %d request(s)", slot.name, len(replay))

    def _fail_replay(self, slot: Slot, message: str) -> None:
        replay, slot.replay = slot.replay, []
        for stream in replay:
            stream.fail(ErrorCode.WORKER_DIED, message)

    # ---- liveness -------------------------------------------------------------------

    async def _watch_liveness(self) -> None:
        silence, wedge = self.server.heartbeat_timeout_s, self.server.wedge_timeout_s
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for handle in list(self._by_id.values()):
                if handle.exited.is_set() or handle.killed:
                    continue
                why = None
                if handle.is_ready and now - handle.last_seen > silence:
                    why = f"no heartbeat for {silence:g}s (server.heartbeat_timeout_s)"
                hb = handle.heartbeat
                busy = hb is not None and (hb.running + hb.waiting) > 0
                if handle.is_ready and busy and now - handle.step_moved_at > wedge:
                    why = f"engine stalled: no step for {wedge:g}s with work (wedge_timeout_s)"
                if why is not None:
                    handle.error, handle.killed = why, True
                    log.error("model %s: %s; killing pid %d", handle.config.name, why, handle.pid)
                    with contextlib.suppress(ProcessLookupError):
                        handle.process.kill()

    def _spawn_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _save_pids(self) -> None:
        save_pids(self.run_dir.workers_file, (h.pid for h in self._by_id.values()))

    # ---- status -------------------------------------------------------------------------

    def ps(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [status_row(slot, self.ttl_of(slot), now) for slot in self.slots.values()]

    def status(self) -> dict[str, object]:
        from importlib.metadata import version

        return {
            "version": version("mlx-gateway"),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "memory_budget_bytes": self.memory.budget,
            "memory_used_bytes": self.memory_used(),
            "memory_total_bytes": self.memory.total,
            "memory_source": self.memory.source,
            "device": f"{self.device.kind} ({self.device.backend})",
            "models": {name: slot.state.value for name, slot in self.slots.items()},
        }
