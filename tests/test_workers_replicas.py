"""Workers on other machines as replicas, over fakes (no sockets): who may join, frames from
the wrong key, Rejoin for strangers, other weights refused, and a lost replica: the requests
it had started end with one clear error, the others go to another replica (or the model's
own worker, or fail when none may serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import zmq

from gateway.workers.remote import RemoteDoor
from gateway.workers.replicas import Replicas
from gateway.workers.routing import Router
from gateway.workers.slots import Slot, WorkerHandle
from gateway.workers.stream import RequestStream
from shared.cluster import AllowedWorkers
from shared.config import ModelConfig
from shared.protocol import (
    PROTOCOL_VERSION,
    Add,
    Capacity,
    Heartbeat,
    Hello,
    Ready,
    Refuse,
    Rejoin,
    ToWorker,
    WorkerDead,
    WorkerState,
)
from shared.types import CanonicalRequest, ErrorCode, RequestKind, RequestOutput, SamplingParams
from tests.worker_fakes import Rig, chat, rig

pytestmark = pytest.mark.anyio

REMOTE = ModelConfig(name="m", source="/nowhere", placement="remote")


class FakeDoor:
    def __init__(self, folder: Path) -> None:
        self.allowed = AllowedWorkers(folder / "workers.json")
        self.routes: set[str] = set()
        self.sent: list[tuple[str, ToWorker]] = []
        self.gone: set[str] = set()

    def send(self, worker_id: str, frame: ToWorker) -> bool:
        self.sent.append((worker_id, frame))
        return True

    def reachable(self, worker_id: str) -> bool:
        return worker_id not in self.gone

    def frames(self, kind: type) -> list[tuple[str, Any]]:
        return [(w, f) for w, f in self.sent if isinstance(f, kind)]


class World:
    def __init__(self, tmp_path: Path, model: ModelConfig = REMOTE) -> None:
        self.rig: Rig = rig(tmp_path, model)
        self.door = FakeDoor(tmp_path)
        self.loads: list[Slot] = []
        self.replicas = Replicas(
            cast(RemoteDoor, self.door),
            self.rig.catalog,
            self.rig.calls,
            self.rig.recovery,
            Router(),
            self.loads.append,
            lambda slot: None,
        )
        self.keys: dict[str, str] = {}

    @property
    def slot(self) -> Slot:
        return self.rig.catalog.slot("m")

    def key(self, name: str) -> str:
        if name not in self.keys:
            self.keys[name] = zmq.curve_keypair()[0].decode()
            self.door.allowed.add(name, self.keys[name])
        return self.keys[name]

    def join(self, worker_id: str, name: str, identity: str = "") -> WorkerHandle:
        key = self.key(name)
        self.replicas.admit(Hello(worker_id, PROTOCOL_VERSION, 42, "m"), key, "10.0.0.7")
        handle = self.replicas.get(worker_id)
        assert handle is not None
        ready = Ready(worker_id, Capacity(2, 8, 4096), identity=identity)
        if self.replicas.ready(handle, ready):
            handle.info, handle.capacity = ready, ready.capacity
        return handle


def stream(request_id: str, handle: WorkerHandle, received: bool = False) -> RequestStream:
    s = RequestStream(request_id, "m", handle.worker_id)
    s.add = Add(request_id, RequestKind.CHAT, CanonicalRequest(), SamplingParams())
    s.received = received
    handle.streams[request_id] = s
    return s


async def test_an_allowed_key_joins_and_its_frames_are_its_own(tmp_path: Path) -> None:
    world = World(tmp_path)
    handle = world.join("m@a", "a")
    assert handle.remote is not None and handle.remote.name == "a"
    assert handle.host == "10.0.0.7" and handle.pid == 42
    assert world.slot.replicas() == [handle] and "m@a" in world.door.routes
    beat = Heartbeat("m@a", WorkerState.READY, 1, 0, 0)
    assert world.replicas.admit(beat, world.keys["a"], "x") is handle
    # another allowed key speaking for it: dropped
    assert world.replicas.admit(beat, world.key("b"), "x") is None


async def test_who_may_not_join_is_refused_saying_why(tmp_path: Path) -> None:
    world = World(tmp_path)
    stranger = zmq.curve_keypair()[0].decode()
    admit = world.replicas.admit
    admit(Hello("m@s", PROTOCOL_VERSION, 1, "m"), stranger, "x")
    admit(Hello("m@v", PROTOCOL_VERSION + 1, 1, "m"), world.key("a"), "x")
    admit(Hello("z@a", PROTOCOL_VERSION, 1, "zzz"), world.key("a"), "x")
    world.join("m@a", "a")
    admit(Hello("m@a", PROTOCOL_VERSION, 1, "m"), world.key("b"), "x")  # its id, not its key
    reasons = [f.reason for _, f in world.door.frames(Refuse)]
    assert "not allowed" in reasons[0]
    assert "protocol version" in reasons[1]
    assert "'zzz' is not configured" in reasons[2]
    assert "taken by another worker" in reasons[3]
    assert [h.worker_id for h in world.slot.remotes] == ["m@a"]


async def test_a_stranger_is_asked_to_rejoin_once_in_a_while(tmp_path: Path) -> None:
    world = World(tmp_path)
    beat = Heartbeat("m@gone", WorkerState.READY, 1, 0, 0)
    for _ in range(3):
        assert world.replicas.admit(beat, world.key("a"), "x") is None
    world.replicas.admit(WorkerDead("m@other", "bye"), world.key("a"), "x")
    assert [w for w, _ in world.door.frames(Rejoin)] == ["m@gone"]


async def test_other_weights_than_the_models_are_refused(tmp_path: Path) -> None:
    world = World(tmp_path)
    first = world.join("m@a", "a", identity="sha256:one")
    assert world.slot.identity == "sha256:one" and first.is_ready
    other = world.join("m@b", "b", identity="sha256:two")
    assert not other.is_ready and other not in world.slot.remotes
    ((_, refusal),) = world.door.frames(Refuse)
    assert "other weights" in refusal.reason


async def test_a_lost_replica_sends_its_unstarted_requests_to_another(tmp_path: Path) -> None:
    world = World(tmp_path)
    a, b = world.join("m@a", "a"), world.join("m@b", "b")
    started, fresh = stream("r1", a, received=True), stream("r2", a)
    world.door.gone.add("m@a")
    world.replicas.disconnected()
    assert a.lost and a.exited.is_set() and world.slot.replicas() == [b]
    assert started.finished
    error = (await started.get()).error
    assert error is not None
    assert error.code == ErrorCode.WORKER_DIED
    assert "lost: its connection closed" in error.message and "had started" in error.message
    assert not fresh.finished and b.streams == {"r2": fresh} and fresh.worker_id == "m@b"
    assert (world.slot.died, world.slot.replayed) == (1, 1)
    # it dials in again with its own key: its lost entry gives way
    again = world.join("m@a", "a")
    assert world.slot.remotes == [b, again] and again.is_ready


async def test_with_no_replica_left_a_remote_model_fails_what_waited(tmp_path: Path) -> None:
    world = World(tmp_path)
    a = world.join("m@a", "a")
    fresh = stream("r1", a)
    world.replicas.lose(a, "no heartbeat for 30s")
    assert fresh.finished and not world.loads
    error = (await fresh.get()).error
    assert error is not None and "no other worker serves it now" in error.message


async def test_with_no_replica_left_a_local_model_loads_its_own_worker(tmp_path: Path) -> None:
    world = World(tmp_path, ModelConfig(name="m", source="/nowhere"))
    a = world.join("m@a", "a")
    fresh = stream("r1", a)
    world.replicas.lose(a, "no heartbeat for 30s")
    assert not fresh.finished and world.slot.replay == [fresh]
    assert world.loads == [world.slot]


async def test_a_removed_key_loses_its_worker_and_tells_it(tmp_path: Path) -> None:
    world = World(tmp_path)
    a = world.join("m@a", "a")
    world.door.allowed.remove("a")
    world.replicas.check_keys()
    assert a.lost and "key was removed" in (a.error or "")
    assert world.door.frames(Refuse)


@pytest.mark.parametrize("outputs", [[RequestOutput("r1", "hi")]])
async def test_a_request_sent_to_a_replica_counts_there(
    tmp_path: Path, outputs: list[RequestOutput]
) -> None:
    world = World(tmp_path)
    a = world.join("m@a", "a")
    waiting = RequestStream("r1", "m", "")
    waiting.add = Add("r1", RequestKind.CHAT, CanonicalRequest(), SamplingParams())
    world.slot.replay.append(waiting)
    world.replicas.serve_waiting(world.slot, a)
    assert a.requests == 1 and a.streams == {"r1": waiting} and not world.slot.replay
    waiting.put(outputs[0])
    assert waiting.received


async def test_a_local_crash_sends_its_requests_to_a_ready_replica(tmp_path: Path) -> None:
    world = World(tmp_path, ModelConfig(name="m", source="/nowhere"))
    r = world.rig
    await r.pool.load("m")
    local = r.handle()
    started = await r.admission.submit(chat("started"))
    waiting = await r.admission.submit(chat("waiting"))
    started.put(RequestOutput("started", text="Hel", token_ids=[5]))
    remote = world.join("m@a", "a")
    r.processes.exit(local, -9)
    assert {s.request_id for s in world.slot.replay} == {"started", "waiting"}
    world.replicas.local_exited(world.slot)
    assert not world.slot.replay and set(remote.streams) == {"started", "waiting"}
    adds = {a.request_id: a for w, a in r.transport.sent if w == "m@a" and isinstance(a, Add)}
    assert adds["started"].request.resumed == [5]  # it goes on from its token there
    assert adds["waiting"].request.resumed == []
    assert not started.finished and not waiting.finished
    r.tasks.cancel_all()
