"""Fakes for unit tests of gateway/workers: worker processes that exist only as handles, a
transport that records frames, and the units wired together as the Supervisor wires them."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from gateway.workers.admission import Admission
from gateway.workers.catalog import Catalog
from gateway.workers.client import Submission
from gateway.workers.control import ControlCalls
from gateway.workers.device import Device
from gateway.workers.lifetime import Lifetime
from gateway.workers.memory import MemoryBudget
from gateway.workers.pool import Pool
from gateway.workers.processes import Processes
from gateway.workers.recovery import Recovery
from gateway.workers.routing import Router
from gateway.workers.slots import WorkerHandle
from gateway.workers.tasks import Tasks
from gateway.workers.transport import Transport
from shared.config import ModelConfig, ServerConfig
from shared.paths import RunDir
from shared.protocol import Capacity, Ready, Shutdown, ShutdownMode, ToWorker
from shared.types import CanonicalRequest, Message, RequestKind, RequestOutput, SamplingParams

GiB = 2**30
HOST = Device("cpu", "cpu", 64 * GiB, "host RAM")


def chat(request_id: str | None = None, **fields: Any) -> Submission:
    """A one-message chat request for model "m"; `fields` are Submission's other fields."""
    request = CanonicalRequest(messages=[Message("user", "hi")])
    sampling = fields.pop("sampling", SamplingParams())
    fields.setdefault("needs", ("chat",))
    return Submission("m", RequestKind.CHAT, request, sampling, request_id=request_id, **fields)


class FakeProcess:
    """Stands in for an asyncio subprocess: it 'exits' when told to."""

    _pids = itertools.count(90000)

    def __init__(self) -> None:
        self.pid = next(self._pids)
        self.signals: list[int] = []
        self.returncode: int | None = None
        self._exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def kill(self) -> None:
        self.signals.append(9)

    async def wait(self) -> int:
        return await self._exit


class FakeTransport:
    """Records what is sent; a Shutdown ends the worker as a real one ends: at once when
    it aborts, once its last request has finished when it drains."""

    requests_addr = "ipc://fake-requests"
    outputs_addr = "ipc://fake-outputs"

    def __init__(self) -> None:
        self.sent: list[tuple[str, ToWorker]] = []
        self.reachable = True
        self.processes: FakeProcesses | None = None

    def send(self, worker_id: str, frame: ToWorker) -> bool:
        if not self.reachable:
            return False
        self.sent.append((worker_id, frame))
        if isinstance(frame, Shutdown) and self.processes is not None:
            handle = self.processes.get(worker_id)
            if handle is not None:
                self.processes.shut_down(handle, frame)
        return True

    def frames(self, kind: type) -> list[Any]:
        return [frame for _, frame in self.sent if isinstance(frame, kind)]


