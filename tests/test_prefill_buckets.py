"""worker/backends/prefill_buckets.py: prefills at a few shapes, the same KV and the same
tokens as at their own (the rows batch with `prefill_buckets`, on a real tiny model)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from shared.config import EngineOptions
from shared.engine_options import engine_problem
from tests.engine_fixtures import Loaded, reference_greedy, token_ids
from worker.backends.mlx_lm import make_backend
from worker.backends.prefill_buckets import (
    KEY_BUCKET,
    TOKEN_BUCKET,
    BucketedCache,
    bucket,
    padded_width,
    views,
    wanted,
)
from worker.backends.rows import RowBatch
from worker.backends.sampling import greedy
from worker.backends.unpadded import Unpadded


def test_buckets_round_up_by_at_most_a_quarter_past_their_least_size() -> None:
    assert [bucket(n, 64) for n in (1, 64, 65, 200, 256)] == [64, 64, 128, 256, 256]
    assert [bucket(n, 256) for n in (257, 1024, 1025, 4400, 5000, 5121)] == [
        512,
        1024,
        1280,
        5120,
        5120,
        6144,
    ]
    sizes = {bucket(n, 256) for n in range(1, 32769)}
    assert len(sizes) < 30  # a conversation to 32k positions meets fewer than 30 of them
    for n in range(1, 40000, 37):
        b = bucket(n, 256)
        assert n <= b <= max(1024, n * 5 // 4 + 1)


def test_only_a_prefills_last_chunk_is_padded() -> None:
    assert padded_width(10, 512) == TOKEN_BUCKET
    assert padded_width(512, 512) == 512
    assert padded_width(1100, 512) == 1024 + 128  # two chunks as they are, then 76 -> 128
    assert padded_width(500, 512) == 512  # a bucket never passes the chunk


def _filled(rows: int, length: int, left: list[int]) -> BatchKVCache:
    cache = BatchKVCache(left)
    k = mx.random.normal((rows, 2, length, 4))
    cache.update_and_fetch(k, k + 1)
    return cache


def test_the_view_writes_as_the_cache_does_and_hands_attention_a_bucket() -> None:
    plain, seen = _filled(2, 300, [0, 7]), _filled(2, 300, [0, 7])
    keys, values = plain.state[0], plain.state[1]
    seen.state = (keys, values, *plain.state[2:])  # the same content in both
    new = mx.random.normal((2, 2, 20, 4))
    view = BucketedCache(seen)
    mask = view.make_mask(20)
    k, v = view.update_and_fetch(new, new * 2)
    ek, ev = plain.update_and_fetch(new, new * 2)
    assert k.shape[2] == v.shape[2] == bucket(320, KEY_BUCKET) == 512
    assert mask.shape == (2, 1, 20, 512)
    assert mx.array_equal(k[:, :, :320], ek) and mx.array_equal(v[:, :, :320], ev)
    assert seen.state[4] == plain.state[4] == 320 and seen.size() == 320
    assert mx.array_equal(seen.offset, plain.offset)
    assert mx.array_equal(view.offset, plain.offset)
    # a query at position 300 + i sees positions left..300 + i, nothing past it
    expected = mx.array(
        [[[[lp <= j <= 300 + i for j in range(512)] for i in range(20)]] for lp in (0, 7)]
    )
    assert mx.array_equal(mask, expected)


def test_views_only_of_mlx_lms_plain_batch_cache() -> None:
    assert views([BatchKVCache([0])]) is not None
    assert views([KVCache()]) is None
    assert views([]) is None


def _insert(
    batch: RowBatch, chat: Loaded, prompts: list[list[int]], cached: list[int]
) -> list[int]:
    caches, prefixes = [], []
    for prompt, n in zip(prompts, cached, strict=True):
        cache = make_prompt_cache(chat.model)
        if n:
            chat.model(mx.array(prompt[:n])[None], cache=cache)
        caches.append(cache)
        prefixes.append(prompt[:n])
    return batch.insert(
        [p[n:] for p, n in zip(prompts, cached, strict=True)],
        caches,
        prefixes,
        [greedy] * len(prompts),
        [[] for _ in prompts],
    )


def _run(batch: RowBatch, steps: int, out: dict[int, list[int]]) -> dict[int, list[int]]:
    for _ in range(steps):
        for uid, token, _ in batch.step():
            out.setdefault(uid, []).append(token)
    return out


def _group_run(
    batch: RowBatch, chat: Loaded, prompts: list[list[int]], cached: list[int], steps: int
) -> dict[int, list[int]]:
    uids = _insert(batch, chat, prompts, cached)
    out = _run(batch, steps, {})
    return {uid: out.get(uid, []) for uid in uids}


class _Widths:
    """The model, noting each prefill's width and what it got as caches."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[tuple[int, type]] = []

    def __call__(self, inputs: mx.array, cache: list, **kw: Any) -> mx.array:
        if inputs.shape[1] > 1:
            self.calls.append((inputs.shape[1], type(cache[0])))
        return self.model(inputs, cache=cache, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.mark.parametrize("chunk", [512, 8])
def test_a_row_after_a_cached_prefix_decodes_as_alone_and_keeps_no_padding(
    chat: Loaded, prompts: list[list[int]], chunk: int
) -> None:
    spy = _Widths(chat.model)
    batch = RowBatch(spy, prefill_step_size=chunk, prefill_buckets=True)
    prompt = prompts[3]
    out = _group_run(batch, chat, [prompt], [5], 14)
    (uid,) = out
    assert out[uid][:12] == reference_greedy(chat.model, prompt, 12)
    rest = len(prompt) - 5 - 1  # the last prompt token is the first decode input
    assert [w for w, _ in spy.calls] == _chunks(padded_width(rest, chunk), chunk)
    assert all(kind is BucketedCache for _, kind in spy.calls)
    # the padding's KV is gone: the row holds exactly its tokens, and decodes unmasked
    assert batch.caches[0].size() == len(batch.rows[0].held)
    assert all(type(c) is Unpadded for c in batch.step_caches)


def _chunks(width: int, chunk: int) -> list[int]:
    return [min(chunk, width - start) for start in range(0, width, chunk)]


def test_rows_of_different_lengths_and_prefixes_prefill_together_as_alone(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = RowBatch(chat.model, prefill_step_size=8, prefill_buckets=True)
    group = [prompts[2], prompts[3], prompts[1]]
    out = _group_run(batch, chat, group, [5, 0, 3], 16)
    for uid, prompt in zip(out, group, strict=True):
        assert out[uid][:12] == reference_greedy(chat.model, prompt, 12), uid
    kv = batch.extract(list(out))
    for uid, prompt in zip(out, group, strict=True):
        caches, held = kv[uid]
        assert held[: len(prompt)] == prompt
        assert all(c.size() == len(held) for c in caches.caches())


def test_rows_joining_a_running_batch_decode_as_alone(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    batch = RowBatch(chat.model, prefill_step_size=4, prefill_buckets=True)
    out: dict[int, list[int]] = {}
    first = _insert(batch, chat, prompts[:2], [0, 0])
    _run(batch, 4, out)
    late = _insert(batch, chat, prompts[2:4], [3, 0])
    _run(batch, 30, out)
    for uid, prompt in zip(first + late, prompts[:4], strict=True):
        assert out[uid][:12] == reference_greedy(chat.model, prompt, 12), uid


def test_the_setting_reaches_the_rows_batch_and_only_it(chat: Loaded) -> None:
    buckets = EngineOptions(batcher="rows", prefill_shapes="buckets")
    on = make_backend(chat.model, chat.tokenizer, buckets)
    off = make_backend(chat.model, chat.tokenizer, EngineOptions(batcher="rows"))
    assert on.batch.prefill_buckets and not off.batch.prefill_buckets  # type: ignore[attr-defined]
    problem = engine_problem(EngineOptions(batcher="mlx_lm", prefill_shapes="buckets"))
    assert problem is not None and "engine.prefill_shapes" in problem
    assert engine_problem(EngineOptions(batcher="mlx_lm")) is None  # "auto": no complaint


def test_auto_means_buckets_on_mlxs_cuda_backend_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not wanted("auto")  # this machine: MLX's CPU
    assert wanted("buckets") and not wanted("exact")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert wanted("auto") and not wanted("exact")
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)  # a CUDA build on its CPU
    assert not wanted("auto")


def test_what_a_model_reads_or_writes_on_the_view_is_the_caches() -> None:
    cache = _filled(1, 10, [0])
    view = BucketedCache(cache)
    assert view.offset is cache.offset and view.keys is cache.keys
    keys = mx.zeros_like(cache.keys)
    view.keys = keys  # as mlx-lm's pipeline does to the last layer's cache
    assert cache.keys is keys


def test_an_engines_conversation_over_its_prefix_cache_gives_the_exact_shapes_tokens(
    chat: Loaded,
) -> None:
    """The engine, its prefix cache on: each turn prefills its new tokens after the cached
    ones, at buckets; the same greedy tokens as at exact shapes, and the same reuse."""
    from tests.test_engine_prefix import converse, final_usage

    exact = converse(chat, chat.engine(batcher="rows"))
    buckets = converse(chat, chat.engine(batcher="rows", prefill_shapes="buckets"))
    for turn, (a, b) in enumerate(zip(exact, buckets, strict=True)):
        assert token_ids(b) == token_ids(a), f"turn {turn}"
        assert final_usage(b).cached_tokens == final_usage(a).cached_tokens
        assert turn == 0 or final_usage(b).cached_tokens > 0


def test_a_window_the_model_asks_for_is_kept() -> None:
    cache = _filled(1, 300, [0])
    mask = BucketedCache(cache).make_mask(4, window_size=8)
    for i in range(4):  # query 300 + i sees 293 + i .. 300 + i
        seen = [j for j in range(mask.shape[-1]) if mask[0, 0, i, j].item()]
        assert seen == list(range(293 + i, 301 + i)), i
