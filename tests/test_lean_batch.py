"""The lean decode step (worker/batching.py): the running batch skips the vocabulary
log-softmax while no request reads it, and gives the same tokens and logprobs as mlx-lm's
own step (real tiny MLX model)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator

from shared.types import RequestOutput
from tests.engine_fixtures import Loaded, greedy, prepared, token_ids
from worker import batching
from worker.batching import LeanGenerationBatch
from worker.engine import EngineCore
from worker.preprocess import PreparedRequest


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, for each decode step of a running batch, whether it normalized."""
    seen: list[bool] = []
    upstream = LeanGenerationBatch._step

    def step(self: LeanGenerationBatch) -> Any:
        seen.append(self.normalize)
        return upstream(self)

    monkeypatch.setattr(LeanGenerationBatch, "_step", step)
    return seen


def run(
    engine: EngineCore, schedule: dict[int, list[PreparedRequest]], max_steps: int = 400
) -> dict[str, list[RequestOutput]]:
    """Add each request at its step; step until idle."""
    outputs: dict[str, list[RequestOutput]] = {}
    for step in range(max_steps):
        for request in schedule.get(step, []):
            engine.add(request)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        if step > max(schedule) and not engine.has_work:
            return outputs
    raise AssertionError(f"not idle after {max_steps} steps")


def upstream_engine(chat: Loaded) -> EngineCore:
    engine = chat.engine(max_running=16, prefill_batch_size=8)
    engine._lean = None  # never switched: the batch keeps normalize = True, mlx-lm's step
    return engine


def staggered(prompts: list[list[int]], **sampling: Any) -> dict[int, list[PreparedRequest]]:
    """Requests that join and leave a running batch at different steps."""
    return {
        0: [greedy(f"a{i}", prompts[i], 12 + i, ignore_eos=True) for i in range(3)],
        4: [prepared("s", prompts[3], 10, temperature=0.8, seed=7, ignore_eos=True, **sampling)],
        6: [greedy(f"b{i}", prompts[4 + i], 9, ignore_eos=True) for i in range(3)],
        15: [greedy("c", prompts[8], 6, ignore_eos=True)],
    }


def test_same_tokens_as_mlx_lms_step(
    chat: Loaded, prompts: list[list[int]], steps: list[bool]
) -> None:
    """Greedy and seeded sampling (top-k, min-p), joining and leaving mid-batch: token for
    token what mlx-lm's own step gives, and the batch did run unnormalized."""
    schedule = staggered(prompts, top_k=20, min_p=0.05)
    lean = run(chat.engine(max_running=16, prefill_batch_size=8), schedule)
    assert steps and not any(steps), "every decode step skipped the log-softmax"
    steps.clear()
    reference = run(upstream_engine(chat), schedule)
    assert steps and all(steps)  # the upstream engine: mlx-lm's step throughout
    assert lean.keys() == reference.keys()
    for request_id, deltas in reference.items():
        assert token_ids(lean[request_id]) == token_ids(deltas), request_id
        assert len(token_ids(deltas)) > 0


def test_logprobs_joining_a_lean_batch_are_normalized(
    chat: Loaded, prompts: list[list[int]], steps: list[bool]
) -> None:
    """A request that wants logprobs turns normalization on for as long as it is in the
    engine, and gets the same values as under mlx-lm's own step; after it leaves, the batch
    runs lean again."""
    schedule = {
        0: [greedy(f"a{i}", prompts[i], 30, ignore_eos=True) for i in range(3)],
        5: [greedy("lp", prompts[5], 8, ignore_eos=True, logprobs=True, top_logprobs=3)],
    }
    lean = run(chat.engine(max_running=16, prefill_batch_size=8), schedule)
    assert steps[:3] == [False] * 3  # greedy only (steps 2-4; 0-1 prefill): lean
    assert True in steps and steps[-1] is False  # normalized while lp ran, lean after
    reference = run(upstream_engine(chat), schedule)
    got = [e for o in lean["lp"] for e in o.logprobs]
    want = [e for o in reference["lp"] for e in o.logprobs]
    assert len(got) == len(want) == 8
    for g, w in zip(got, want, strict=True):
        assert g.token_id == w.token_id
        assert g.logprob is not None and w.logprob is not None
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert g.logprob <= 0
        assert [t.token_id for t in g.top] == [t.token_id for t in w.top]
        assert sum(math.exp(t.logprob) for t in g.top) <= 1 + 1e-4
    for request_id in ("a0", "a1", "a2"):
        assert token_ids(lean[request_id]) == token_ids(reference[request_id])


def test_top_p_keeps_the_step_normalized(
    chat: Loaded, prompts: list[list[int]], steps: list[bool]
) -> None:
    """top-p exponentiates its input: with a top-p request in the engine every step
    normalizes, and its tokens are mlx-lm's."""
    request = prepared("p", prompts[2], 10, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True)
    lean = run(chat.engine(), {0: [request]})
    assert steps and all(steps)
    reference = run(upstream_engine(chat), {0: [request]})
    assert token_ids(lean["p"]) == token_ids(reference["p"])


def test_an_unknown_generation_batch_keeps_mlx_lms_step(
    chat: Loaded, caplog: pytest.LogCaptureFixture
) -> None:
    """If mlx-lm's running batch is not the GenerationBatch this was written against, the
    generator keeps its own step, with a warning."""
    generator = BatchGenerator(chat.model)
    generator._generation_batch = object()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="worker.batching"):
        assert batching.attach(generator) is None
    assert "keeps its own step" in caplog.text
    fresh = BatchGenerator(chat.model)
    assert isinstance(batching.attach(fresh), LeanGenerationBatch)
