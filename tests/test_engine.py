"""EngineCore in-process on real tiny MLX models: batching, aborts, stopping, sampling, UTF-8."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm import stream_generate

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    FinishReason,
    Message,
    RequestKind,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from tests.engine_fixtures import (
    Loaded,
    drive,
    finish,
    greedy,
    load,
    prepared,
    reference_greedy,
    text,
    token_ids,
)
from worker.engine.request import RequestStatus
from worker.modelgen import IM_END_ID, TinyModelSpec, build_tiny_model, byte_token_id
from worker.preprocess import PreparedRequest, Preprocessor

# Every engine test runs over each continuous batch (engine.batcher).
pytestmark = pytest.mark.usefixtures("batcher")

EOS = IM_END_ID
EOS_BIAS = {EOS: 100.0}
# A byte-level vocabulary: bigram chains over raw byte tokens.
BYTES_SPEC = TinyModelSpec(hidden_size=64, num_layers=1, vocab_size=400, byte_fallback=True)


# ---- greedy equality with mlx-lm ------------------------------------------------------------


def test_greedy_alone_matches_mlx_lm(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    out = drive(chat.engine(), [greedy("a", prompt, 24, ignore_eos=True)])["a"]
    assert token_ids(out) == reference_greedy(chat.model, prompt, 24)
    assert [len(o.token_ids) for o in out] == [1] * 24  # one token per step, no lag
    assert finish(out) is FinishReason.LENGTH


def test_greedy_deltas_match_stream_generate(chat: Loaded, prompts: list[list[int]]) -> None:
    """Same tokens and per-step text as mlx-lm's stream_generate (EOS honoured), except that
    the first segment keeps the leading space mlx-lm trims (ours equals tokenizer.decode)."""
    for i, prompt in enumerate(prompts[:4]):
        ours = drive(chat.engine(), [greedy("a", prompt, 20)])["a"]
        theirs = list(stream_generate(chat.model, chat.tokenizer, prompt, max_tokens=20))
        assert [o.token_ids for o in ours] == [[r.token] for r in theirs], i
        assert "".join(o.text for o in ours).lstrip() == "".join(r.text for r in theirs), i
        assert [o.text for o in ours][1:] == [r.text for r in theirs][1:], i
        assert finish(ours) == theirs[-1].finish_reason


@pytest.mark.parametrize(
    "options",
    [
        {"max_running": 16},
        {"max_running": 16, "prefill_batch_size": 3, "prefill_step_size": 5},
    ],
    ids=["default-prefill", "chunked-prefill"],
)
def test_greedy_in_a_batch_of_nine_matches_mlx_lm(
    chat: Loaded, prompts: list[list[int]], options: dict[str, int]
) -> None:
    lengths = [24, 10, 17, 24, 5, 20, 12, 24, 8]
    requests = [
        greedy(f"r{i}", p, n, ignore_eos=True)
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    outputs = drive(chat.engine(**options), requests)
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        out = outputs[f"r{i}"]
        assert token_ids(out) == reference_greedy(chat.model, prompt, n), f"r{i}"
        assert out[-1].usage == Usage(prompt_tokens=len(prompt), completion_tokens=n)


def test_late_joiner_matches_mlx_lm(chat: Loaded, prompts: list[list[int]]) -> None:
    """A request added while others are decoding gets the same greedy tokens."""
    engine = chat.engine()
    for i in range(4):
        engine.add(greedy(f"early{i}", prompts[i + 1], 30, ignore_eos=True))
    early: dict[str, list[int]] = {}
    for _ in range(6):
        for o in engine.step():
            early.setdefault(o.request_id, []).extend(o.token_ids)
    late = drive(engine, [greedy("late", prompts[0], 16, ignore_eos=True)])["late"]
    assert token_ids(late) == reference_greedy(chat.model, prompts[0], 16)
    assert not engine.has_work


def test_text_is_the_decoded_tokens(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    out = drive(chat.engine(), [greedy("a", prompt, 12, ignore_eos=True)])["a"]
    assert chat.tokenizer.decode(token_ids(out)).startswith(" ")  # this prompt's continuation
    assert text(out) == chat.tokenizer.decode(token_ids(out))


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
    engine.add(greedy("other", prompts[1], 12, ignore_eos=True))
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
    assert survivor == reference_greedy(chat.model, prompts[1], 12)


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


# ---- sampling -----------------------------------------------------------------------------


def test_seed_reproducible(chat: Loaded, prompts: list[list[int]]) -> None:
    def sample(seed: int, batch_mates: int = 0) -> list[int]:
        requests = [prepared("s", prompts[0], 16, temperature=1.0, seed=seed, ignore_eos=True)]
        requests += [greedy(f"g{i}", prompts[i + 1], 16) for i in range(batch_mates)]
        return token_ids(drive(chat.engine(), requests)["s"])

    first = sample(1)
    assert sample(1) == first
    assert sample(1, batch_mates=3) == first  # independent of the batch around it
    assert sample(2) != first
    assert sample(3) != first
    assert first != reference_greedy(chat.model, prompts[0], 16)  # it did sample


def test_unseeded_sampling_varies(chat: Loaded, prompts: list[list[int]]) -> None:
    runs = {
        tuple(
            token_ids(drive(chat.engine(), [prepared("s", prompts[0], 16, ignore_eos=True)])["s"])
        )
        for _ in range(3)
    }
    assert len(runs) > 1


def test_logit_bias_forces_a_token(chat: Loaded, prompts: list[list[int]]) -> None:
    forced = chat.tokenizer.encode("real")[0]
    out = drive(chat.engine(), [greedy("a", prompts[1], 8, logit_bias={forced: 100.0})])["a"]
    assert token_ids(out) == [forced] * 8
    # and a forbidding bias: the greedy first token never appears
    first = reference_greedy(chat.model, prompts[1], 1)[0]
    out = drive(chat.engine(), [greedy("b", prompts[1], 8, logit_bias={first: -100.0})])["b"]
    assert first not in token_ids(out)


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 1.5}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}],
    ids=lambda p: next(iter(p)),
)
def test_penalties_change_greedy_output(
    chat: Loaded, prompts: list[list[int]], penalty: dict[str, float]
) -> None:
    # Strongly repeating: a bias makes a token of the prompt the greedy choice by one logit,
    # so without a penalty the model repeats it; a penalty over one logit must flip it.
    prompt = prompts[0]
    logits = chat.model(mx.array(prompt)[None])[0, -1]
    top = int(mx.argmax(logits).item())
    target = next(t for t in prompt if t not in (top, EOS))
    assert abs(logits[top].item()) > 4  # so a 1.5 repetition penalty moves it by > 1
    bias = {target: logits[top].item() - logits[target].item() + 1.0}
    plain = drive(chat.engine(), [greedy("p", prompt, 8, ignore_eos=True, logit_bias=bias)])
    assert token_ids(plain["p"])[0] == target
    neutral = {k: 1.0 if k == "repetition_penalty" else 0.0 for k in penalty}
    same = drive(
        chat.engine(), [greedy("n", prompt, 8, ignore_eos=True, logit_bias=bias, **neutral)]
    )
    assert token_ids(same["n"]) == token_ids(plain["p"])
    out = drive(
        chat.engine(), [greedy("q", prompt, 8, ignore_eos=True, logit_bias=bias, **penalty)]
    )
    assert token_ids(out["q"])[0] != target
    assert token_ids(out["q"]) != token_ids(plain["p"])


# ---- log probabilities and prompt scoring -------------------------------------------------

LOGPROB_TOL = 1e-3


def reference_rows(model: object, tokens: list[int]) -> mx.array:
    """mlx-lm's log-softmax over one forward pass of `tokens`: row i scores token i + 1."""
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)  # type: ignore[operator]
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def logprob_entries(deltas: list[RequestOutput]) -> list[TokenLogprob]:
    return [e for o in deltas for e in o.logprobs]


