"""Workers on other machines as replicas, over fakes (no sockets): who may join, frames from
the wrong key, Rejoin for strangers, other weights refused, and a lost replica: the requests
it had started end with one clear error, the others go to another replica (or the model's
own worker, or fail when none may serve)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
import zmq

from gateway.workers.remote import RemoteDoor
from gateway.workers.replicas import LOADING_PER_KEY, LOST_KEPT, Replicas
from gateway.workers.routing import Router
from gateway.workers.slots import Slot, WorkerHandle
from gateway.workers.stream import RequestStream
from shared.cluster import AllowedWorkers
from shared.config import ModelConfig
from shared.protocol import (
    PROTOCOL_VERSION,
    Add,
    Capacity,
    Control,
    ControlReply,
    Heartbeat,
    Hello,
    Ready,
    Refuse,
    Rejoin,
    StepOutputs,
    ToWorker,
    WorkerDead,
    WorkerState,
)
from shared.types import CanonicalRequest, ErrorCode, RequestKind, RequestOutput, SamplingParams
from tests.worker_fakes import Rig, chat, rig, until

pytestmark = pytest.mark.anyio

REMOTE = ModelConfig(name="m", source="/nowhere", placement="remote")


class FakeDoor:
    def __init__(self, folder: Path) -> None:
        self.allowed = AllowedWorkers(folder / "workers.json")
        self.routes: set[str] = set()
        self.sent: list[tuple[str, ToWorker]] = []
        self.gone: set[str] = set()
        self.probes = 0

    def send(self, worker_id: str, frame: ToWorker, quiet: bool = False) -> bool:
        self.sent.append((worker_id, frame))
        return True

    def reachable(self, worker_id: str) -> bool:
        self.probes += 1
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
        hello = Hello(worker_id, PROTOCOL_VERSION, 42, "m")
        self.replicas.admit(hello, key, "10.0.0.7", worker_id.encode())
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
    assert world.replicas.admit(beat, world.keys["a"], "x", b"any") is handle
    # another allowed key speaking for it: dropped
    assert world.replicas.admit(beat, world.key("b"), "x", b"any") is None
    # a Hello for it from another connection than its requests socket: dropped
    world.replicas.admit(Hello("m@a", PROTOCOL_VERSION, 1, "m"), world.key("b"), "x", b"m@b")
    assert world.replicas.get("m@a") is handle and not world.door.sent


async def test_who_may_not_join_is_refused_saying_why(tmp_path: Path) -> None:
    world = World(tmp_path)
    stranger = zmq.curve_keypair()[0].decode()
    world.replicas.is_local = lambda worker_id: worker_id == "m-1-abc"

    def admit(worker_id: str, version: int, model: str, key: str) -> None:
        hello = Hello(worker_id, version, 1, model)
        world.replicas.admit(hello, key, "x", worker_id.encode())

    admit("m@s", PROTOCOL_VERSION, "m", stranger)
    admit("m@v", PROTOCOL_VERSION + 1, "m", world.key("a"))
    admit("z@a", PROTOCOL_VERSION, "zzz", world.key("a"))
    admit("m-1-abc", PROTOCOL_VERSION, "m", world.key("a"))
    refused = world.door.frames(Refuse)
    assert [w for w, _ in refused] == ["m@s", "m@v", "z@a", "m-1-abc"]  # each to itself
    reasons = [f.reason for _, f in refused]
    assert "not allowed" in reasons[0]
    assert "protocol version" in reasons[1]
    assert "'zzz' is not configured" in reasons[2]
    assert "one of the gateway's own" in reasons[3]
    assert world.slot.remotes == []


async def test_a_hello_on_a_live_workers_id_means_its_connection_is_gone(tmp_path: Path) -> None:
    world = World(tmp_path)
    first = world.join("m@a", "a")
    fresh = stream("r1", first)
    # another key holds the id now: ZeroMQ gives an id to one connection at a time
    second = world.join("m@a", "b")
    assert first.lost and second is not first and world.slot.remotes == [second]
    assert not world.door.frames(Refuse)
    assert not fresh.finished and world.slot.replay == [fresh]  # for its Ready
    world.replicas.serve_waiting(world.slot, second)
    assert second.streams == {"r1": fresh}


async def test_step_outputs_are_taken_in_order_and_a_gap_loses_the_worker(
    tmp_path: Path,
) -> None:
    world = World(tmp_path)
    a, b = world.join("m@a", "a"), world.join("m@b", "b")
    key = world.keys["a"]

    def steps(seq: int, step: int = 3, session: int = 0) -> StepOutputs:
        return StepOutputs("m@a", step, [], session, seq)

    # its engine's and its refusals' numbers run apart; a local worker's (0) are not checked
    for frame in (steps(1), steps(2), steps(1, -1), steps(3), steps(2, -1), steps(0)):
        assert world.replicas.admit(frame, key, "x", b"steps") is a
    # another session's (of requests it dropped when it joined again): dropped, and not
    # numbered against this one's
    assert world.replicas.admit(steps(9, session=4), key, "x", b"steps") is None
    assert not a.lost
    started, fresh = stream("r1", a, received=True), stream("r2", a)
    assert world.replicas.admit(steps(5), key, "x", b"steps") is None  # 4 never came
    assert a.lost and "step outputs from it were lost on the way" in str(a.error)
    error = (await started.get()).error
    assert error is not None and error.code == ErrorCode.WORKER_DIED
    assert b.streams == {"r2": fresh}  # not started: sent to the other replica
    # asked to rejoin at once, about the session it was lost in (a worker that has joined
    # again since ignores it); its next frames meet the same answer, once in a while
    world.replicas.admit(steps(6), key, "x", b"steps")
    ((to, rejoin),) = world.door.frames(Rejoin)
    assert to == "m@a" and rejoin.session == 0
    # a stranger (a gateway that restarted knows no session of it)
    world.replicas.admit(steps(1), world.key("c"), "x", b"steps-c")
    assert world.door.frames(Rejoin)[-1] == ("m@a", rejoin)  # rate-limited for m@a
    world.replicas.admit(StepOutputs("m@c", 1, [], 0, 1), world.key("c"), "x", b"c")
    assert world.door.frames(Rejoin)[-1][1].session == -1


async def test_a_stranger_is_asked_to_rejoin_once_in_a_while(tmp_path: Path) -> None:
    world = World(tmp_path)
    beat = Heartbeat("m@gone", WorkerState.READY, 1, 0, 0)
    for _ in range(3):
        assert world.replicas.admit(beat, world.key("a"), "x", b"random") is None
    world.replicas.admit(WorkerDead("m@other", "bye"), world.key("a"), "x", b"random")
    assert [w for w, _ in world.door.frames(Rejoin)] == ["m@gone"]


async def test_other_weights_than_the_models_are_refused(tmp_path: Path) -> None:
    world = World(tmp_path)
    first = world.join("m@a", "a", identity="sha256:one")
    assert world.slot.identity == "sha256:one" and first.is_ready
    other = world.join("m@b", "b", identity="sha256:two")
    assert not other.is_ready and other not in world.slot.remotes
    ((_, refusal),) = world.door.frames(Refuse)
    assert "other weights" in refusal.reason


async def test_what_waited_for_a_replica_dialing_in_again_ends_if_it_is_refused(
    tmp_path: Path,
) -> None:
    # weights of its own here (a folder): their identity outlives the replicas'
    world = World(tmp_path, ModelConfig(name="m", source=str(tmp_path)))
    a = world.join("m@a", "a", identity="sha256:one")
    fresh = stream("r1", a)
    world.replicas.lose(a, "its connection closed", back=True)  # it dials in again...
    assert world.slot.replay == [fresh] and not world.loads
    world.join("m@a", "a", identity="sha256:two")  # ...with other weights: refused
    assert world.loads == [world.slot]  # what waited for it waits for the model's own worker
    assert world.slot.replay == [fresh] and not fresh.finished


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


async def test_a_control_reply_answers_only_a_call_made_to_its_sender(tmp_path: Path) -> None:
    world = World(tmp_path)
    a, b = world.join("m@a", "a"), world.join("m@b", "b")
    transport = cast(Any, world.rig.transport)
    call = asyncio.ensure_future(
        world.rig.calls.call(transport, a.worker_id, "m", "stats", {}, timeout=5)
    )
    await until(lambda: bool(transport.sent))
    (_, control), *_ = [(w, f) for w, f in transport.sent if isinstance(f, Control)]
    world.rig.calls.resolve(ControlReply("m@b", control.call_id, True, {"forged": 1}), b.worker_id)
    assert not call.done()
    world.rig.calls.resolve(ControlReply("m@a", control.call_id, True, {"steps": 3}), a.worker_id)
    assert await call == {"steps": 3}


async def test_lost_replicas_listed_are_bounded_and_slow_loaders_are_lost(
    tmp_path: Path,
) -> None:
    world = World(tmp_path)
    for i in range(LOST_KEPT + 5):
        world.replicas.lose(world.join(f"m@{i}", f"k{i}"), "gone")
    assert len(world.slot.remotes) <= LOST_KEPT
    assert len(world.replicas.by_id) <= LOST_KEPT
    world.replicas.load_timeout_s = 0.0
    key = world.key("slow")
    world.replicas.admit(Hello("m@slow", PROTOCOL_VERSION, 1, "m"), key, "x", b"m@slow")
    world.replicas.check_keys()
    slow = world.replicas.by_id["m@slow"]
    assert slow.lost and "not ready within" in (slow.error or "")


async def test_one_key_may_have_only_so_many_workers_loading(tmp_path: Path) -> None:
    world = World(tmp_path)
    key = world.key("busy")
    for i in range(LOADING_PER_KEY + 1):
        hello = Hello(f"m@{i}", PROTOCOL_VERSION, 1, "m")
        world.replicas.admit(hello, key, "x", hello.worker_id.encode())
    assert len(world.replicas.live()) == LOADING_PER_KEY
    ((_, refusal),) = world.door.frames(Refuse)
    assert "loading already" in refusal.reason


async def test_at_shutdown_what_waits_and_what_a_lost_replica_held_end_clearly(
    tmp_path: Path,
) -> None:
    world = World(tmp_path, ModelConfig(name="m", source="/nowhere"))
    a = world.join("m@a", "a")
    waiting = RequestStream("w", "m", "")
    world.slot.replay.append(waiting)
    fresh = stream("r1", a)
    await world.replicas.drain(0.0)
    world.replicas.lose(a, "its connection closed")
    assert waiting.finished and fresh.finished and not world.loads  # no load at shutdown
    for s in (waiting, fresh):
        error = (await s.get()).error
        assert error is not None and error.code == ErrorCode.SHUTTING_DOWN


async def test_disconnects_share_one_second_check(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.join("m@a", "a")
    for _ in range(50):  # connections opened and closed by anyone: one check, then one more
        world.replicas.disconnected()
    assert world.door.probes == 1 and world.replicas._recheck is not None
    world.door.gone.add("m@a")
    world.replicas._rechecked()
    assert world.door.probes == 2 and world.replicas.by_id["m@a"].lost
    assert world.replicas._recheck is not None  # closes came meanwhile: once more
    world.replicas._recheck.cancel()
