"""EngineCore in-process on real tiny MLX models: aborting a request (queued, prefilling or
decoding) frees it and leaves the batch undisturbed; a request stops at max_tokens, EOS
(unless ignored or held back by min_tokens), stop token ids and stop strings, with the
usage and timings it reports."""

from __future__ import annotations

import pytest

from shared.types import FinishReason, Usage
from tests.engine_fixtures import Loaded, drive, finish, greedy, reference_greedy, text, token_ids
from worker.engine.request import RequestStatus
from worker.modelgen import IM_END_ID

# Every engine test runs over each continuous batch (engine.batcher).
pytestmark = pytest.mark.usefixtures("batcher")

EOS = IM_END_ID
EOS_BIAS = {EOS: 100.0}


# ---- abort --------------------------------------------------------------------------------


def assert_gone(engine, request_id: str, uid: int | None) -> None:  # type: ignore[no-untyped-def]
    assert request_id not in engine.requests
    assert request_id not in engine.scheduler
    if uid is not None:
        assert not engine.backend.holds(uid)


@pytest.mark.parametrize(
    ("steps_before", "decoding"),
    [(0, False), (1, False), (12, True)],
    ids=["queued", "prefilling", "decoding"],
)
def test_abort_frees_the_request(
    chat: Loaded, prompts: list[list[int]], steps_before: int, decoding: bool
) -> None:
    # a long prompt and tiny prefill steps: after 1 step it is still in prefill
    engine = chat.engine(prefill_step_size=4)
    long_prompt = prompts[2]
    assert len(long_prompt) > 8
    engine.add(greedy("victim", long_prompt, 50, ignore_eos=True))
    engine.add(greedy("other", prompts[1], 20, ignore_eos=True))  # still running at 12
    # waiting until a step starts them
    assert [r.request_id for r in engine.scheduler.queues[False]] == ["victim", "other"]
    assert engine.requests["victim"].status is RequestStatus.WAITING
    seen = []
    for _ in range(steps_before):
        seen += engine.step()
    uid = engine.requests["victim"].uid
    assert (uid is not None) is (steps_before > 0)
    if uid is not None:
        assert engine.backend.holds(uid)
    assert (engine.requests["victim"].completion_tokens > 0) is decoding
    aborted = engine.abort(["victim"])
    assert len(aborted) == 1
    assert aborted[0].request_id == "victim"
    assert aborted[0].finish_reason is FinishReason.ABORT
    produced = len(token_ids([o for o in seen if o.request_id == "victim"]))
    assert aborted[0].usage == Usage(prompt_tokens=len(long_prompt), completion_tokens=produced)
    assert_gone(engine, "victim", uid)
    assert engine.counts()[0] + engine.counts()[1] == 1  # only "other" is left
    assert engine.abort(["victim"]) == []  # idempotent
    assert engine.abort(["victim", "never-added"]) == []
    # the survivor was not disturbed by the removal
    survivor = token_ids([o for o in seen if o.request_id == "other"])
    while engine.has_work:
        step = engine.step()
        assert all(o.request_id == "other" for o in step)
        survivor += token_ids(step)
    assert survivor == reference_greedy(chat.model, prompts[1], 20)


def test_abort_then_step_emits_nothing_for_it(chat: Loaded, prompts: list[list[int]]) -> None:
    engine = chat.engine()
    engine.add(greedy("a", prompts[0], 40, ignore_eos=True))
    engine.add(greedy("b", prompts[1], 40, ignore_eos=True))
    engine.step()
    engine.step()
    uid_a = engine.requests["a"].uid
    engine.abort(["a"])
    for _ in range(3):
        assert {o.request_id for o in engine.step()} == {"b"}
    assert_gone(engine, "a", uid_a)
    assert engine.counts() == (1, 0)
    engine.abort(["b"])
    assert engine.counts() == (0, 0)
    assert not engine.has_work


# ---- stopping -----------------------------------------------------------------------------


