"""The scheduler alone: no model, no sockets."""

from __future__ import annotations

from concurrent.futures import Future

from shared.types import Priority, SamplingParams
from worker.engine.request import Request
from worker.engine.scheduler import DECODE_RESERVE, FullPrefill, Scheduler, SchedulerConfig
from worker.structured.guide import Guide


def request(name: str, prompt: int = 10, max_tokens: int = 16, batch: bool = False) -> Request:
    priority = Priority.BATCH if batch else Priority.INTERACTIVE
    return Request(name, list(range(prompt)), max_tokens, SamplingParams(), priority)


class Cached(FullPrefill):
    """A plan whose cache holds the first `tokens` of every prompt; it holds back `held`."""

    def __init__(self, tokens: int = 0, held: set[str] | None = None) -> None:
        self.tokens = tokens
        self.held = held or set()
        self.started: list[tuple[str, int]] = []

    def new_tokens(self, request: Request) -> int:
        return len(request.prompt) - self.tokens

    def waits(self, request: Request) -> bool:
        return request.request_id in self.held

    def admitted(self, request: Request, new_tokens: int) -> None:
        self.started.append((request.request_id, new_tokens))


def names(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def make(**config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config))  # type: ignore[arg-type]


def test_a_lone_request_starts_at_once() -> None:
    scheduler = make()
    scheduler.add(request("a"))
    assert names(scheduler.schedule()) == ["a"]
    assert scheduler.waiting == 0 and list(scheduler.running) == ["a"]


def test_interactive_requests_go_first_fifo_within_a_class() -> None:
    scheduler = make(max_prefill_requests=8)
    for r in (request("b1", batch=True), request("i1"), request("b2", batch=True), request("i2")):
        scheduler.add(r)
    assert names(scheduler.schedule()) == ["i1", "i2", "b1", "b2"]


def test_a_continuation_goes_to_the_head_of_its_class() -> None:
    """Resumed after its worker died, its client mid-stream: it has waited longest."""
    scheduler = make(max_running=1)
    scheduler.add(request("a"))
    assert names(scheduler.schedule()) == ["a"]
    resumed = request("resumed", prompt=20)
    resumed.resumed = 5
    for r in (request("b"), request("c", batch=True), resumed):
        scheduler.add(r)
    scheduler.finish("a")
    assert names(scheduler.schedule()) == ["resumed"]
    scheduler.finish("resumed")
    assert names(scheduler.schedule()) == ["b"]


def test_max_running_bounds_the_batch_and_a_finish_frees_a_place() -> None:
    scheduler = make(max_running=2)
    for name in "abc":
        scheduler.add(request(name))
    assert names(scheduler.schedule()) == ["a", "b"]
    assert scheduler.schedule() == []
    assert scheduler.finish("a") is not None
    assert names(scheduler.schedule()) == ["c"]
    assert scheduler.finish("a") is None  # idempotent


def test_batch_requests_hold_at_most_their_share() -> None:
    scheduler = make(max_running=8, batch_share=0.25, max_prefill_requests=8)  # 2 places
    for i in range(4):
        scheduler.add(request(f"b{i}", batch=True))
    assert names(scheduler.schedule()) == ["b0", "b1"]
    scheduler.add(request("i0"))
    assert names(scheduler.schedule()) == ["i0"]  # interactive ones still find a place
    scheduler.finish("b0")
    assert names(scheduler.schedule()) == ["b2"]


def test_the_share_never_rounds_to_zero() -> None:
    scheduler = make(max_running=2, batch_share=0.1)
    scheduler.add(request("b", batch=True))
    assert names(scheduler.schedule()) == ["b"]


def test_new_requests_a_step_are_bounded() -> None:
    scheduler = make(max_prefill_requests=3)
    for i in range(7):
        scheduler.add(request(f"r{i}"))
    assert [len(scheduler.schedule()) for _ in range(4)] == [3, 3, 1, 0]


def test_the_prefill_token_budget_and_the_cached_prefix() -> None:
    scheduler = make(max_prefill_tokens=100, max_prefill_requests=8)
    for i in range(4):
        scheduler.add(request(f"r{i}", prompt=40))
    assert names(scheduler.schedule()) == ["r0", "r1"]  # 80, a third would be 120
    # with 30 of each prompt cached, each costs 10: both fit
    assert names(scheduler.schedule(Cached(30))) == ["r2", "r3"]


