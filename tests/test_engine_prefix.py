"""The engine with its prefix cache, in one process on a real tiny model: what is reused,
what is reported, and that reuse never changes a greedy token."""

from __future__ import annotations

from typing import Any

import pytest

from shared.types import FinishReason, RequestOutput
from tests.engine_fixtures import Loaded, drive, finish, greedy, text, token_ids
from worker.engine.core import EngineCore

# Every engine test runs over each continuous batch (engine.batcher).
pytestmark = pytest.mark.usefixtures("batcher")

SYSTEM = (
    "You are a careful assistant for the operators of a small cluster. Answer briefly, "
    "cite the log lines you rely on, and never invent a host name that is not in them."
)
QUESTIONS = [
    "Which worker restarted last night?",
    "And how long was it down?",
    "Was any request lost while it was down?",
    "Summarise that in one line.",
]


def chat_prompt(chat: Loaded, messages: list[dict[str, str]]) -> list[int]:
    ids = chat.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids)


def converse(chat: Loaded, engine: EngineCore, turns: int = 4) -> list[list[RequestOutput]]:
    """A conversation: each turn re-sends the history with the previous answers as text."""
    messages = [{"role": "system", "content": SYSTEM}]
    deltas = []
    for i, question in enumerate(QUESTIONS[:turns]):
        messages.append({"role": "user", "content": question})
        out = drive(engine, [greedy(f"turn{i}", chat_prompt(chat, messages), 12)])[f"turn{i}"]
        deltas.append(out)
        messages.append({"role": "assistant", "content": text(out)})
    return deltas


def final_usage(deltas: list[RequestOutput]) -> Any:
    assert deltas[-1].usage is not None
    return deltas[-1].usage


def test_the_same_prompt_twice_reuses_it(chat: Loaded) -> None:
    engine = chat.engine()
    prompt = chat_prompt(
        chat, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    )
    first = drive(engine, [greedy("a", prompt, 10, ignore_eos=True)])["a"]
    second = drive(engine, [greedy("b", prompt, 10, ignore_eos=True)])["b"]
    assert final_usage(first).cached_tokens == 0
    assert final_usage(second).cached_tokens == len(prompt) - 1
    assert second[0].usage is not None and second[0].usage.cached_tokens == len(prompt) - 1
    assert token_ids(second) == token_ids(first)
    stats = engine.prefix_stats()
    assert stats is not None and (stats.lookups, stats.hits) == (2, 1)
    assert stats.hit_tokens == len(prompt) - 1


def test_each_turn_reuses_the_previous_one_and_the_tokens_do_not_change(chat: Loaded) -> None:
    cached = converse(chat, chat.engine())
    plain = converse(chat, chat.engine(prefix_cache=False))
    for turn, (with_cache, without) in enumerate(zip(cached, plain, strict=True)):
        assert token_ids(with_cache) == token_ids(without), f"turn {turn}"
        assert final_usage(without).cached_tokens == 0
    for turn in range(1, len(cached)):
        # at least the previous turn's whole prompt came from the cache
        previous_prompt = final_usage(cached[turn - 1]).prompt_tokens
        assert final_usage(cached[turn]).cached_tokens >= previous_prompt, f"turn {turn}"


def test_requests_with_different_cached_lengths_in_one_batch(chat: Loaded) -> None:
    """Rows whose cached prefixes differ in length are merged into one batch (left padding)
    and prefill prompts of different lengths (right padding): same tokens as without."""
    base = [{"role": "system", "content": SYSTEM}]
    prompts = [chat_prompt(chat, [*base, {"role": "user", "content": q}]) for q in QUESTIONS]
    results = {}
    for use_cache in (True, False):
        engine = chat.engine(prefix_cache=use_cache)
        drive(engine, [greedy("warm", prompts[0], 6, ignore_eos=True)])
        drive(engine, [greedy("warm2", prompts[1] + prompts[1][-5:], 6, ignore_eos=True)])
        batch = [greedy(f"q{i}", p, 8, ignore_eos=True) for i, p in enumerate(prompts)]
        results[use_cache] = drive(engine, batch)
        if use_cache:
            cached = [final_usage(results[True][f"q{i}"]).cached_tokens for i in range(4)]
            assert cached[0] == len(prompts[0]) - 1 and cached[1] == len(prompts[1]) - 1
            assert cached[2] > 0 and len(set(cached)) > 1
    for i in range(4):
        assert token_ids(results[True][f"q{i}"]) == token_ids(results[False][f"q{i}"])


