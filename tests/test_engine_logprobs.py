"""EngineCore in-process on real tiny MLX models: log probabilities of the sampled tokens and
the top k equal mlx-lm's, alone, in a mixed batch and joining one; prompt scoring, echo
(chunk by chunk, abortable) and echo with generation."""

from __future__ import annotations

import mlx.core as mx
import pytest

from shared.types import FinishReason, RequestOutput, SamplingParams, TokenLogprob, Usage
from tests.engine_fixtures import Loaded, drive, greedy, prepared, reference_greedy, token_ids
from worker.modelgen import IM_END_ID
from worker.preprocess import PreparedRequest

# Every engine test runs over each continuous batch (engine.batcher).
pytestmark = pytest.mark.usefixtures("batcher")

EOS = IM_END_ID
EOS_BIAS = {EOS: 100.0}


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