def test_max_tokens_gives_length_and_usage(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[3]
    out = drive(chat.engine(), [greedy("a", prompt, 7, logit_bias={EOS: -100.0})])["a"]
    assert len(token_ids(out)) == 7
    assert finish(out) is FinishReason.LENGTH
    assert out[-1].usage == Usage(prompt_tokens=len(prompt), completion_tokens=7)
    # The first delta already says the prompt's size (Anthropic's message_start needs it).
    assert out[0].usage == Usage(prompt_tokens=len(prompt), completion_tokens=1)
    assert all(o.usage is None for o in out[1:-1])


def test_first_token_says_where_its_wait_went(chat: Loaded, prompts: list[list[int]]) -> None:
    engine = chat.engine(max_running=1)
    out = drive(engine, [greedy("a", prompts[2], 3), greedy("b", prompts[3], 3)])
    for deltas in out.values():
        timings = deltas[0].timings
        assert timings is not None and timings.prefill_s > 0
        assert all(o.timings is None for o in deltas[1:])
    # One place in the batch: "b" waited in the queue while "a" ran its three steps.
    a, b = out["a"][0].timings, out["b"][0].timings
    assert a is not None and b is not None
    assert b.queue_s > a.queue_s and b.queue_s >= a.prefill_s


def test_eos_stops_and_is_not_shown(chat: Loaded, prompts: list[list[int]]) -> None:
    out = drive(chat.engine(), [greedy("a", prompts[0], 10, logit_bias=EOS_BIAS)])["a"]
    assert token_ids(out) == [EOS]
    assert finish(out) is FinishReason.STOP
    assert text(out) == ""
    assert "<|im_end|>" not in text(out)
    assert out[-1].usage == Usage(prompt_tokens=len(prompts[0]), completion_tokens=1)


def test_ignore_eos_runs_to_max_tokens(chat: Loaded, prompts: list[list[int]]) -> None:
    out = drive(chat.engine(), [greedy("a", prompts[0], 6, logit_bias=EOS_BIAS, ignore_eos=True)])[
        "a"
    ]
    assert token_ids(out) == [EOS] * 6
    assert finish(out) is FinishReason.LENGTH
    assert out[-1].usage == Usage(prompt_tokens=len(prompts[0]), completion_tokens=6)


def test_min_tokens_holds_eos_back(chat: Loaded, prompts: list[list[int]]) -> None:
    out = drive(chat.engine(), [greedy("a", prompts[0], 20, logit_bias=EOS_BIAS, min_tokens=5)])
    ids = token_ids(out["a"])
    assert len(ids) == 6 and EOS not in ids[:5] and ids[5] == EOS  # 5 tokens, then EOS
    assert finish(out["a"]) is FinishReason.STOP
    assert out["a"][-1].usage == Usage(prompt_tokens=len(prompts[0]), completion_tokens=6)
    assert "<|im_end|>" not in text(out["a"])


def test_stop_token_ids(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    reference = reference_greedy(chat.model, prompt, 20)
    stop_id = reference[3]
    first = reference.index(stop_id)
    out = drive(chat.engine(), [greedy("a", prompt, 20, stop_token_ids=[stop_id])])["a"]
    assert token_ids(out) == reference[: first + 1]
    assert finish(out) is FinishReason.STOP
    shown = chat.tokenizer.decode(reference[:first])
    assert text(out) == shown  # the stop token's text is not shown
    assert out[-1].usage is not None and out[-1].usage.completion_tokens == first + 1


def test_stop_string_finishes_and_leaves_the_batch(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    full = text(drive(chat.engine(), [greedy("a", prompt, 12, ignore_eos=True)])["a"])
    stop = full[6:9]
    engine = chat.engine()
    engine.add(greedy("a", prompt, 12, ignore_eos=True, stop=[stop]))
    engine.add(greedy("b", prompts[1], 30, ignore_eos=True))
    uid = engine.requests["a"].uid
    out = []
    while "a" in engine.requests:
        out += [o for o in engine.step() if o.request_id == "a"]
    assert finish(out) is FinishReason.STOP
    assert text(out) == full[: full.index(stop)]
    assert len(token_ids(out)) < 12
    assert_gone(engine, "a", uid)
    assert {o.request_id for o in engine.step()} == {"b"}


def test_held_back_partial_stop_is_released_at_length(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    prompt = prompts[0]
    full = text(drive(chat.engine(), [greedy("a", prompt, 5, ignore_eos=True)])["a"])
    out = drive(chat.engine(), [greedy("a", prompt, 5, ignore_eos=True, stop=[full[-2:] + "\0"])])
    assert text(out["a"]) == full
    assert finish(out["a"]) is FinishReason.LENGTH


def test_include_stop_str_in_output(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    full = text(drive(chat.engine(), [greedy("a", prompt, 12, ignore_eos=True)])["a"])
    stop = full[6:9]
    request = greedy("a", prompt, 12, stop=[stop], include_stop_str_in_output=True)
    out = drive(chat.engine(), [request])["a"]
    assert text(out) == full[: full.index(stop) + len(stop)]
