"""The Supervisor: the workers' side of the gateway, put together.

It owns the catalog (one Slot per configured model), the transport to the workers, and the
units that act on them: processes (spawn, signal, exit), the pool (load, unload, reload,
the worker for a request), recovery (what an exit means: replay, backoff, crash loops),
liveness (heartbeats, wedged engines), lifetime (idle TTL), the memory budget and admission
(capabilities, queue limits). It routes each frame from a worker to whoever waits for it,
and implements `WorkerClient`, the only face the request path sees.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from gateway.workers.admission import Admission
from gateway.workers.catalog import Catalog
from gateway.workers.client import ModelView, Submission
from gateway.workers.control import ControlCalls
from gateway.workers.device import detect_device
from gateway.workers.leftovers import reap_leftovers
from gateway.workers.lifetime import Lifetime
from gateway.workers.liveness import Liveness, note_step
from gateway.workers.memory import MemoryBudget
from gateway.workers.pool import Pool
from gateway.workers.processes import Command, Processes
from gateway.workers.recovery import Recovery
from gateway.workers.remote import RemoteDoor
from gateway.workers.replicas import Replicas
from gateway.workers.routing import Router
from gateway.workers.slots import Slot, WorkerHandle, remove_sockets, status_row
from gateway.workers.stream import RequestStream
from gateway.workers.tasks import Tasks
from gateway.workers.transport import Transport
from shared.cluster import cluster_dir
from shared.config import Config, ModelConfig
from shared.paths import RunDir
from shared.protocol import (
    PROTOCOL_VERSION,
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
from shared.types import CanonicalRequest, RequestKind
from shared.version import project_version

log = logging.getLogger("gateway.workers.supervisor")


class Supervisor:
    def __init__(self, config: Config, run_dir: RunDir, command: Command | None = None) -> None:
        self.config = config
        self.server = server = config.server
        self.run_dir = run_dir
        self.started_at = time.time()
        self._draining = False
        self._stopping: asyncio.Future[None] | None = None
        self.catalog = Catalog(config.models)
        self.tasks = Tasks()
        self.calls = ControlCalls()  # control calls awaiting their workers' replies
        self.transport = Transport(run_dir.requests_ipc, run_dir.outputs_ipc)
        self.device = detect_device()
        self.memory = MemoryBudget(server, self.device)
        self.processes = Processes(
            server,
            run_dir,
            self.transport,
            self.calls,
            self.tasks,
            self.device,
            self._exited,
            command,
        )
        self.lifetime = Lifetime(server, self.tasks, self.unload)
        self.recovery = Recovery(
            server, run_dir, self.transport, self.calls, self.tasks, self._restart
        )
        self.pool = Pool(
            server,
            self.catalog,
            self.processes,
            self.recovery,
            self.lifetime,
            self.memory,
            self.transport,
            self.tasks,
        )
        self.router = Router()
        # workers on other machines dial in here (server.workers_listen; off when unset)
        self.door = (
            RemoteDoor(server.workers_listen, cluster_dir(server.cluster_dir))
            if server.workers_listen
            else None
        )
        self.transport.remote = self.door
        self.replicas = (
            Replicas(
                self.door,
                self.catalog,
                self.calls,
                self.recovery,
                self.router,
                self.pool.load_task,
                self.lifetime.released,
                lambda worker_id: self.processes.get(worker_id) is not None,
                server.load_timeout_s,
            )
            if self.door is not None
            else None
        )
        self.admission = Admission(
            server,
            self.catalog,
            self.pool,
            self.find,
            self.router,
            self.lifetime,
            self.transport,
            self.calls,
            lambda: self._draining,
        )
        self.liveness = Liveness(server, self.replicas.lose if self.replicas else None)

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        self.run_dir.create()
        reap_leftovers(self.run_dir.workers_file)
        self.transport.bind(self._on_local)
        if self.door is not None and self.replicas is not None:
            self.door.bind(self._on_remote, self.replicas.disconnected)
            self.tasks.spawn(self.replicas.watch_keys())
        self.tasks.spawn(self.liveness.watch(self._watched))
        for slot in self.catalog:
            if slot.config.preload and slot.config.placement == "local":
                self.pool.load_task(slot)
        loads = [s.loading for s in self.catalog if s.loading is not None]
        await asyncio.gather(*loads, return_exceptions=True)

    async def stop(self) -> None:
        """Refuse new requests, drain every model for server.drain_timeout_s, end the workers.
        Idempotent: a server's shutdown hook and the app's lifespan may both call it."""
        self._draining = True
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._drain_all())
        await asyncio.shield(self._stopping)

    async def _drain_all(self) -> None:
        timeout = self.server.drain_timeout_s
        log.info("shutting down: draining in-flight requests for up to %gs", timeout)
        remote = [self.replicas.drain(timeout)] if self.replicas is not None else []
        await asyncio.gather(
            *(self.unload(name, timeout=timeout) for name in self.catalog.slots),
            *remote,
            return_exceptions=True,
        )
        self.tasks.cancel_all()
        if self.door is not None:
            self.door.close()
        await self.transport.close()
        remove_sockets(self.run_dir)

    def _exited(self, handle: WorkerHandle) -> None:
        slot = self.catalog.slots.get(handle.config.name)
        if slot is not None:
            self.recovery.exited(slot, handle)
            if self.replicas is not None:
                self.replicas.local_exited(slot)

    def find(self, worker_id: str) -> WorkerHandle | None:
        """A worker by id, local or remote."""
        handle = self.processes.get(worker_id)
        if handle is None and self.replicas is not None:
            handle = self.replicas.get(worker_id)
        return handle

    def _watched(self) -> list[WorkerHandle]:
        remote = self.replicas.live() if self.replicas is not None else []
        return self.processes.alive() + remote

    def _restart(self, slot: Slot) -> Coroutine[Any, Any, WorkerHandle]:
        return self.pool.bring_up(slot, restart=True)

    # ---- WorkerClient: what the request path uses -----------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def models(self) -> dict[str, ModelConfig]:
        return self.catalog.models

    def resolve(self, name: str) -> ModelConfig:
        return self.catalog.slot(name).config

    def view(self, name: str) -> ModelView:
        return self.catalog.slot(name).view()

    def views(self) -> list[ModelView]:
        return [slot.view() for slot in self.catalog]

    def must_load(self, name: str) -> bool:
        return self.catalog.must_load(name)

    def check(self, name: str, needs: Sequence[str]) -> None:
        self.admission.check(name, needs)

    async def submit(self, submission: Submission) -> RequestStream:
        return await self.admission.submit(submission)

    def abort(self, stream: RequestStream) -> None:
        self.admission.abort(stream)

    async def call(
        self, name: str, method: str, args: dict[str, Any], timeout: float = 30.0
    ) -> dict[str, Any]:
        return await self.admission.call(name, method, args, timeout)

    async def tokenize(
        self, name: str, kind: RequestKind, request: CanonicalRequest, with_text: bool = False
    ) -> dict[str, Any]:
        return await self.admission.tokenize(name, kind, request, with_text)

    # ---- control: gatewayctl and the admin API --------------------------------------

    def add_model(self, model: ModelConfig) -> None:
        self.catalog.add(model)

    async def load(self, name: str, wait: bool = True) -> Slot:
        return await self.pool.load(name, wait)

    async def unload(self, name: str, force: bool = False, timeout: float | None = None) -> bool:
        return await self.pool.unload(name, force, timeout)

    async def reload(self, name: str) -> WorkerHandle:
        return await self.pool.reload(name)

    def memory_used(self, exclude: Slot | None = None) -> int:
        return self.memory.used(self.catalog.slots.values(), exclude)

    def ps(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [status_row(slot, self.lifetime.ttl_of(slot), now) for slot in self.catalog]

    def status(self) -> dict[str, object]:
        return {
            "version": project_version(),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "memory_budget_bytes": self.memory.budget,
            "memory_used_bytes": self.memory_used(),
            "memory_total_bytes": self.memory.total,
            "memory_source": self.memory.source,
            "device": f"{self.device.kind} ({self.device.backend})",
            "models": {slot.name: slot.state.value for slot in self.catalog},
        }

    # ---- frames from workers --------------------------------------------------------

    def _on_remote(self, frame: FromWorker, key: str, peer: str, sender: bytes) -> None:
        assert self.replicas is not None
        handle = self.replicas.admit(frame, key, peer, sender)
        if handle is not None:
            self._on_frame(frame, handle)

    def _on_local(self, frame: FromWorker) -> None:
        handle = self.processes.get(frame.worker_id)
        if handle is None:  # an exited worker's last frames, or a worker nobody spawned
            if isinstance(frame, Hello):
                log.warning(
                    "hello from unknown worker %.80r (pid %d, model %.80r, protocol %d): ignored",
                    frame.worker_id,
                    frame.pid,
                    frame.model,
                    frame.protocol_version,
                )
            return
        self._on_frame(frame, handle)

    def _on_frame(self, frame: FromWorker, handle: WorkerHandle) -> None:
        if isinstance(frame, Hello | Ready) and handle.info is not None:
            # the handshake is done: a worker says each once, before any output
            kind = type(frame).__name__
            log.warning(
                "model %s: %s from its worker after Ready: ignored", handle.config.name, kind
            )
            return
        now = time.monotonic()
        handle.last_seen = now
        if isinstance(frame, StepOutputs):
            note_step(handle, frame.step, now)
            streams = handle.streams
            released = False
            handle.served = handle.served or bool(frame.outputs)
            tokens = 0
            for output in frame.outputs:
                tokens += len(output.token_ids)
                stream = streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finish_reason is not None:
                        del streams[output.request_id]
                        released = True
            slot = self.catalog.slots.get(handle.config.name)
            if slot is not None:
                slot.generated_tokens += tokens
            if released and not streams:
                self.lifetime.released(slot)
        elif isinstance(frame, Heartbeat):
            handle.heartbeat = frame
            note_step(handle, frame.step, now)
        elif isinstance(frame, Hello):
            if frame.protocol_version != PROTOCOL_VERSION:
                handle.error = (
                    f"protocol version {frame.protocol_version} != gateway's {PROTOCOL_VERSION}"
                )
                self.transport.send(handle.worker_id, Shutdown(ShutdownMode.ABORT, 0))
                self.tasks.spawn(self.processes.kill(handle, signal.SIGTERM, grace=2))
        elif isinstance(frame, Ready):
            if handle.remote is not None:
                assert self.replicas is not None
                if not self.replicas.ready(handle, frame):
                    return
            handle.info = frame
            slot = self.catalog.slots.get(handle.config.name)
            if slot is not None:
                slot.last_info = frame
                if handle.remote is None and frame.identity:
                    slot.identity = frame.identity  # its own worker says what it serves now
            handle.capacity = frame.capacity
            if handle.remote is None:
                self.memory.observe(frame)  # another machine's memory is not this budget's
            handle.ready.set()
            log.info("model %s ready in %.1fs", handle.config.name, frame.load_time_s)
            if handle.remote is not None and slot is not None and self.replicas is not None:
                self.replicas.serve_waiting(slot, handle)
        elif isinstance(frame, WorkerDead):
            handle.error = frame.reason
            log.error("model %s: worker failed: %s", handle.config.name, frame.reason)
        elif isinstance(frame, ControlReply):
            self.calls.resolve(frame, handle.worker_id)
