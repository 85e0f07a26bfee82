"""Supervisor: spawns one worker process per model, watches it, routes requests to it.

Liveness: process exit is authoritative; a WorkerDead frame carries the reason; heartbeat
silence gets the process killed. A worker that dies fails every in-flight request of its model
with a terminal error, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
import psutil

from gateway.errors import GatewayError
from gateway.stream import RequestStream
from gateway.transport import Transport
from shared.blas import worker_env
from shared.config import Config, ModelConfig
from shared.paths import RunDir
from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Add,
    Capacity,
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
from shared.types import CanonicalRequest, ErrorCode, RequestKind, SamplingParams

log = logging.getLogger("gateway.supervisor")


class ModelState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class WorkerHandle:
    config: ModelConfig
    worker_id: str
    process: asyncio.subprocess.Process
    state: ModelState = ModelState.LOADING
    started_at: float = field(default_factory=time.time)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    streams: dict[str, RequestStream] = field(default_factory=dict)
    capacity: Capacity | None = None
    info: Ready | None = None
    heartbeat: Heartbeat | None = None
    last_seen: float = field(default_factory=time.monotonic)
    error: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


class Supervisor:
    def __init__(self, config: Config, run_dir: RunDir) -> None:
        self.config = config
        self.run_dir = run_dir
        self.models = {m.name: m for m in config.models}
        self.aliases = {a: m.name for m in config.models for a in m.aliases}
        self.workers: dict[str, WorkerHandle] = {}
        self.failures: dict[str, str] = {}
        self._by_id: dict[str, WorkerHandle] = {}
        self._serial = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.transport = Transport(run_dir.requests_ipc, run_dir.outputs_ipc)

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self.run_dir.create()
        self._reap_leftovers()
        self.transport.bind(self._on_frame)
        self._spawn_task(self._watch_heartbeats())
        for model in self.config.models:
            if model.preload:
                await self.load(model.name)

    async def stop(self) -> None:
        await asyncio.gather(
            *(self.unload(name, force=True, timeout=3.0) for name in list(self.workers)),
            return_exceptions=True,
        )
        for task in list(self._tasks):
            task.cancel()
        await self.transport.close()

    # ---- catalog --------------------------------------------------------------------

    def resolve(self, name: str) -> ModelConfig:
        model = self.models.get(self.aliases.get(name, name))
        if model is None:
            available = ", ".join(sorted(self.models)) or "none"
            raise GatewayError(
                ErrorCode.MODEL_NOT_FOUND,
                f"The model `{name}` does not exist. Available models: {available}.",
                "model",
            )
        return model

    def state_of(self, name: str) -> ModelState:
        handle = self.workers.get(name)
        if handle is not None:
            return handle.state
        return ModelState.FAILED if name in self.failures else ModelState.UNLOADED

    # ---- load / unload ----------------------------------------------------------------

    async def load(self, name: str) -> WorkerHandle:
        model = self.resolve(name)
        handle = self.workers.get(model.name)
        if handle is not None and handle.state in (ModelState.LOADING, ModelState.READY):
            return handle
        if handle is not None:
            await handle.exited.wait()
        worker_id = f"{model.name}-{next(self._serial)}-{uuid.uuid4().hex[:6]}"
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
                msgspec.json.encode(model).decode(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=worker_env(self.config.server.blas, self.config.server.blas_threads),
                start_new_session=True,
            )
        finally:
            log_file.close()
        handle = WorkerHandle(model, worker_id, process)
        self.workers[model.name] = handle
        self._by_id[worker_id] = handle
        self.failures.pop(model.name, None)
        self._save_pids()
        self._spawn_task(self._watch_exit(handle))
        log.info("model %s: worker %s spawned (pid %d)", model.name, worker_id, process.pid)
        return handle

    async def wait_ready(self, handle: WorkerHandle, timeout: float | None = None) -> None:
        timeout = self.config.server.load_timeout_s if timeout is None else timeout
        ready = asyncio.ensure_future(handle.ready.wait())
        exited = asyncio.ensure_future(handle.exited.wait())
        try:
            await asyncio.wait({ready, exited}, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            ready.cancel()
            exited.cancel()
        if handle.state == ModelState.READY:
            return
        if handle.state == ModelState.LOADING:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {handle.config.name!r} did not load within "
                f"server.load_timeout_s={timeout:g}s",
                retry_after=5,
            )
        reason = handle.error or self.failures.get(handle.config.name) or "the worker exited"
        raise GatewayError(
            ErrorCode.WORKER_UNAVAILABLE, f"model {handle.config.name!r} failed to load: {reason}"
        )

    async def unload(self, name: str, force: bool = False, timeout: float = 30.0) -> bool:
        """Stop new requests, drain (or abort with force), end the process. False if not loaded."""
        handle = self.workers.get(self.resolve(name).name)
        if handle is None:
            return False
        handle.state = ModelState.UNLOADING
        mode = ShutdownMode.ABORT if force else ShutdownMode.DRAIN
        self.transport.send(handle.worker_id, Shutdown(mode, timeout))
        try:
            await asyncio.wait_for(handle.exited.wait(), timeout + 5)
        except TimeoutError:
            await self._kill(handle, signal.SIGTERM, grace=5)
        return True

    async def _kill(self, handle: WorkerHandle, sig: int, grace: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            handle.process.send_signal(sig)
        try:
            await asyncio.wait_for(handle.exited.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                handle.process.kill()
            await handle.exited.wait()

    # ---- requests ---------------------------------------------------------------------

    async def submit(
        self, name: str, kind: RequestKind, request: CanonicalRequest, sampling: SamplingParams
    ) -> RequestStream:
        model = self.resolve(name)
        handle = self.workers.get(model.name)
        if handle is None:
            reason = self.failures.get(model.name)
            hint = f"load it with `gatewayctl load {model.name}`"
            message = f"failed: {reason}" if reason else f"is not loaded; {hint}"
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE, f"model {model.name!r} {message}", retry_after=5
            )
        if handle.state == ModelState.LOADING:
            await self.wait_ready(handle)
        if handle.state != ModelState.READY:
            raise GatewayError(
                ErrorCode.WORKER_UNAVAILABLE,
                f"model {model.name!r} is {handle.state.value}",
                retry_after=5,
            )
        capacity = handle.capacity
        assert capacity is not None
        if len(handle.streams) >= capacity.max_running + capacity.max_waiting:
            raise GatewayError(
                ErrorCode.OVERLOADED,
                f"model {model.name!r} is at capacity ({len(handle.streams)} requests in flight)",
                retry_after=1,
            )
        request_id = uuid.uuid4().hex
        stream = RequestStream(request_id, model.name, handle.worker_id)
        handle.streams[request_id] = stream
        if not self.transport.send(handle.worker_id, Add(request_id, kind, request, sampling)):
            handle.streams.pop(request_id, None)
            raise GatewayError(ErrorCode.WORKER_UNAVAILABLE, f"model {model.name!r} is unreachable")
        return stream

    def abort(self, stream: RequestStream) -> None:
        """The client went away or timed out: free its slot in the worker (idempotent)."""
        handle = self._by_id.get(stream.worker_id)
        if handle is None or handle.streams.pop(stream.request_id, None) is None:
            return
        self.transport.send(handle.worker_id, Abort([stream.request_id]))

    # ---- frames from workers --------------------------------------------------------

    def _on_frame(self, frame: FromWorker) -> None:
        handle = self._by_id.get(frame.worker_id)
        if handle is None:
            return
        handle.last_seen = time.monotonic()
        if isinstance(frame, StepOutputs):
            streams = handle.streams
            for output in frame.outputs:
                stream = streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finish_reason is not None:
                        del streams[output.request_id]
        elif isinstance(frame, Heartbeat):
            handle.heartbeat = frame
        elif isinstance(frame, Hello):
            if frame.protocol_version != PROTOCOL_VERSION:
                handle.error = (
                    f"protocol version {frame.protocol_version} != gateway's {PROTOCOL_VERSION}"
                )
                self.transport.send(handle.worker_id, Shutdown(ShutdownMode.ABORT, 0))
                self._spawn_task(self._kill(handle, signal.SIGTERM, grace=2))
        elif isinstance(frame, Ready):
            handle.info = frame
            handle.capacity = frame.capacity
            if handle.state == ModelState.LOADING:
                handle.state = ModelState.READY
            handle.ready.set()
            log.info("model %s ready in %.1fs", handle.config.name, frame.load_time_s)
        elif isinstance(frame, WorkerDead):
            handle.error = frame.reason
            log.error("model %s: worker died: %s", handle.config.name, frame.reason)
        elif isinstance(frame, ControlReply):
            pass

    # ---- watchers ---------------------------------------------------------------------

    async def _watch_exit(self, handle: WorkerHandle) -> None:
        code = await handle.process.wait()
        name = handle.config.name
        expected = handle.state == ModelState.UNLOADING
        if not expected:
            reason = handle.error or f"worker process exited with code {code}"
            self.failures[name] = reason
            log.error("model %s: worker %s exited (%s)", name, handle.worker_id, reason)
        message = f"the worker of model {name!r} exited" + ("" if expected else f": {code}")
        for stream in list(handle.streams.values()):
            stream.fail(ErrorCode.WORKER_DIED, message)
        handle.streams.clear()
        handle.state = ModelState.UNLOADED if expected else ModelState.FAILED
        if self.workers.get(name) is handle:
            del self.workers[name]
        self._by_id.pop(handle.worker_id, None)
        self._save_pids()
        handle.exited.set()

    async def _watch_heartbeats(self) -> None:
        limit = self.config.server.heartbeat_timeout_s
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for handle in list(self.workers.values()):
                if handle.state == ModelState.READY and now - handle.last_seen > limit:
                    handle.error = f"no heartbeat for {limit:g}s"
                    log.error("model %s: %s; killing it", handle.config.name, handle.error)
                    with contextlib.suppress(ProcessLookupError):
                        handle.process.kill()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- leftovers from a crashed gateway -------------------------------------------

    def _save_pids(self) -> None:
        pids = [h.pid for h in self.workers.values()]
        self.run_dir.workers_file.write_text(json.dumps(pids))

    def _reap_leftovers(self) -> None:
        try:
            pids = json.loads(self.run_dir.workers_file.read_text())
        except (OSError, ValueError):
            return
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(pid))
                if "worker" in proc.cmdline() and proc.pid != os.getpid():
                    log.warning("killing leftover worker pid %d", pid)
                    proc.kill()

    # ---- status -------------------------------------------------------------------------

    def ps(self) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        for name, model in self.models.items():
            handle = self.workers.get(name)
            row: dict[str, object] = {
                "model": name,
                "state": self.state_of(name).value,
                "aliases": model.aliases,
                "pid": None,
                "rss_bytes": None,
                "running": 0,
                "waiting": 0,
                "in_flight": 0,
                "uptime_s": None,
                "error": self.failures.get(name),
            }
            if handle is not None:
                row.update(pid=handle.pid, in_flight=len(handle.streams))
                row["uptime_s"] = round(time.time() - handle.started_at, 1)
                with contextlib.suppress(psutil.Error):
                    row["rss_bytes"] = psutil.Process(handle.pid).memory_info().rss
                if handle.heartbeat is not None:
                    row.update(running=handle.heartbeat.running, waiting=handle.heartbeat.waiting)
            rows.append(row)
        return rows
