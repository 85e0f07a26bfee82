"""Continuations (issue 24): a request resumed from the tokens an earlier worker had made
goes on exactly as if it had never stopped. Each test runs a request whole, then again as a
continuation from k of its tokens (as the gateway resubmits one after its worker died), and
checks that the text of the first k deltas plus the continuation's is the whole run's, with
the same usage, on both continuous batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from shared.config import EngineOptions
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    FinishReason,
    Message,
    Reasoning,
    RequestKind,
    RequestOutput,
    SamplingParams,
)
from tests.engine_fixtures import Loaded, drive, greedy, load
from worker.preprocess import PreparedRequest, PreprocessError, Preprocessor


@pytest.fixture(scope="module")
def hermes(hermes_model_dir: Path) -> Loaded:
    return load(hermes_model_dir)


def prepare(
    loaded: Loaded, rid: str, request: CanonicalRequest, **sampling: Any
) -> PreparedRequest:
    preprocess = Preprocessor(loaded.tokenizer, EngineOptions(), max_context=4096)
    return preprocess(Add(rid, RequestKind.CHAT, request, SamplingParams(**sampling)))


def whole_and_resumed(
    loaded: Loaded, batcher: str, request: CanonicalRequest, k: int, **sampling: Any
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    engine = loaded.engine(batcher=batcher, prefix_cache=False)
    whole = drive(engine, [prepare(loaded, "w", request, **sampling)])["w"]
    made = [t for d in whole for t in d.token_ids]
    assert len(made) > k, "the run must be longer than the resume point"
    # what the gateway holds after the first k tokens' deltas: their token ids
    held = [t for d in whole[:k] for t in d.token_ids]
    assert len(held) == k
    resumed = msgspec.structs.replace(request, resumed=held)
    again = drive(engine, [prepare(loaded, "r", resumed, **sampling)])["r"]
    return whole, whole[:k] + again


def joined(deltas: list[RequestOutput], field: str = "text") -> str:
    return "".join(getattr(d, field) for d in deltas)


def chat(text: str = "Tell me about the sea", **fields: Any) -> CanonicalRequest:
    return CanonicalRequest(messages=[Message("user", text)], **fields)


OFF = {"enable_thinking": False}


@pytest.mark.parametrize("k", [1, 5])
def test_a_greedy_continuation_gives_the_undisturbed_text_and_usage(
    hermes: Loaded, batcher: str, k: int
) -> None:
    whole, resumed = whole_and_resumed(
        hermes, batcher, chat(chat_template_kwargs=OFF), k, max_tokens=24, temperature=0.0,
        ignore_eos=True,
    )  # fmt: skip
    assert joined(resumed) == joined(whole)
    assert resumed[-1].finish_reason is whole[-1].finish_reason is FinishReason.LENGTH
    assert resumed[-1].usage == whole[-1].usage  # each token counted once, the prompt too


def test_a_seeded_continuation_draws_what_the_whole_run_drew(hermes: Loaded, batcher: str) -> None:
    whole, resumed = whole_and_resumed(
        hermes, batcher, chat(chat_template_kwargs=OFF), 6, max_tokens=20, temperature=1.0,
        seed=1234, ignore_eos=True,
    )  # fmt: skip
    assert [t for d in resumed for t in d.token_ids] == [t for d in whole for t in d.token_ids]


def test_a_stop_string_across_the_resume_point_still_ends_it(hermes: Loaded, batcher: str) -> None:
    sampling: dict[str, Any] = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    engine = hermes.engine(batcher=batcher, prefix_cache=False)
    free = drive(engine, [prepare(hermes, "f", chat(chat_template_kwargs=OFF), **sampling)])["f"]
    tokens = [t for d in free for t in d.token_ids]
    pieces = [hermes.tokenizer.decode([t]) for t in tokens]
    # a stop string made of the end of token 5's text and the start of token 6's
    i = next(i for i in range(4, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip())
    stop = pieces[i][-1:] + pieces[i + 1][:1]
    request = chat(chat_template_kwargs=OFF)
    whole, resumed = whole_and_resumed(hermes, batcher, request, i + 1, stop=[stop], **sampling)
    assert whole[-1].finish_reason is FinishReason.STOP and whole[-1].stop == stop
    assert joined(resumed) == joined(whole) and stop not in joined(resumed)
    assert resumed[-1].finish_reason is FinishReason.STOP


def test_a_continuation_inside_its_thinking_keeps_thinking_apart(hermes: Loaded) -> None:
    request = chat(reasoning=Reasoning(enabled=True))
    whole, resumed = whole_and_resumed(
        hermes, "rows", request, 3, max_tokens=30, temperature=0.0, ignore_eos=True
    )
    assert joined(whole, "reasoning") and joined(resumed, "reasoning") == joined(whole, "reasoning")
    assert joined(resumed) == joined(whole)
    assert resumed[-1].usage == whole[-1].usage


def test_resumed_tokens_the_request_cannot_hold_are_refused(hermes: Loaded) -> None:
    with pytest.raises(PreprocessError) as caught:
        prepare(hermes, "x", chat(resumed=[1, 2, 3]), max_tokens=3)
    assert caught.value.error.param == "resumed"
    with pytest.raises(PreprocessError) as caught:
        prepare(hermes, "y", chat(resumed=[10**9]), max_tokens=8)
    assert caught.value.error.param == "resumed"


def test_a_continuation_shares_its_long_prompt_once_prefilled(hermes: Loaded, batcher: str) -> None:
    """Its prompt's KV goes to the prefix cache at its first token here, as a new request's
    does: a request sharing the long prefix waits for that prefill, not for the
    continuation's whole output (its count of tokens starts at those it resumed)."""
    base = [(i * 7) % 400 + 5 for i in range(300)]
    engine = hermes.engine(batcher=batcher)
    resumed = greedy("r", [*base, 11, 12, 13, 14], 60, ignore_eos=True)
    resumed.resumed = 4  # (its prompt's last 4 tokens were an earlier worker's output)
    engine.add(resumed)
    engine.add(greedy("w", [*base, 99, 98], 5, ignore_eos=True))
    first: dict[str, int] = {}
    for step in range(300):
        for output in engine.step():
            if output.token_ids:
                first.setdefault(output.request_id, step)
        if not engine.has_work:
            break
    assert first["w"] <= first["r"] + 4, first  # not after r's 56 more tokens
    assert engine.scheduler.kv_tokens() == 0