def test_rows_that_finish_together_are_each_reused_and_the_tokens_do_not_change(
    chat: Loaded,
) -> None:
    """Four conversations whose first turns finish in the same step (on the rows batch they
    leave onto one shelf, worker/backends/shelves.py); each second turn reuses its own first
    turn whole, one of them twice, and gives the tokens it gives without a cache."""
    base = [{"role": "system", "content": SYSTEM}]
    firsts = [[*base, {"role": "user", "content": q}] for q in QUESTIONS]
    results: dict[bool, dict[str, list[RequestOutput]]] = {}
    for use_cache in (True, False):
        engine = chat.engine(prefix_cache=use_cache)
        prompts = [chat_prompt(chat, m) for m in firsts]
        out = drive(engine, [greedy(f"a{i}", p, 8, ignore_eos=True) for i, p in enumerate(prompts)])
        stats = engine.prefix_stats()
        assert not use_cache or (stats is not None and stats.entries == 4)
        if use_cache and hasattr(engine.backend, "batch"):  # the rows batch: one shelf
            assert engine.prefix_cache is not None and len(engine.prefix_cache.owners) == 1
        seconds = [
            chat_prompt(
                chat,
                [
                    *m,
                    {"role": "assistant", "content": text(out[f"a{i}"])},
                    {"role": "user", "content": "And then?"},
                ],
            )
            for i, m in enumerate(firsts)
        ]
        results[use_cache] = drive(
            engine, [greedy(f"b{i}", p, 8, ignore_eos=True) for i, p in enumerate(seconds)]
        )
        results[use_cache] |= drive(engine, [greedy("again", seconds[2], 8, ignore_eos=True)])
        if use_cache:
            for i, prompt in enumerate(prompts):
                cached = final_usage(results[True][f"b{i}"]).cached_tokens
                assert cached >= len(prompt) + 6, (i, cached)
            assert final_usage(results[True]["again"]).cached_tokens == len(seconds[2]) - 1
    for key in [f"b{i}" for i in range(4)] + ["again"]:
        assert token_ids(results[True][key]) == token_ids(results[False][key]), key


