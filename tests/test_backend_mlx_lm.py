"""The parts of mlx-lm's public API the backend stands on. When an mlx-lm release changes
one of them, this fails before a worker does."""

from __future__ import annotations

import dataclasses
import inspect

from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import cache

from shared.config import EngineOptions
from shared.types import SamplingParams
from tests.engine_fixtures import Loaded
from worker.backends.mlx_lm import MlxLmBackend
from worker.engine.backend import Insertion


def test_batch_generator_signatures() -> None:
    init = inspect.signature(BatchGenerator.__init__).parameters
    assert {"completion_batch_size", "prefill_batch_size", "prefill_step_size"} <= set(init)
    insert = list(inspect.signature(BatchGenerator.insert).parameters)
    assert insert[:7] == [
        "self",
        "prompts",
        "max_tokens",
        "caches",
        "all_tokens",
        "samplers",
        "logits_processors",
    ]
    assert "return_prompt_caches" in inspect.signature(BatchGenerator.remove).parameters
    fields = {f.name for f in dataclasses.fields(GenerationBatch.Response)}
    assert {"uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens"} <= fields
    for name in ("make_prompt_cache", "can_trim_prompt_cache", "trim_prompt_cache"):
        assert callable(getattr(cache, name))


def test_a_row_leaves_with_its_cache_and_comes_back_from_it(chat: Loaded) -> None:
    """remove(..., return_prompt_caches=True) hands back a cache of exactly the tokens it
    holds, and a sequence inserted on a trimmed copy of it continues as from scratch."""
    backend = MlxLmBackend(chat.model, chat.tokenizer, EngineOptions())
    greedy = SamplingParams(temperature=0.0)
    prompt = list(range(5, 45))
    [uid] = backend.insert([Insertion(prompt, [], None, 8, greedy, frozenset())])
    tokens: list[int] = []
    while len(tokens) < 4:
        tokens += [s.token for s in backend.step(keep_caches=True) if s.uid == uid]
    kept = backend.remove([uid], keep_caches=True)
    kv, held = kept[uid]
    assert held[: len(prompt)] == prompt and len(held) >= len(prompt) + 3
    assert all(c.size() == len(held) for c in kv)
    assert backend.trimmable(kv) and not backend.active

    def run(items: list[Insertion]) -> list[int]:
        [u] = backend.insert(items)
        out: list[int] = []
        while len(out) < 6:
            out += [s.token for s in backend.step(keep_caches=False) if s.uid == u]
        backend.remove([u])
        return out

    follow = [*prompt, 7, 8, 9]
    reused = backend.prefix(kv, len(prompt), len(held))
    from_cache = run([Insertion(follow[len(prompt) :], prompt, reused, 6, greedy, frozenset())])
    scratch = run([Insertion(follow, [], None, 6, greedy, frozenset())])
    assert from_cache == scratch
    assert all(c.size() == len(held) for c in kv)  # the kept cache itself is untouched
