"""EngineCore admission into mlx-lm's BatchGenerator: requests go in a group at a time, and a
burst that starts an idle batch is prefilled in groups (real tiny MLX model)."""

from __future__ import annotations

import collections

import pytest

from shared.types import RequestOutput
from tests.engine_fixtures import (
    Loaded,
    greedy,
    reference_greedy,
    token_ids,
)
from worker.engine import EngineCore


def first_token_steps(engine: EngineCore, burst: int, prompts: list[list[int]]) -> dict[str, int]:
    """Add a burst at once; the engine step at which each request got its first token."""
    for i in range(burst):  # one prompt: a prompt of a single token skips the prefill step
        engine.add(greedy(f"r{i}", prompts[0], 6, ignore_eos=True))
    first: dict[str, int] = {}
    for step in range(1, 200):
        for o in engine.step():
            if o.token_ids and o.request_id.startswith("r") and o.request_id not in first:
                first[o.request_id] = step
        if not engine.has_work:
            break
    assert not engine.has_work and len(first) == burst
    return first


def test_a_burst_gets_its_first_tokens_group_by_group(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Two groups: the first half's first tokens go out before the second half enters the
    generator, and every request still gets exactly mlx-lm's greedy tokens."""
    engine = chat.engine(max_running=16, prefill_batch_size=16, burst_prefill_groups=2)
    for i in range(8):
        engine.add(greedy(f"r{i}", prompts[i % len(prompts)], 6, ignore_eos=True))
    outputs: dict[str, list[RequestOutput]] = {}
    first: dict[str, int] = {}
    outside_at_first_tokens: set[str] = set()
    for step in range(1, 200):
        got = engine.step()
        for o in got:
            outputs.setdefault(o.request_id, []).append(o)
        if not first and any(o.token_ids for o in got):
            outside_at_first_tokens = {r.request_id for r in engine.requests.values() if r.uid < 0}
        for o in got:
            first.setdefault(o.request_id, step)
        if not engine.has_work:
            break
    assert outside_at_first_tokens == {"r4", "r5", "r6", "r7"}
    early, late = {first[f"r{i}"] for i in range(4)}, {first[f"r{i}"] for i in range(4, 8)}
    assert max(early) < min(late)
    for i in range(8):
        prompt = prompts[i % len(prompts)]
        assert token_ids(outputs[f"r{i}"]) == reference_greedy(chat.model, prompt, 6)


def test_a_long_prompt_does_not_hold_back_later_requests(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """A prompt that takes many prefill steps: a short request added behind it joins the
    generator at the next step and gets its first token long before the long prompt's."""
    engine = chat.engine(prefill_step_size=4)
    long_prompt = prompts[2]
    assert len(long_prompt) > 16
    engine.add(greedy("long", long_prompt, 4, ignore_eos=True))
    engine.step()
    engine.add(greedy("short", [long_prompt[0], long_prompt[1]], 4, ignore_eos=True))
    engine.step()
    assert engine.requests["short"].uid >= 0  # in the generator, not staged
    first: dict[str, int] = {}
    for step in range(100):
        for o in engine.step():
            first.setdefault(o.request_id, step)
        if not engine.has_work:
            break
    assert first["short"] < first["long"]


def test_what_is_split_and_what_is_not(chat: Loaded, prompts: list[list[int]]) -> None:
    def groups(first: dict[str, int]) -> list[int]:
        return [n for _, n in sorted(collections.Counter(first.values()).items())]

    # switched off: the burst starts together
    off = chat.engine(max_running=16, prefill_batch_size=16, burst_prefill_groups=1)
    assert groups(first_token_steps(off, 8, prompts)) == [8]
    # balanced groups, never below MIN_GROUP requests: a burst of 7 is one group; in three
    # groups, 10 is 5 + 5 and 13 is 5 + 4 + 4
    assert groups(first_token_steps(chat.engine(max_running=16), 7, prompts)) == [7]
    three = {"max_running": 16, "prefill_batch_size": 16, "burst_prefill_groups": 3}
    assert groups(first_token_steps(chat.engine(**three), 10, prompts)) == [5, 5]
    assert groups(first_token_steps(chat.engine(**three), 13, prompts)) == [5, 4, 4]
    # prefill_batch_size still caps a group
    capped = chat.engine(max_running=16, prefill_batch_size=3)
    assert groups(first_token_steps(capped, 8, prompts)) == [3, 3, 2]
    # a returning group, no larger than the requests running beside it, is not split
    engine = chat.engine(max_running=32, prefill_batch_size=32, burst_prefill_groups=3)
    for i in range(10):
        engine.add(greedy(f"bg{i}", prompts[0], 40, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert all(engine.requests[f"bg{i}"].completion_tokens > 0 for i in range(10))
    assert groups(first_token_steps(engine, 10, prompts)) == [10]
    # the rest of a wave whose first request went in alone is larger than the running
    # batch: it is split as if it had started the batch
    engine = chat.engine(max_running=32, prefill_batch_size=32, burst_prefill_groups=3)
    engine.add(greedy("first", prompts[0], 40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.requests["first"].completion_tokens > 0
    assert groups(first_token_steps(engine, 13, prompts)) == [5, 4, 4]


def test_a_request_the_generator_would_refuse_is_refused_at_add(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Insertion is deferred to a group; a request mlx-lm's insert would reject (an empty
    prompt) must fail alone when added, not take its whole group down at the next step."""
    engine = chat.engine()
    engine.add(greedy("ok", prompts[0], 3, ignore_eos=True))
    with pytest.raises(ValueError, match="empty"):
        engine.add(greedy("empty", [], 3))
    assert [s.request.request_id for s in engine.staged] == ["ok"]
    assert "empty" not in engine.requests
    for _ in range(20):
        engine.step()
        if not engine.has_work:
            break
    assert not engine.has_work


def test_an_aborted_split_leaves_no_split_behind(chat: Loaded, prompts: list[list[int]]) -> None:
    """A burst being split whose remaining requests are all aborted: a burst that arrives
    later is split on its own count (12 in three groups of 4), not on the aborted one's."""
    engine = chat.engine(max_running=32, prefill_batch_size=32, burst_prefill_groups=3)
    for i in range(16):
        engine.add(greedy(f"a{i}", prompts[0], 40, ignore_eos=True))
    engine.step()  # the first 6 go in
    assert len(engine.staged) == 10
    engine.abort([f"a{i}" for i in range(6, 16)])
    assert not engine.staged
    later = first_token_steps(engine, 12, prompts)
    assert [n for _, n in sorted(collections.Counter(later.values()).items())] == [4, 4, 4]
