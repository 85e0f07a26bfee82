"""A sharded model's other ranks handle rank 0's frames as rank 0 does: requests added,
aborted, refused after a Shutdown, all aborted by a Shutdown(ABORT); a Turn survives the
wire. (The group itself, over MLX's ring backend, is tested in tests/test_e2e_sharded.py.)"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import msgspec
import pytest

from shared.protocol import Abort, Add, Codec, Shutdown, ShutdownMode
from shared.types import CanonicalRequest, RequestKind, SamplingParams
from worker.lockstep import (
    IDLE_SLEEP_S,
    IDLE_TURNS,
    Follower,
    Lockstep,
    Turn,
    control_channel,
    control_stream,
)


class Engine:
    def __init__(self) -> None:
        self.ids: list[str] = []
        self.has_work = False

    def add(self, prepared: Any) -> None:
        self.ids.append(prepared.request_id)

    def abort(self, ids: list[str]) -> list[Any]:
        self.ids = [i for i in self.ids if i not in ids]
        return []

    def request_ids(self) -> list[str]:
        return list(self.ids)


def add(request_id: str) -> bytes:
    frame = Add(request_id, RequestKind.COMPLETION, CanonicalRequest(prompt="x"), SamplingParams())
    return Codec().encode(frame)


def test_the_other_ranks_handle_frames_as_rank_0() -> None:
    follower = Follower(cast(Lockstep, None))
    engine = Engine()

    def prepare(frame: Add) -> Add:
        if frame.request_id == "bad":
            raise ValueError("refused")
        return frame

    codec = Codec()
    for raw in [add("a"), add("bad"), add("b"), b"\xc1garbage", codec.encode(Abort(["a"]))]:
        follower.handle(engine, prepare, raw)
    assert engine.ids == ["b"]
    follower.handle(engine, prepare, codec.encode(Shutdown(ShutdownMode.DRAIN, 5)))
    follower.handle(engine, prepare, add("late"))  # refused on rank 0 too: it drains
    assert engine.ids == ["b"]
    follower.handle(engine, prepare, codec.encode(Shutdown(ShutdownMode.ABORT, 0)))
    assert engine.ids == []


def test_a_turn_survives_the_wire() -> None:
    turn = Turn([add("a"), b""], stop=True)
    data = msgspec.msgpack.encode(turn)
    assert msgspec.msgpack.decode(data, type=Turn) == turn
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Turn()), type=Turn) == Turn([], False)


class Turns:
    """Rank 0's turns, in order (a Lockstep as the other ranks see it)."""

    def __init__(self, turns: list[Turn]) -> None:
        self.turns = turns

    def share(self, turn: None) -> Turn:
        return self.turns.pop(0)


def test_an_idle_rank_rests_between_turns_once_idle_a_while() -> None:
    # idle turns a tick apart: after IDLE_TURNS in a row the rank sleeps most of each tick
    # instead of waiting inside the collective (which polls); a frame starts the count over
    rests: list[float] = []
    quiet = [Turn() for _ in range(IDLE_TURNS + 2)]
    turns = Turns([*quiet, Turn([Codec().encode(Abort(["x"]))]), Turn(), Turn(stop=True)])
    follower = Follower(cast(Lockstep, turns), rest=rests.append)
    assert follower.run(Engine(), lambda frame: frame) == 0
    assert rests == [IDLE_SLEEP_S] * 3  # the last idle turns before the frame only


def test_a_rank_settles_each_step_where_rank_0_does() -> None:
    """After its step, before the next turn's frames (rank 0 settles once the step's
    outputs are sent, then takes its inputs): both ranks' batches change in one order."""
    calls: list[str] = []

    class Working(Engine):
        def step(self) -> list[Any]:
            calls.append("step")
            return []

        def settle(self) -> None:
            calls.append("settle")

        def abort(self, ids: list[str]) -> list[Any]:
            calls.append("abort")
            self.has_work = False
            return []

    engine = Working()
    engine.has_work = True
    turns = Turns([Turn(), Turn([Codec().encode(Abort(["a"]))]), Turn(stop=True)])
    assert Follower(cast(Lockstep, turns)).run(engine, lambda frame: frame) == 0
    assert calls == ["step", "settle", "abort"]


def test_turns_travel_where_the_backend_reduces(monkeypatch: pytest.MonkeyPatch) -> None:
    assert control_stream("nccl") == mx.gpu  # NCCL reduces arrays on the GPU only
    assert control_stream("ring") == mx.cpu and control_stream("mpi") == mx.cpu

    class Group:
        def split(self, color: int) -> str:
            assert color == 0
            return "its own communicator"

    group = Group()
    assert control_channel(group, "ring") == (group, mx.cpu)  # the model's group, the CPU
    streams: list[object] = []
    monkeypatch.setattr(mx, "new_stream", lambda device: streams.append(device) or "stream")
    # over NCCL: a communicator and a GPU stream of their own, not the model's
    assert control_channel(group, "nccl") == ("its own communicator", "stream")
    assert streams == [mx.gpu]


def test_nccl_without_mlxs_cuda_build_is_refused_by_name() -> None:
    if mx.distributed.is_available("nccl"):
        pytest.skip("this MLX has NCCL")
    with pytest.raises(RuntimeError, match=r"hosts\.backend = 'nccl' needs MLX's CUDA build"):
        Lockstep(2, "nccl")