def test_a_prompt_longer_than_the_budget_goes_in_alone() -> None:
    scheduler = make(max_prefill_tokens=100)
    scheduler.add(request("long", prompt=500))
    scheduler.add(request("short", prompt=5))
    assert names(scheduler.schedule()) == ["long"]
    assert names(scheduler.schedule()) == ["short"]


def test_admission_by_free_kv_memory() -> None:
    per_token = 10
    # room for 300 + 2 * (100 + 16) tokens: the running request's KV as it grows, then two
    budget = (300 + 2 * (100 + 16)) * per_token
    scheduler = make(kv_budget_bytes=budget, kv_bytes_per_token=per_token, max_prefill_requests=8)
    big = request("big", prompt=284, max_tokens=16)  # needs 284 + 16
    scheduler.add(big)
    assert names(scheduler.schedule()) == ["big"]
    for i in range(3):
        scheduler.add(request(f"s{i}", prompt=100, max_tokens=16))
    assert names(scheduler.schedule()) == ["s0", "s1"]  # s2 would overflow
    big.completion_tokens = 16  # the KV it holds now grows with its output
    scheduler.finish("s0")
    assert names(scheduler.schedule()) == ["s2"]
    assert scheduler.kv_tokens() == 284 + 16 + 2 * 100


def test_a_continuation_s_resumed_tokens_are_counted_once() -> None:
    scheduler = make()
    continuation = request("c", prompt=110)  # its prompt ends with the 10 tokens it resumed
    continuation.resumed = continuation.completion_tokens = 10  # (primed: counted as made)
    scheduler.add(continuation)
    scheduler.schedule()
    assert scheduler.kv_tokens() == 110
    continuation.completion_tokens = 13  # three made here
    assert scheduler.kv_tokens() == 113


def test_kv_reserve_is_capped_for_long_outputs() -> None:
    scheduler = make(kv_budget_bytes=1000 + DECODE_RESERVE, kv_bytes_per_token=1)
    scheduler.add(request("a", prompt=10))
    scheduler.schedule()
    scheduler.add(request("b", prompt=1000 - 10, max_tokens=100_000))
    assert names(scheduler.schedule()) == ["b"]  # reserves DECODE_RESERVE, not 100k tokens


def test_a_request_alone_is_admitted_whatever_its_kv() -> None:
    scheduler = make(kv_budget_bytes=100, kv_bytes_per_token=10)
    scheduler.add(request("huge", prompt=1000))
    assert names(scheduler.schedule()) == ["huge"]


def test_a_large_waiting_request_is_not_overtaken() -> None:
    scheduler = make(kv_budget_bytes=500, kv_bytes_per_token=1, max_prefill_requests=8)
    scheduler.add(request("a", prompt=300, max_tokens=16))
    scheduler.schedule()
    scheduler.add(request("large", prompt=400, max_tokens=16))
    scheduler.add(request("small", prompt=10, max_tokens=16))
    assert scheduler.schedule() == []  # first come, first served


def test_remove_waiting_and_membership() -> None:
    scheduler = make(max_running=1)
    for name in "abc":
        scheduler.add(request(name))
    scheduler.schedule()
    assert "a" in scheduler and "b" in scheduler and "z" not in scheduler
    removed = scheduler.remove_waiting({"b", "z"})
    assert names(removed) == ["b"] and "b" not in scheduler
    assert scheduler.waiting == 1


def test_a_held_request_keeps_its_place_and_others_go_ahead() -> None:
    scheduler = make(max_prefill_requests=8)
    for name in ("a", "b", "c"):
        scheduler.add(request(name))
    plan = Cached(held={"b"})
    assert names(scheduler.schedule(plan)) == ["a", "c"]
    assert plan.started == [("a", 10), ("c", 10)]
    assert [r.request_id for r in scheduler.queues[False]] == ["b"]
    scheduler.add(request("d"))
    assert names(scheduler.schedule(Cached())) == ["b", "d"]  # b first: its place was kept


def test_a_request_whose_grammar_compiles_waits_in_its_place_and_others_go_ahead() -> None:
    compiling: Future[object] = Future()
    scheduler = make(max_prefill_requests=8)
    slow = request("slow")
    slow.guide = Guide(None, compiling=compiling)
    for r in (slow, request("b")):
        scheduler.add(r)
    assert names(scheduler.schedule()) == ["b"]
    assert not scheduler.startable()  # the engine waits for the compile's wake, no spin
    compiling.set_exception(ValueError("no"))  # its failure is the engine's to answer
    assert scheduler.startable()
    scheduler.add(request("c"))
    assert names(scheduler.schedule()) == ["slow", "c"]
    assert slow.guide.compile_error == "no"
