"""Routing among a model's replicas: least outstanding work first (ties in turn), and a
conversation kept on the replica that served it while that one has room."""

from __future__ import annotations

from gateway.workers.routing import Router, first_block, load
from gateway.workers.slots import WorkerHandle
from gateway.workers.stream import RequestStream
from shared.config import ModelConfig
from shared.protocol import Capacity, Ready
from shared.types import CanonicalRequest, Message

CONFIG = ModelConfig(name="m", source="/nowhere")


def replica(worker_id: str, running: int = 2, busy: int = 0) -> WorkerHandle:
    handle = WorkerHandle(CONFIG, worker_id, None)
    handle.info = Ready(worker_id, Capacity(running, 8, 4096))
    handle.capacity = handle.info.capacity
    for i in range(busy):
        handle.streams[f"{worker_id}-{i}"] = RequestStream(f"{worker_id}-{i}", "m", worker_id)
    return handle


def chat(*turns: tuple[str, str]) -> CanonicalRequest:
    return CanonicalRequest(messages=[Message(role, text) for role, text in turns])


def test_the_first_block_names_a_conversation_as_it_grows() -> None:
    first = chat(("system", "Be brief."), ("user", "Hi"))
    later = chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Why?"))
    other = chat(("system", "Be verbose."), ("user", "Hi"))
    assert first_block(first) == first_block(later)
    assert first_block(first) != first_block(other)
    assert first_block(CanonicalRequest(prompt="abc" * 2000)) == first_block(
        CanonicalRequest(prompt="abc" * 2000 + "more")
    )
    assert first_block(CanonicalRequest(prompt_token_ids=[1, 2, 3])) is not None
    assert first_block(CanonicalRequest(inputs=["an embedding"])) is None


def test_the_least_loaded_replica_is_chosen_per_place_in_its_batch() -> None:
    small, large = replica("small", running=1, busy=1), replica("large", running=8, busy=2)
    assert load(small) == 1.0 and load(large) == 0.25
    assert Router().choose([small, large], None) is large


def test_ties_are_broken_in_turn() -> None:
    a, b = replica("a"), replica("b")
    router = Router()
    chosen = [router.choose([a, b], None).worker_id for _ in range(4)]
    assert sorted(chosen) == ["a", "a", "b", "b"]


def test_a_conversation_sticks_while_its_replica_has_room_then_moves_and_sticks_again() -> None:
    a, b = replica("a", running=2), replica("b", running=2)
    router = Router()
    home = router.choose([a, b], "conv")
    away = b if home is a else a
    home.streams["x"] = RequestStream("x", "m", home.worker_id)  # busier than the other
    assert router.choose([a, b], "conv") is home  # still has a free place
    home.streams["y"] = RequestStream("y", "m", home.worker_id)  # full
    assert router.choose([a, b], "conv") is away
    home.streams.clear()
    assert router.choose([a, b], "conv") is away  # it moved with the conversation


def test_a_forgotten_replica_lets_its_conversations_go_and_memory_is_bounded() -> None:
    a, b = replica("a"), replica("b")
    router = Router(remember=3)
    home = router.choose([a, b], "conv")
    router.forget(home.worker_id)
    other = b if home is a else a
    other.streams["busy"] = RequestStream("busy", "m", other.worker_id)
    home.streams.clear()
    assert router.choose([a, b], "conv") is home  # least loaded, not remembered
    for i in range(10):
        router.choose([a, b], f"k{i}")
    assert len(router._sticky) == 3


def test_one_replica_is_chosen_without_remembering() -> None:
    a = replica("a")
    router = Router()
    assert router.choose([a], "conv") is a
    assert not router._sticky