def test_a_row_hit_on_a_shelf_outlives_the_shelf_and_its_tokens_do_not_change(
    chat: Loaded,
) -> None:
    """Four first turns finish together (on the rows batch: onto one shelf); one is hit (by
    a shorter request, which does not cover it); other requests fill the cache until the
    least recently used goes, and with it the rest of the shelf: the hit one stays (copied
    out on its own) and its next turn reuses it whole, with the tokens it gives without a
    cache."""
    base = [{"role": "system", "content": SYSTEM}]
    firsts = [[*base, {"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [chat_prompt(chat, m) for m in firsts]
    probe = chat.engine()
    out = drive(probe, [greedy(f"a{i}", p, 8, ignore_eos=True) for i, p in enumerate(prompts)])
    stats = probe.prefix_stats()
    assert stats is not None
    # room for the four and more, with a shelf of four within an eighth of it
    engine = chat.engine(prefix_cache_gb=8.5 * stats.nbytes / 2**30)
    drive(engine, [greedy(f"a{i}", p, 8, ignore_eos=True) for i, p in enumerate(prompts)])
    cache = engine.prefix_cache
    assert cache is not None
    shelved = hasattr(engine.backend, "batch")
    assert len(cache.owners) == (1 if shelved else 0)
    hit = drive(engine, [greedy("h", prompts[1], 4, ignore_eos=True)])["h"]
    assert final_usage(hit).cached_tokens == len(prompts[1]) - 1
    for n in range(64):  # others, one at a time, until the first eviction
        other = chat_prompt(chat, [{"role": "user", "content": f"{n} {SYSTEM}"}])
        drive(engine, [greedy(f"x{n}", other, 8, ignore_eos=True)])
        if cache.evictions:
            break
    # a0 went first, and on the rows batch a2 and a3 with it; a1 stayed
    assert cache.evictions == (3 if shelved else 1) and cache.nbytes <= cache.capacity
    kept = [e for e in cache.entries.values() if len(e.tokens) == len(prompts[1]) + 8]
    assert [list(e.tokens[: len(prompts[1])]) for e in kept] == [prompts[1]]
    assert kept[0].owner is None  # on storage of its own
    second = chat_prompt(
        chat,
        [
            *firsts[1],
            {"role": "assistant", "content": text(out["a1"])},
            {"role": "user", "content": "And then?"},
        ],
    )
    reused = drive(engine, [greedy("b", second, 8, ignore_eos=True)])["b"]
    assert final_usage(reused).cached_tokens >= len(prompts[1]) + 6
    scratch = drive(chat.engine(prefix_cache=False), [greedy("b", second, 8, ignore_eos=True)])
    assert token_ids(reused) == token_ids(scratch["b"])


def test_a_cache_that_does_not_fit_is_evicted_not_grown(chat: Loaded) -> None:
    probe = chat.engine()
    prompt = chat_prompt(chat, [{"role": "user", "content": QUESTIONS[0]}])
    drive(probe, [greedy("p", prompt, 8, ignore_eos=True)])
    stats = probe.prefix_stats()
    assert stats is not None and stats.entries == 1
    one_entry = stats.nbytes
    engine = chat.engine(prefix_cache_gb=2.5 * one_entry / 2**30)  # room for two
    for i, question in enumerate(QUESTIONS):
        p = chat_prompt(chat, [{"role": "user", "content": f"{i} {question}"}])
        drive(engine, [greedy(f"r{i}", p, 8, ignore_eos=True)])
        stats = engine.prefix_stats()
        assert stats is not None and stats.nbytes <= stats.capacity_bytes
    assert stats.entries == 2 and stats.evictions == 2 and stats.oversize == 0


def test_a_kv_larger_than_the_bound_is_counted_and_logged_once(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    probe = chat.engine()
    prompt = chat_prompt(chat, [{"role": "user", "content": QUESTIONS[0]}])
    drive(probe, [greedy("p", prompt, 8, ignore_eos=True)])
    stats = probe.prefix_stats()
    assert stats is not None
    engine = chat.engine(prefix_cache_gb=0.5 * stats.nbytes / 2**30)  # room for none
    for i in range(2):
        drive(engine, [greedy(f"r{i}", prompt, 8, ignore_eos=True)])
    stats = engine.prefix_stats()
    assert stats is not None and (stats.entries, stats.oversize) == (0, 2)
    warned = [r for r in caplog.records if "larger than the cache's bound" in r.getMessage()]
    assert len(warned) == 1 and "engine.prefix_cache_gb" in warned[0].getMessage()


def test_finished_early_and_aborted_requests_leave_their_kv(chat: Loaded) -> None:
    engine = chat.engine()
    prompt = chat_prompt(
        chat, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}]
    )
    full = text(
        drive(chat.engine(prefix_cache=False), [greedy("x", prompt, 12, ignore_eos=True)])["x"]
    )
    stop = full[4:7]
    out = drive(engine, [greedy("stopped", prompt, 12, ignore_eos=True, stop=[stop])])["stopped"]
    assert finish(out) is FinishReason.STOP and len(token_ids(out)) < 12
    stats = engine.prefix_stats()
    assert stats is not None and stats.entries == 1

    engine = chat.engine()
    engine.add(greedy("left", prompt, 50, ignore_eos=True))
    while not any(o.request_id == "left" and o.token_ids for o in engine.step()):
        pass
    engine.abort(["left"])
    again = drive(engine, [greedy("again", prompt, 4, ignore_eos=True)])["again"]
    assert final_usage(again).cached_tokens == len(prompt) - 1


def test_off_means_off(chat: Loaded) -> None:
    engine = chat.engine(prefix_cache=False)
    prompt = chat_prompt(
        chat, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    )
    drive(engine, [greedy("a", prompt, 4)])
    again = drive(engine, [greedy("b", prompt, 4)])["b"]
    assert final_usage(again).cached_tokens == 0
    assert engine.prefix_stats() is None and engine.prefix_cache is None


@pytest.mark.parametrize("gb", [0.0])
def test_a_zero_bound_is_off(chat: Loaded, gb: float) -> None:
    assert chat.engine(prefix_cache_gb=gb).prefix_cache is None


def test_a_long_system_prompt_is_shared_with_clients_arriving_while_it_runs(
    chat: Loaded,
) -> None:
    system = " ".join([SYSTEM] * 8)  # a few hundred tokens that nobody has prefilled yet

    def prompt(question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return chat_prompt(chat, messages)

    first, second = prompt(QUESTIONS[0]), prompt(QUESTIONS[1])
    assert len(first) >= 300
    engine = chat.engine()
    engine.add(greedy("first", first, 40, ignore_eos=True))
    while not any(o.request_id == "first" and o.token_ids for o in engine.step()):
        pass
    engine.settle()  # as the worker does once the step's outputs are out
    stats = engine.prefix_stats()
    assert stats is not None and stats.entries == 1  # its prompt, while it still runs
    out = drive(engine, [greedy("second", second, 8, ignore_eos=True)])["second"]
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert final_usage(out).cached_tokens == shared
    alone = drive(chat.engine(prefix_cache=False), [greedy("x", second, 8, ignore_eos=True)])
    assert token_ids(out) == token_ids(alone["x"])


def test_a_snapshot_taken_when_tokens_are_read_ahead_of_a_prefill_is_whole(
    chat: Loaded,
) -> None:
    """A long prompt's KV is kept at its first token. When another request starts at the
    step after it joined, the rows batch reads that first token ahead of the new prefill,
    before the step writing its KV: the snapshot still holds exactly the prompt, and a
    request with the same prompt gives the tokens it gives with no cache."""
    long = chat_prompt(chat, [{"role": "system", "content": " ".join([SYSTEM] * 8)}])
    assert len(long) >= 300
    engine = chat.engine(batcher="rows", first_token="step")  # the read-ahead's way
    batch = engine.backend.batch  # type: ignore[attr-defined]
    engine.add(greedy("long", long, 30, ignore_eos=True))
    while not batch.unsent:  # until it has joined: its first token pending
        assert engine.step() == []
    engine.add(greedy("other", chat_prompt(chat, [{"role": "user", "content": "hi"}]), 8))
    assert [o.request_id for o in engine.step()] == ["long"]  # its first token
    engine.settle()
    stats = engine.prefix_stats()
    assert stats is not None and stats.entries == 1  # the snapshot of its prompt
    out = drive(engine, [greedy("again", long, 8, ignore_eos=True)])
    assert final_usage(out["again"]).cached_tokens == len(long) - 1
    alone = drive(chat.engine(prefix_cache=False), [greedy("x", long, 8, ignore_eos=True)])
    assert token_ids(out["again"]) == token_ids(alone["x"])


def test_clients_arriving_together_compute_a_shared_long_prefix_once(chat: Loaded) -> None:
    system = " ".join([SYSTEM] * 8)
    prompts = [
        chat_prompt(chat, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts[:2], strict=False)) if a != b)
    engine = chat.engine()
    out = drive(engine, [greedy(f"s{i}", p, 6, ignore_eos=True) for i, p in enumerate(prompts)])
    cached = [final_usage(out[f"s{i}"]).cached_tokens for i in range(len(prompts))]
    assert cached[0] == 0 and all(c >= shared - 16 for c in cached[1:])  # the others reused it
    alone = chat.engine(prefix_cache=False)
    for i, p in enumerate(prompts):
        reference = drive(alone, [greedy("x", p, 6, ignore_eos=True)])["x"]
        assert token_ids(out[f"s{i}"]) == token_ids(reference)
    assert engine.plan is not None and engine.plan.inflight == {}  # nothing left waiting on


def test_an_abort_keeps_what_ran_and_drops_a_partial_prefill(chat: Loaded) -> None:
    engine = chat.engine(prefill_step_size=8)
    ran = chat_prompt(chat, [{"role": "user", "content": QUESTIONS[0]}])
    partial = chat_prompt(
        chat, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    )
    engine.add(greedy("ran", ran, 50, ignore_eos=True))
    while not any(o.request_id == "ran" and o.token_ids for o in engine.step()):
        pass
    engine.add(greedy("partial", partial, 50, ignore_eos=True))
    engine.step()  # its first 8-token chunk: still prefilling
    assert engine.requests["partial"].status.value == "prefilling"
    outputs = engine.abort(["ran", "partial"])
    assert [o.finish_reason for o in outputs] == [FinishReason.ABORT] * 2
    stats = engine.prefix_stats()
    assert stats is not None and stats.entries == 1  # only the one that ran
    again = drive(engine, [greedy("again", ran, 4, ignore_eos=True)])["again"]
    assert final_usage(again).cached_tokens == len(ran) - 1
    assert not engine.has_work and not engine.backend.active


def test_a_kv_budget_and_a_prefill_budget_on_a_real_model(chat: Loaded) -> None:
    """Admission by free KV memory and the per-step prefill token budget, with the engine's
    own KV-per-token figure: a second request waits while the first holds the memory."""
    prompts = [chat_prompt(chat, [{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    probe = chat.engine()
    per_token = probe.backend.kv_bytes_per_token()
    assert per_token > 0
    budget = (len(prompts[0]) + 6 + 10) * per_token  # one prompt and its 6 tokens, not two
    engine = chat.engine(kv_budget_bytes=budget, prefix_cache=False)
    assert engine.scheduler.config.kv_bytes_per_token == per_token
    for i, p in enumerate(prompts[:2]):
        engine.add(greedy(f"r{i}", p, 6, ignore_eos=True))
    engine.step()
    first, second = (r.status.value for r in engine.requests.values())
    # its first token from its prefill (the rows batch's first_token = "prefill") or not yet
    assert first in {"prefilling", "running"} and second == "waiting"
    out = drive(engine, [])
    assert {k for k, v in out.items() if v} == {"r0", "r1"}  # both served, one after the other

    engine = chat.engine(max_prefill_tokens=len(prompts[0]) + 1, prefix_cache=False)
    for i, p in enumerate(prompts):
        engine.add(greedy(f"p{i}", p, 4, ignore_eos=True))
    engine.step()
    waiting = [r.request_id for r in engine.requests.values() if r.status.value == "waiting"]
    assert waiting == ["p1", "p2"]  # one prompt's worth of new tokens this step
    drive(engine, [])


def test_a_finished_rows_kv_is_stored_after_its_last_delta_and_before_the_next_step(
    chat: Loaded,
) -> None:
    """A step hands out a finished request's last delta before its KV's copy (settle, which
    the worker calls once the step's outputs are sent); the next step, or an abort, settles
    first when nobody did: a later request always finds the prefix."""
    prompt = chat_prompt(
        chat, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    )
    for settled_by in ("settle", "step", "abort"):
        engine = chat.engine()
        engine.add(greedy("a", prompt, 3, ignore_eos=True))
        while not any(o.finish_reason is not None for o in engine.step()):
            pass
        stats = engine.prefix_stats()
        assert stats is not None and stats.entries == 0  # the last delta went out first
        assert engine.unsettled is not None
        if settled_by == "settle":
            engine.settle()
        elif settled_by == "abort":
            assert engine.abort(["nobody"]) == []
        else:
            engine.add(greedy("b", prompt, 2, ignore_eos=True))
            engine.step()  # settles, then admits "b" on the prefix it stored
        stats = engine.prefix_stats()
        assert engine.unsettled is None and stats is not None and stats.entries >= 1
        again = drive(engine, [greedy("c", prompt, 2, ignore_eos=True)])["c"]
        assert final_usage(again).cached_tokens == len(prompt) - 1, settled_by
    engine.add(greedy("d", prompt, 2, ignore_eos=True))  # the engine is whole after it all
    assert token_ids(drive(engine, [])["d"]) == token_ids(again)
