"""A sharded model's other ranks handle rank 0's frames as rank 0 does: requests added,
aborted, refused after a Shutdown, all aborted by a Shutdown(ABORT); a Turn survives the
wire. (The group itself, over MLX's ring backend, is tested in tests/test_e2e_sharded.py.)"""

from __future__ import annotations

from typing import Any, cast

import msgspec

from shared.protocol import Abort, Add, Codec, Shutdown, ShutdownMode
from shared.types import CanonicalRequest, RequestKind, SamplingParams
from worker.lockstep import Follower, Lockstep, Turn


class Engine:
    def __init__(self) -> None:
        self.ids: list[str] = []

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