def assert_top_sorted(entry: TokenLogprob, k: int) -> None:
    values = [t.logprob for t in entry.top]
    assert len(values) == k
    assert values == sorted(values, reverse=True)


def test_greedy_logprobs_match_mlx_lm(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    out = drive(chat.engine(), [greedy("a", prompt, 12, ignore_eos=True, logprobs=True)])["a"]
    generated = token_ids(out)
    entries = logprob_entries(out)
    assert [e.token_id for e in entries] == generated  # one per token, in order
    rows = reference_rows(chat.model, prompt + generated[:-1])[len(prompt) - 1 :]
    for i, (entry, token) in enumerate(zip(entries, generated, strict=True)):
        assert entry.token == chat.tokenizer.decode([token])
        assert entry.logprob == pytest.approx(rows[i, token].item(), abs=LOGPROB_TOL)
        assert entry.top == []  # top_logprobs 0: the sampled token only
    assert all(e.logprob is not None and e.logprob <= 0 for e in entries)


def test_top_logprobs_are_the_k_best_sorted(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[1]
    request = greedy("a", prompt, 6, ignore_eos=True, logprobs=True, top_logprobs=5)
    out = drive(chat.engine(), [request])["a"]
    generated = token_ids(out)
    rows = reference_rows(chat.model, prompt + generated[:-1])[len(prompt) - 1 :]
    for i, entry in enumerate(logprob_entries(out)):
        assert_top_sorted(entry, 5)
        assert entry.top[0].token_id == entry.token_id  # greedy: the sampled token is the best
        assert entry.top[0].logprob == entry.logprob
        best = mx.argsort(-rows[i])[:5].tolist()
        assert [t.token_id for t in entry.top] == best
        for alt in entry.top:
            assert alt.logprob == pytest.approx(rows[i, alt.token_id].item(), abs=LOGPROB_TOL)
            assert alt.token == chat.tokenizer.decode([alt.token_id])


def test_logprobs_in_a_mixed_batch(chat: Loaded, prompts: list[list[int]]) -> None:
    """Requests that asked for logprobs get theirs (each its own top k) beside ones that did
    not; batching changes nothing beyond float noise."""
    alone = {
        k: logprob_entries(
            drive(chat.engine(), [greedy("a", prompts[k], 8, ignore_eos=True, logprobs=True)])["a"]
        )
        for k in (0, 2)
    }
    engine = chat.engine()
    requests = [
        greedy("lp0", prompts[0], 8, ignore_eos=True, logprobs=True, top_logprobs=3),
        greedy("plain", prompts[1], 8, ignore_eos=True),
        greedy("lp2", prompts[2], 8, ignore_eos=True, logprobs=True),
    ]
    out = drive(engine, requests)
    assert engine.logprob_requests == 0  # nothing left asking: step() skips the work again
    assert all(o.logprobs == [] for o in out["plain"])
    for name, k, top in (("lp0", 0, 3), ("lp2", 2, 0)):
        entries = logprob_entries(out[name])
        assert [e.token_id for e in entries] == [e.token_id for e in alone[k]]
        for got, want in zip(entries, alone[k], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=LOGPROB_TOL)
            assert len(got.top) == top


def test_logprobs_for_a_request_joining_a_batch_that_asked_for_none(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Steps without a logprobs request skip the per-row distributions; one that joins a
    running batch mid-stream still has an entry for every token, the same as alone."""
    alone = logprob_entries(
        drive(chat.engine(), [greedy("a", prompts[2], 6, ignore_eos=True, logprobs=True)])["a"]
    )
    engine = chat.engine()
    engine.add(greedy("plain", prompts[1], 20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    out = drive(engine, [greedy("lp", prompts[2], 6, ignore_eos=True, logprobs=True)])
    entries = logprob_entries(out["lp"])
    assert [e.token_id for e in entries] == [e.token_id for e in alone]
    for got, want in zip(entries, alone, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=LOGPROB_TOL)


def test_logprobs_are_before_temperature_and_after_bias(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    """Sampled tokens' logprobs are the distribution the processors made, before temperature
    (as mlx-lm reports them); a token forced by logit_bias is nearly certain."""
    prompt = prompts[3]
    request = prepared(
        "s", prompt, 8, temperature=0.7, seed=3, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    out = drive(chat.engine(), [request])["s"]
    generated = token_ids(out)
    rows = reference_rows(chat.model, prompt + generated[:-1])[len(prompt) - 1 :]
    for i, entry in enumerate(logprob_entries(out)):
        assert entry.logprob == pytest.approx(rows[i, entry.token_id].item(), abs=LOGPROB_TOL)
        assert_top_sorted(entry, 2)
    forced = chat.tokenizer.encode("real")[0]
    biased = greedy("b", prompt, 3, logit_bias={forced: 100.0}, logprobs=True)
    entries = logprob_entries(drive(chat.engine(), [biased])["b"])
    assert [e.token_id for e in entries] == [forced] * 3
    assert all(e.logprob == pytest.approx(0.0, abs=LOGPROB_TOL) for e in entries)


def test_eos_logprob_is_not_shown(chat: Loaded, prompts: list[list[int]]) -> None:
    request = greedy("a", prompts[0], 10, logit_bias=EOS_BIAS, logprobs=True)
    out = drive(chat.engine(), [request])["a"]
    assert token_ids(out) == [EOS]
    assert logprob_entries(out) == []


@pytest.mark.parametrize("step_size", [3, 512], ids=["chunked", "one-pass"])
def test_score_matches_mlx_lm(chat: Loaded, prompts: list[list[int]], step_size: int) -> None:
    prompt = prompts[2]
    entries = chat.engine(prefill_step_size=step_size).score(prompt, 2)
    assert [e.token_id for e in entries] == prompt
    assert entries[0].logprob is None and entries[0].top == []  # nothing predicts it
    rows = reference_rows(chat.model, prompt)
    for i, entry in enumerate(entries[1:]):
        assert entry.logprob == pytest.approx(rows[i, prompt[i + 1]].item(), abs=LOGPROB_TOL)
        assert_top_sorted(entry, 2)
        assert entry.top[0].token_id == mx.argmax(rows[i]).item()
    one = chat.engine().score(prompt[:1], 3)
    assert [(e.token_id, e.logprob, e.top) for e in one] == [(prompt[0], None, [])]


def test_echo_scoring_only_runs_chunk_by_chunk(chat: Loaded, prompts: list[list[int]]) -> None:
    """echo + logprobs + max_tokens 0 (lm-evaluation-harness): the prompt is scored one
    prefill-sized chunk per step (running streams keep moving meanwhile), then one terminal
    output with the prompt's text and logprobs; nothing enters the batch."""
    prompt = prompts[0]
    engine = chat.engine(prefill_step_size=4)
    engine.add(greedy("r", prompts[1], 200, ignore_eos=True))
    while not any(o.request_id == "r" and o.token_ids for o in engine.step()):
        pass  # its prompt is prefilled: it now gets a token per step
    sampling = SamplingParams(echo=True, logprobs=True, top_logprobs=1)
    assert engine.add(PreparedRequest("e", prompt, 0, sampling)) is None
    assert engine.counts()[1] >= 1  # waiting while it is scored
    chunks = -(-(len(prompt) - 1) // 4)
    outputs: list[RequestOutput] = []
    for _ in range(chunks):
        step = engine.step()
        assert any(o.request_id == "r" for o in step)  # the stream got a token every step
        outputs += [o for o in step if o.request_id == "e"]
    [output] = outputs
    assert output.finish_reason is FinishReason.LENGTH
    assert output.usage == Usage(prompt_tokens=len(prompt))
    assert output.token_ids == [] and output.text == "" and output.logprobs == []
    assert output.prompt_text == chat.tokenizer.decode(prompt)
    want = engine.score(prompt, 1)
    assert [(e.token_id, e.logprob) for e in output.prompt_logprobs] == [
        (e.token_id, e.logprob) for e in want
    ]
    assert "e" not in engine.request_ids()
    engine.abort(["r"])
    assert not engine.has_work
    # echo without logprobs: the text only, answered at add
    done = engine.add(PreparedRequest("t", prompt, 0, SamplingParams(echo=True)))
    assert done is not None and done.prompt_text == chat.tokenizer.decode(prompt)
    assert done.prompt_logprobs == []


def test_a_request_being_scored_can_be_aborted(chat: Loaded, prompts: list[list[int]]) -> None:
    engine = chat.engine(prefill_step_size=2)
    sampling = SamplingParams(echo=True, logprobs=True, max_tokens=3)
    engine.add(PreparedRequest("e", prompts[0], 3, sampling))
    engine.step()
    [aborted] = engine.abort(["e"])
    assert aborted.finish_reason is FinishReason.ABORT
    assert not engine.has_work and engine.abort(["e"]) == []


def test_echo_with_generation_sends_the_prompt_once(chat: Loaded, prompts: list[list[int]]) -> None:
    prompt = prompts[1]
    request = greedy("e", prompt, 4, ignore_eos=True, echo=True, logprobs=True)
    out = drive(chat.engine(), [request])["e"]
    assert out[0].prompt_text == chat.tokenizer.decode(prompt)
    assert [e.token_id for e in out[0].prompt_logprobs] == prompt
    assert all(o.prompt_text is None and o.prompt_logprobs == [] for o in out[1:])
    assert token_ids(out) == reference_greedy(chat.model, prompt, 4)  # echo changes nothing
    assert len(logprob_entries(out)) == 4


def test_prepared_request_runs(chat: Loaded) -> None:
    preprocess = Preprocessor(chat.tokenizer, EngineOptions(default_max_tokens=8), max_context=64)
    request = CanonicalRequest(messages=[Message("user", "Tell me about the sea.")])
    sampling = SamplingParams(temperature=0.0, max_tokens=6)
    ready = preprocess(Add("r1", RequestKind.CHAT, request, sampling))
    assert isinstance(ready, PreparedRequest)
    out = drive(chat.engine(), [ready])["r1"]
    reference = reference_greedy(chat.model, ready.prompt, 6)
    stop = reference.index(EOS) + 1 if EOS in reference else 6
    assert token_ids(out) == reference[:stop]


# ---- UTF-8 --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def utf8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Loaded, list[int], dict[str, int]]:
    root = tmp_path_factory.mktemp("bytes")
    plain = build_tiny_model(root / "plain", BYTES_SPEC)
    ids = {
        name: byte_token_id(plain, value)
        for name, value in (("x", ord("x")), ("a", ord("a")), ("b", ord("b")), ("c3", 0xC3))
    }
    ids["a9"] = byte_token_id(plain, 0xA9)
    # prompt ends in "a" -> 0xC3 -> 0xA9 -> "b" -> EOS
    chain = {ids["a"]: ids["c3"], ids["c3"]: ids["a9"], ids["a9"]: ids["b"], ids["b"]: EOS}
    path = build_tiny_model(root / "chain", dataclasses.replace(BYTES_SPEC, bigram=chain))
    assert byte_token_id(path, 0xC3) == ids["c3"]  # same tokenizer
    return load(path), [ids["x"], ids["a"]], ids


def test_utf8_split_across_byte_tokens(utf8: tuple[Loaded, list[int], dict[str, int]]) -> None:
    loaded, prompt, ids = utf8
    out = drive(loaded.engine(), [greedy("u", prompt, 10)])["u"]
    assert token_ids(out) == [ids["c3"], ids["a9"], ids["b"], EOS]
    deltas = [o.text for o in out]
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[0] == ""  # 0xC3 alone is no character yet
    assert "\u00e9" in deltas[1]
    assert text(out) == "\u00e9b"
    assert finish(out) is FinishReason.STOP


def test_utf8_stop_string_after_a_split_character(
    utf8: tuple[Loaded, list[int], dict[str, int]],
) -> None:
    loaded, prompt, _ = utf8
    out = drive(loaded.engine(), [greedy("u", prompt, 10, stop=["b"])])["u"]
    assert text(out) == "\u00e9"
    assert finish(out) is FinishReason.STOP
    out = drive(loaded.engine(), [greedy("u", prompt, 10, stop=["\u00e9"])])["u"]
    assert text(out) == ""
    assert finish(out) is FinishReason.STOP


def test_utf8_in_a_batch(utf8: tuple[Loaded, list[int], dict[str, int]]) -> None:
    loaded, prompt, ids = utf8
    requests = [greedy(f"u{i}", [ids["x"]] * i + prompt, 10) for i in range(5)]
    outputs = drive(loaded.engine(), requests)
    for deltas in outputs.values():
        assert [o.text for o in deltas] == ["", "\u00e9", "b", ""]
