"""The fused CPU stand-ins for RMSNorm and RoPE (worker/cpu_ops.py): the same values as
MLX's own modules, bit for bit, on a real tiny model too, with fewer graph nodes."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator

from shared.config import EngineOptions, ModelConfig
from worker.backends.cpu_ops import FusedRMSNorm, FusedRoPE, fuse_cpu_ops
from worker.loader import load_model

DTYPES = [mx.float32, mx.bfloat16, mx.float16]


def same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(("dims", "features"), [(32, 32), (16, 32)])
@pytest.mark.parametrize(("base", "scale"), [(10000.0, 1.0), (500000.0, 0.25)])
def test_rope_matches_mlx(
    dtype: Any, traditional: bool, dims: int, features: int, base: float, scale: float
) -> None:
    mx.random.seed(dims + int(traditional))
    reference = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    fused = FusedRoPE(dims, traditional, base, scale)
    cases: list[tuple[tuple[int, ...], int | mx.array]] = [
        ((4, 3, 1, features), mx.array([5, 9, 1300, 0])),  # a decode step, one offset a row
        ((1, 3, 17, features), 7),  # a prefill chunk, int offset
        ((1, 3, 5, features), mx.array([11])),  # one row
        ((2, 17, features), mx.array([3, 4])),  # no head axis
        ((2, 2, 3, 6, features), mx.array([0, 2])),  # extra axes
    ]
    for shape, offset in cases:
        x = (mx.random.normal(shape) * 3).astype(dtype)
        assert same(fused(x, offset=offset), reference(x, offset=offset)), (shape, offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [None, mx.float32])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_matches_mlx(dtype: Any, weight_dtype: Any, eps: float) -> None:
    mx.random.seed(3)
    reference = nn.RMSNorm(96, eps=eps)
    reference.weight = mx.random.normal((96,)).astype(weight_dtype or dtype)
    fused = FusedRMSNorm(96, eps=eps)
    fused.weight = reference.weight
    for shape in [(96,), (4, 1, 96), (1, 37, 96), (2, 3, 5, 96)]:
        x = (mx.random.normal(shape) * 5).astype(dtype)
        assert same(fused(x), reference(x)), shape


def _generate(model: Any, prompts: list[list[int]], tokens: int) -> dict[int, list[Any]]:
    """Greedy tokens and logprobs, per prompt, from mlx-lm's BatchGenerator."""
    gen = BatchGenerator(model, max_tokens=tokens, prefill_batch_size=len(prompts))
    out: dict[int, list[Any]] = {}
    try:
        uids = gen.insert(prompts, max_tokens=[tokens] * len(prompts))
        for _ in range(4 * tokens):
            for r in gen.next()[1]:
                out.setdefault(uids.index(r.uid), []).append((r.token, r.logprobs))
    finally:
        gen.close()
    return out


def test_fused_model_generates_the_same_tokens_and_logprobs(
    chat_model: Path, prompts: list[list[int]]
) -> None:
    reference = mlx_load(str(chat_model))[0]
    fused = mlx_load(str(chat_model))[0]
    layers = len(fused.model.layers)
    assert fuse_cpu_ops(fused) == 3 * layers + 1  # two norms and a RoPE a layer, final norm
    assert fuse_cpu_ops(fused) == 3 * layers + 1  # a second pass swaps nothing more
    batch = prompts[:4]
    want, got = _generate(reference, batch, 12), _generate(fused, batch, 12)
    assert sorted(got) == list(range(len(batch)))
    for i in range(len(batch)):
        assert [t for t, _ in got[i]] == [t for t, _ in want[i]]
        for (_, a), (_, b) in zip(got[i], want[i], strict=True):
            assert same(a, b)


def _decode_nodes(model: Any) -> int:
    """Nodes in the graph of one decode step of a 4-row batch (rows at different offsets)."""
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache([0, 1, 2, 3]) for _ in model.model.layers]
    prompt = mx.array([[1, 2, 3, 4, 5]] * 4)
    mx.eval(model(prompt, cache=cache))
    mx.eval([c.state for c in cache])
    dot = io.StringIO()
    mx.export_to_dot(dot, model(mx.array([[6]] * 4), cache=cache))
    return len(re.findall(r'label\s*=\s*"[A-Za-z]', dot.getvalue()))


def test_fused_decode_step_has_far_fewer_nodes(chat_model: Path) -> None:
    """The point of the swap: if MLX's CPU backend gains its own kernels for these ops, this
    fails, and the swap has outlived its use."""
    reference = mlx_load(str(chat_model))[0]
    fused = mlx_load(str(chat_model))[0]
    fuse_cpu_ops(fused)
    before, after = _decode_nodes(reference), _decode_nodes(fused)
    assert after < 0.75 * before, (before, after)


def test_loader_swaps_on_cpu_unless_turned_off(chat_model: Path) -> None:
    assert mx.default_device() == mx.cpu
    on = load_model(ModelConfig(name="m", source=str(chat_model)))
    kinds = {type(m) for _, m in on.model.named_modules()}
    assert FusedRMSNorm in kinds and FusedRoPE in kinds
    off = load_model(
        ModelConfig(name="m", source=str(chat_model), engine=EngineOptions(fused_cpu_ops=False))
    )
    kinds = {type(m) for _, m in off.model.named_modules()}
    assert nn.RMSNorm in kinds and nn.RoPE in kinds
    assert FusedRMSNorm not in kinds and FusedRoPE not in kinds


def test_a_failed_warm_up_leaves_the_model_as_loaded(
    chat_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.backends import cpu_ops

    calls = []

    def broken(model: Any) -> None:
        calls.append(1)
        raise RuntimeError("[Compile::eval_cpu] Failed to compile function")

    monkeypatch.setattr(cpu_ops, "warm_up", broken)
    monkeypatch.setattr(cpu_ops.time, "sleep", lambda s: None)
    model = mlx_load(str(chat_model))[0]
    assert cpu_ops.fuse_for_cpu(model) == 0
    assert len(calls) == 3
    kinds = {type(m) for _, m in model.named_modules()}
    assert nn.RMSNorm in kinds and nn.RoPE in kinds
    assert FusedRMSNorm not in kinds and FusedRoPE not in kinds
    prompt = mx.array([[1, 2, 3]])
    assert model(prompt).shape[:2] == (1, 3)
