"""Fused stand-ins for the MLX fast ops that MLX's CPU backend builds out of small ops.

On Apple GPUs and CUDA, `mx.fast.rms_norm` and `mx.fast.rope` are one kernel each. MLX's
CPU backend (0.32) has no kernel for them: each call builds the op's fallback graph instead,
13 nodes for an RMSNorm and 30 for a RoPE with one position offset per row (what mlx-lm's
BatchKVCache passes). Every node is a task handed to MLX's CPU stream thread, and on a
small model those hand-offs, not the arithmetic, are most of a decode step: a 6-layer Llama
step at batch 4 is 846 nodes, 372 of them RoPE and 144 RMSNorm.

`fuse_cpu_ops(model)` swaps the model's `nn.RMSNorm` and `nn.RoPE` modules (exactly those
classes, not look-alikes with other formulas) for subclasses that compute the same fallback
formula, in the same order, with its elementwise chains compiled (`mx.compile`) into fused
kernels: 4 nodes an RMSNorm and 11 a RoPE, and the same values to the bit. Whatever is
computed once a row or once a position in the fallback (a row's inverse RMS, the RoPE
angles and their cosines and sines) stays so, so a long prefill costs what it did. The
weights stay the same arrays, so the parameter tree does not change. The worker applies it
only when the model runs on the CPU device (`fuse_for_cpu`), and leaves the model as
loaded if MLX cannot build the kernels there.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

log = logging.getLogger(__name__)


@partial(mx.compile, shapeless=True)
def _inv_rms(sum_of_squares: mx.array, inv_dims: mx.array, eps: mx.array) -> mx.array:
    return mx.rsqrt(sum_of_squares * inv_dims + eps)  # the mean as mx.mean computes it


@partial(mx.compile, shapeless=True)
def _scale(x: mx.array, inv_rms: mx.array, weight: mx.array) -> mx.array:
    out_type = mx.result_type(x, weight)
    return (x.astype(mx.float32) * inv_rms).astype(out_type) * weight.astype(out_type)


class FusedRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` computed as MLX's fallback does: the sum of squares, one small kernel for
    each row's inverse RMS (once a row, not once an element), one for the scaling."""

    def __init__(self, dims: int, eps: float = 1e-5) -> None:
        super().__init__(dims, eps=eps)
        # Inputs, not constants of the kernel: one compiled kernel serves every model.
        self._inv_dims = mx.array(1.0 / dims, mx.float32)
        self._eps = mx.array(eps, mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        sum_of_squares = mx.sum(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True)
        return _scale(x, _inv_rms(sum_of_squares, self._inv_dims, self._eps), self["weight"])


@partial(mx.compile, shapeless=True)
def _angles(steps: mx.array, offset: mx.array, scale: mx.array, inv_freqs: mx.array) -> mx.array:
    return (steps + offset) * scale * inv_freqs


@partial(mx.compile, shapeless=True)
def _first(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x1 * cos - x2 * sin


@partial(mx.compile, shapeless=True)
def _second(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    return x1 * sin + x2 * cos


class FusedRoPE(nn.RoPE):
    """`nn.RoPE` computed as MLX's fallback does, with its elementwise chains fused.

    The fallback rotates each pair (x1, x2) of features, the two halves of the rotated
    features (or neighbours, if `traditional`), into (x1 cos - x2 sin, x1 sin + x2 cos),
    with the angles, cosines and sines over positions and half the features only (not
    heads). Here the same: one kernel for the angles, MLX's cos and sin, one kernel for
    each half of the output, and one concatenation.
    """

    def __init__(self, dims: int, traditional: bool, base: float, scale: float) -> None:
        super().__init__(dims, traditional=traditional, base=base, scale=scale)
        half = dims // 2
        self._inv_freqs = mx.exp(
            mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base) / half, mx.float32)
        )
        self._scale = mx.array(scale, mx.float32)
        mx.eval(self._inv_freqs)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.ndim < 3:
            return mx.fast.rope(  # MLX's own error
                x,
                self.dims,
                traditional=self.traditional,
                base=self.base,
                scale=self.scale,
                offset=offset,
            )
        dims, half, steps = self.dims, self.dims // 2, x.shape[-2]
        ids = mx.array(offset, mx.int32) if isinstance(offset, int) else offset
        if ids.ndim == 1 and ids.size > 1:
            ids = ids.reshape((ids.size, *(1,) * (x.ndim - 1)))
        elif ids.ndim:
            ids = ids.reshape(())
        theta = _angles(
            mx.arange(steps, dtype=mx.float32)[:, None], ids, self._scale, self._inv_freqs
        )
        cos, sin = mx.cos(theta).astype(x.dtype), mx.sin(theta).astype(x.dtype)
        if self.traditional:
            x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        else:
            x1, x2 = x[..., :half], x[..., half:dims]
        a, b = _first(x1, x2, cos, sin), _second(x1, x2, cos, sin)
        if self.traditional:
            parts = [mx.stack([a, b], axis=-1).reshape((*x.shape[:-1], dims))]
        else:
            parts = [a, b]
        if dims < x.shape[-1]:
            parts.append(x[..., dims:])
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def _swap(path: str, module: Any) -> Any:
    if type(module) is nn.RMSNorm:
        fused = FusedRMSNorm(module.weight.shape[0], eps=module.eps)
        fused.weight = module.weight
        return fused
    if type(module) is nn.RoPE:
        return FusedRoPE(module.dims, module.traditional, module.base, module.scale)
    return module


def fuse_cpu_ops(model: nn.Module) -> int:
    """Swap the model's RMSNorm and RoPE modules for the fused ones; returns how many fused
    modules the model now has (a second call swaps nothing more)."""
    before = model.leaf_modules()
    after = tree_map_with_path(_swap, before, is_leaf=nn.Module.is_module)
    model.update_modules(after)
    return sum(isinstance(m, (FusedRMSNorm, FusedRoPE)) for _, m in model.named_modules())


def warm_up(model: nn.Module) -> None:
    """Run the shapes a batch uses through the model once: one prompt, then two prompts of
    different lengths side by side (per-row offsets), each for two decode steps.

    MLX compiles a fused kernel for each layout it meets (with the system's C++ compiler,
    cached on disk under the temporary directory), a few seconds on a fresh machine; this
    moves that wait from the first requests to the model's load.
    """
    from mlx_lm.generate import BatchGenerator

    for prompts in ([[1, 2, 3]], [[1, 2, 3], [4, 5]]):
        gen = BatchGenerator(model, max_tokens=2, completion_batch_size=2, prefill_batch_size=2)
        try:
            gen.insert(prompts, max_tokens=[2] * len(prompts))
            for _ in range(8):  # prefill, first tokens, two decode steps; then idle
                gen.next()
        finally:
            gen.close()


@contextmanager
def compile_lock() -> Iterator[None]:
    """One warm-up at a time on this machine: MLX writes a compiled kernel's library where
    another process may already be loading it, and workers often start together (this
    warm-up, and the compiled decode step's probe: worker/backends/decode_step.py)."""
    path = Path(tempfile.gettempdir()) / f"mlx-gateway-{os.getuid()}-compile.lock"
    try:
        lock = open(path, "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fuse_for_cpu(model: nn.Module, attempts: int = 3) -> int:
    """On the CPU device: swap in the fused modules and warm them up; returns how many
    modules were swapped (0 on any other device, or if the kernels cannot be built here,
    and then the model is left as loaded)."""
    if mx.default_device() != mx.cpu:
        return 0
    original = model.leaf_modules()
    swapped = fuse_cpu_ops(model)
    if not swapped:
        return 0
    with compile_lock():
        for attempt in range(1, attempts + 1):
            try:
                warm_up(model)
                return swapped
            except Exception as exc:  # a library half-written by another user's process
                log.warning("fused CPU kernels: warm-up attempt %d failed: %s", attempt, exc)
                time.sleep(0.5 * attempt)
    model.update_modules(original)
    log.warning("fused CPU kernels unavailable: the model runs on MLX's own ops")
    return 0
