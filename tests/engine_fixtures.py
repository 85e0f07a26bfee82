"""Helpers for in-process EngineCore tests: load a tiny model, drive the engine, references."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from shared.config import EngineOptions
from shared.types import FinishReason, RequestOutput, SamplingParams
from worker.backends.mlx_lm import make_backend
from worker.engine.core import EngineCore
from worker.preprocess import PreparedRequest


@dataclass(frozen=True, slots=True)
class Loaded:
    path: Path
    model: Any
    tokenizer: Any

    def engine(self, kv_budget_bytes: int | None = None, **options: Any) -> EngineCore:
        opts = EngineOptions(**{**ENGINE_DEFAULTS, **options})
        return EngineCore(make_backend(self.model, self.tokenizer, opts), opts, kv_budget_bytes)


# Options every engine() gets unless a test names them (the `batcher` fixture of the engine
# tests runs them over each continuous batch).
ENGINE_DEFAULTS: dict[str, Any] = {}


# Prompts of several shapes (one of a single token, one long) for engine tests.
PROMPT_TEXTS = [
    "The gateway starts one worker",
    "Hello",
    "A request arrives, the prompt is tokenized, and tokens stream back as they are made.",
    "def add(a, b):\n\treturn a + b",
    "Prices: $3.99, 15% off",
    "Lists work too:\n- first item",
    "On Monday, 3 June 2024 at 09:45, the queue held 17 requests",
    "x",
    "Email: team@example.com; path: /var/cache/models/demo-llama",
]


def load(path: Path) -> Loaded:
    result = mlx_load(str(path))
    return Loaded(path, result[0], result[1])


def prepared(
    request_id: str, prompt: list[int], max_tokens: int, **sampling: Any
) -> PreparedRequest:
    return PreparedRequest(request_id, list(prompt), max_tokens, SamplingParams(**sampling))


def greedy(request_id: str, prompt: list[int], max_tokens: int, **sampling: Any) -> PreparedRequest:
    return prepared(request_id, prompt, max_tokens, temperature=0.0, **sampling)


def drive(
    engine: EngineCore, requests: list[PreparedRequest], max_steps: int = 2000
) -> dict[str, list[RequestOutput]]:
    """Add the requests, step until the engine is idle; each request's deltas in order
    (requests added earlier are included with the deltas this call saw)."""
    for request in requests:
        engine.add(request)
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not engine.has_work:
            break
        if not engine.can_step:  # grammars compiling: the worker waits for their wake
            compiling = [r.guide.compiling for r in requests if r.guide and r.guide.compiling]
            assert compiling, "the engine has work but can take no step"
            concurrent.futures.wait(compiling, timeout=60)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        engine.settle()  # as the worker does once a step's outputs are out
    else:
        raise AssertionError(f"the engine did not finish within {max_steps} steps")
    for request_id, deltas in outputs.items():
        finals = [o for o in deltas if o.finish_reason is not None]
        assert len(finals) == 1 and deltas[-1] is finals[0], f"{request_id}: one terminal, last"
    return outputs


def token_ids(deltas: list[RequestOutput]) -> list[int]:
    return [t for o in deltas for t in o.token_ids]


def text(deltas: list[RequestOutput]) -> str:
    return "".join(o.text for o in deltas)


def finish(deltas: list[RequestOutput]) -> FinishReason | None:
    return deltas[-1].finish_reason


def reference_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own single-sequence greedy decode (no EOS handling)."""
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


def insert_greedy(batch: Any, chat: Loaded, prompts: list[list[int]]) -> list[int]:
    """Greedy rows of these prompts into a rows batch (worker/backends/rows.py), no prefix."""
    from worker.backends.sampling import greedy

    return batch.insert(
        prompts,
        [make_prompt_cache(chat.model) for _ in prompts],
        [[] for _ in prompts],
        [greedy] * len(prompts),
        [[] for _ in prompts],
    )


def run_steps(batch: Any, steps: int, out: dict[int, list[int]]) -> None:
    """`steps` steps of a rows batch, each row's tokens appended to out[uid]."""
    for _ in range(steps):
        for uid, token, _ in batch.step():
            out.setdefault(uid, []).append(token)