class FakeProcesses:
    """Processes without processes: spawn makes a handle, Ready comes on the next loop turn
    (unless `auto_ready` is off), kill and exit end it and report the exit."""

    def __init__(self, on_exit: Any, capacity: Capacity) -> None:
        self.on_exit = on_exit
        self.capacity = capacity
        self.by_id: dict[str, WorkerHandle] = {}
        self.spawned: list[WorkerHandle] = []
        self.auto_ready = True
        self.fail_load: str | None = None  # the next spawns exit before Ready, saying this
        self.draining: set[str] = set()  # told to drain: they exit with their last request
        self._serial = itertools.count(1)

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self.by_id.get(worker_id)

    def alive(self) -> list[WorkerHandle]:
        return list(self.by_id.values())

    async def spawn(self, model: ModelConfig, restart: bool) -> WorkerHandle:
        process = cast(asyncio.subprocess.Process, FakeProcess())
        handle = WorkerHandle(model, f"{model.name}-{next(self._serial)}", process, restart)
        self.by_id[handle.worker_id] = handle
        self.spawned.append(handle)
        loop = asyncio.get_running_loop()
        if self.fail_load is not None:
            handle.error = self.fail_load
            loop.call_soon(self.exit, handle, 1)
        elif self.auto_ready:
            loop.call_soon(self.make_ready, handle)
        return handle

    def make_ready(self, handle: WorkerHandle) -> None:
        if handle.exited.is_set():
            return
        handle.info = Ready(handle.worker_id, self.capacity, capabilities=["chat", "completion"])
        handle.capacity = self.capacity
        handle.ready.set()

    async def wait_ready(self, handle: WorkerHandle, timeout: float) -> None:
        await Processes.wait_ready(cast(Processes, self), handle, timeout)

    async def kill(self, handle: WorkerHandle, sig: int, grace: float) -> None:
        self.exit(handle, -sig)
        await handle.exited.wait()

    def shut_down(self, handle: WorkerHandle, frame: Shutdown) -> None:
        if frame.mode == ShutdownMode.ABORT or not handle.streams:
            self.exit(handle, 0)
        else:
            self.draining.add(handle.worker_id)

    def exit(self, handle: WorkerHandle, code: int) -> None:
        if handle.exited.is_set():
            return
        handle.exit_code = code
        self.by_id.pop(handle.worker_id, None)
        handle.exited.set()
        self.on_exit(handle)


@dataclass
class Rig:
    """The workers' units wired as the Supervisor wires them, over fakes."""

    server: ServerConfig
    catalog: Catalog
    processes: FakeProcesses
    transport: FakeTransport
    lifetime: Lifetime
    recovery: Recovery
    pool: Pool
    admission: Admission
    tasks: Tasks
    calls: ControlCalls
    draining: list[bool] = field(default_factory=list)

    def handle(self, name: str = "m") -> WorkerHandle:
        handle = self.catalog.slot(name).handle
        assert handle is not None
        return handle

    def output(self, handle: WorkerHandle, output: RequestOutput) -> None:
        """A StepOutputs frame's effect on one request (as the Supervisor routes it)."""
        stream = handle.streams.get(output.request_id)
        assert stream is not None
        handle.served = True
        stream.put(output)
        if output.finish_reason is not None:
            del handle.streams[output.request_id]
            if not handle.streams:
                self.lifetime.released(self.catalog.slots.get(handle.config.name))
                if handle.worker_id in self.processes.draining:
                    self.processes.exit(handle, 0)


def rig(
    tmp_path: Path,
    *models: ModelConfig,
    capacity: Capacity | None = None,
    **server: Any,
) -> Rig:
    """Must be called inside a running event loop."""
    config = ServerConfig(**server)
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    catalog = Catalog(models or [ModelConfig(name="m", source="/nowhere")])
    tasks = Tasks()
    calls = ControlCalls()
    transport = FakeTransport()
    holder: list[Rig] = []

    def exited(handle: WorkerHandle) -> None:
        slot = catalog.slots.get(handle.config.name)
        if slot is not None:
            holder[0].recovery.exited(slot, handle)

    processes = FakeProcesses(exited, capacity or Capacity(2, 2, 4096))
    transport.processes = processes
    lifetime = Lifetime(config, tasks, lambda name: holder[0].pool.unload(name))
    t = cast(Transport, transport)
    recovery = Recovery(
        config, run_dir, t, calls, tasks, lambda slot: holder[0].pool.bring_up(slot, True)
    )
    p = cast(Processes, processes)
    memory = MemoryBudget(config, HOST)
    pool = Pool(config, catalog, p, recovery, lifetime, memory, t, tasks)
    draining: list[bool] = []
    admission = Admission(
        config, catalog, pool, p.get, Router(), lifetime, t, calls, lambda: bool(draining)
    )
    r = Rig(
        config,
        catalog,
        processes,
        transport,
        lifetime,
        recovery,
        pool,
        admission,
        tasks,
        calls,
        draining,
    )
    holder.append(r)
    return r


async def until(condition: Any, timeout: float = 5.0) -> None:
    """Wait for `condition()` to hold, a loop turn at a time (no fixed sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.001)
