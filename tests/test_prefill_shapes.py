"""worker/backends/prefill_shapes.py: a joining group's prefill padded to a few shapes, on a
real tiny model: the shapes the model sees, and the same tokens as without the padding."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from shared.config import EngineOptions
from shared.engine_options import engine_problem
from tests.engine_fixtures import Loaded, reference_greedy
from worker.backends import prefill_shapes as shapes
from worker.backends.mlx_lm import make_backend
from worker.backends.rows import RowBatch
from worker.backends.sampling import greedy


def test_buckets() -> None:
    assert [shapes.row_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 28)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 24, 32,
    ]  # fmt: skip
    assert [shapes.position_bucket(n) for n in (1, 31, 32, 33, 127)] == [32, 32, 32, 64, 128]
    assert shapes.key_padding(16, 128) == 128  # 16 + 128 keys -> 256
    assert shapes.key_padding(128, 128) == 0  # 256 already
    assert shapes.key_padding(4400, 224) == 4864 - 224  # 4,624 keys -> 4,864


class _Spy:
    """The model, noting the shape of each multi-token call and the keys it attends to."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[tuple[int, int, int]] = []  # (rows, positions, keys after)

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> Any:
        out = self.model(inputs, cache=cache, **kwargs)
        if inputs.shape[1] > 1:
            self.calls.append((inputs.shape[0], inputs.shape[1], cache[0].size()))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _cached(chat: Loaded, prompt: list[int], n: int) -> list[Any]:
    cache = make_prompt_cache(chat.model)
    chat.model(mx.array(prompt[:n])[None], cache=cache)
    return cache


def _run(batch: RowBatch, steps: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for _ in range(steps):
        for uid, token, _ in batch.step():
            out.setdefault(uid, []).append(token)
    return out


@pytest.mark.parametrize("shaped", [False, True])
def test_a_group_with_cached_prefixes_is_padded_and_decodes_as_alone(
    chat: Loaded, prompts: list[list[int]], shaped: bool
) -> None:
    """Three rows, two with part of their prompt cached (5 and 3 tokens): bucketed, one
    prefill of 4 rows (a dead one holding the keys' padding) by 32 positions over 256 keys;
    at the join the dead row goes, and each row decodes as it does alone."""
    spy = _Spy(chat.model)
    batch = RowBatch(spy, shaped=shaped)  # type: ignore[arg-type]
    chosen = [prompts[2], prompts[6], prompts[3]]
    uids = batch.insert(
        [chosen[0][5:], chosen[1][3:], chosen[2]],
        [_cached(chat, chosen[0], 5), _cached(chat, chosen[1], 3), make_prompt_cache(chat.model)],
        [chosen[0][:5], chosen[1][:3], []],
        [greedy] * 3,
        [[], [], []],
    )
    out = _run(batch, 12)
    longest = max(len(chosen[0]) - 6, len(chosen[1]) - 4, len(chosen[2]) - 1)
    if shaped:
        assert spy.calls == [(4, 32, 256)]
    else:
        assert spy.calls == [(3, longest, 5 + longest)]
    assert len(batch.rows) == 3 and not any(r.dead for r in batch.rows)
    if shaped:  # no padding all rows share: the longest row's KV starts at the first position
        assert batch.caches[0].size() == max(len(r.held) for r in batch.rows)
    for uid, prompt in zip(uids, chosen, strict=True):
        assert out[uid][:10] == reference_greedy(chat.model, prompt, 10), uid
    kv, held = batch.extract([uids[0]])[uids[0]]
    assert held[: len(chosen[0])] == chosen[0] and all(c.size() == len(held) for c in kv.caches())


def test_a_lone_row_decodes_unpadded_after_a_padded_prefill(
    chat: Loaded, prompts: list[list[int]]
) -> None:
    spy = _Spy(chat.model)
    batch = RowBatch(spy, shaped=True)  # type: ignore[arg-type]
    [uid] = batch.insert([prompts[0]], [make_prompt_cache(chat.model)], [[]], [greedy], [[]])
    out = _run(batch, 8)
    assert spy.calls == [(1, 32, 32)]  # no prefix: no keys to pad, one row
    assert not batch.padded  # its right padding went at the join: no mask in its steps
    assert out[uid] == reference_greedy(chat.model, prompts[0], len(out[uid]))


def test_a_long_group_keeps_its_exact_shape(chat: Loaded, prompts: list[list[int]]) -> None:
    spy = _Spy(chat.model)
    long = (prompts[0] * (shapes.MAX_POSITIONS // len(prompts[0]) + 2))[: shapes.MAX_POSITIONS + 9]
    batch = RowBatch(spy, prefill_step_size=4096, shaped=True)  # type: ignore[arg-type]
    [uid] = batch.insert([long], [make_prompt_cache(chat.model)], [[]], [greedy], [[]])
    out = _run(batch, 4)
    assert spy.calls == [(1, len(long) - 1, len(long) - 1)]
    assert out[uid] == reference_greedy(chat.model, long, len(out[uid]))


def test_bucketed_by_default_on_mlx_cuda_only(
    chat: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    def shaped(**options: Any) -> bool:
        options = {"batcher": "rows", "decode_step": "model", **options}
        backend = make_backend(chat.model, chat.tokenizer, EngineOptions(**options))
        return bool(backend.batch.shaped)  # type: ignore[attr-defined]

    assert not shaped() and shaped(prefill_shapes="bucketed")
    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(mx, "default_device", lambda: gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert shaped() and not shaped(prefill_shapes="exact")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)  # Metal: not measured there
    assert not shaped()
    problem = engine_problem(EngineOptions(batcher="mlx_lm", prefill_shapes="bucketed"))
    assert problem is not None and "engine.prefill_shapes" in problem
