"""A decoder layer's linear projections as the compiled decode step multiplies them: plain
(`nn.Linear`) or quantized (`nn.QuantizedLinear`), each one's arrays handed to the step's
traced functions as inputs, and projections of the same input stacked into one matrix
(`engine.decode_projections = "stacked"`: fewer, larger multiplications a step), the
model's own modules then reading slices of the stacked arrays, so that the weights are not
held twice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True, slots=True)
class Projection:
    """How a layer's linear projection multiplies (its arrays are the compiled function's
    inputs; this is the static part of the trace)."""

    quantized: bool
    bias: bool  # an added bias vector
    scale_biases: bool = False  # quantized: affine mode's per-group biases
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"


def _names(module: Any) -> list[str]:
    """The parameters a linear layer multiplies with, in the order `apply` takes them."""
    names = ["weight", "scales"] if type(module) is nn.QuantizedLinear else ["weight"]
    names += [n for n in ("biases", "bias") if getattr(module, n, None) is not None]
    return names


def projection(module: Any) -> tuple[Projection, list[mx.array]] | None:
    """A linear layer's kind and arrays; None for a layer of another kind (a sharded or
    LoRA layer, say): the model's forward pass is then the only one that knows it."""
    bias = getattr(module, "bias", None)
    if type(module) is nn.Linear:
        return Projection(False, bias is not None), [getattr(module, n) for n in _names(module)]
    if type(module) is nn.QuantizedLinear:
        biases = getattr(module, "biases", None)
        arrays = [getattr(module, n) for n in _names(module)]
        kind = Projection(
            True,
            bias is not None,
            biases is not None,
            module.group_size,
            module.bits,
            module.mode,
        )
        return kind, arrays
    return None


def apply(x: mx.array, kind: Projection, arrays: Sequence[mx.array]) -> mx.array:
    """`x` through a projection, as its module computes it."""
    if not kind.quantized:  # nn.Linear: one fused multiply-add with a bias (its rounding)
        return mx.addmm(arrays[1], x, arrays[0].T) if kind.bias else x @ arrays[0].T
    weight, scales, *rest = arrays
    biases = rest[0] if kind.scale_biases else None
    y = mx.quantized_matmul(
        x,
        weight,
        scales=scales,
        biases=biases,
        transpose=True,
        group_size=kind.group_size,
        bits=kind.bits,
        mode=kind.mode,
    )
    return y + rest[-1] if kind.bias else y


def split(arrays: Sequence[mx.array], counts: Sequence[int]) -> list[list[mx.array]]:
    out, at = [], 0
    for n in counts:
        out.append(list(arrays[at : at + n]))
        at += n
    return out


def fuse_into(
    modules: list[Any], found: list[tuple[Projection, list[mx.array]]]
) -> tuple[Projection, list[mx.array]] | None:
    """Projections of the same input as one: their arrays stacked by output rows, and each
    module's own parameters made slices of the stacked ones (views of the same memory, so
    the model's forward pass, which prefills, reads what the step reads and the weights are
    not held twice)."""
    kinds = {f[0] for f in found}
    if len(kinds) != 1:
        return None
    arrays = [mx.concatenate([f[1][i] for f in found], axis=0) for i in range(len(found[0][1]))]
    mx.eval(arrays)
    at, updates = 0, []
    for module, (_, own) in zip(modules, found, strict=True):
        rows = own[0].shape[0]
        views = {n: a[at : at + rows] for n, a in zip(_names(module), arrays, strict=True)}
        # the model reads these from now on: the same bits as its own, or it keeps its own
        same = [mx.array_equal(v, o) for v, o in zip(views.values(), own, strict=True)]
        if not all(bool(s.item()) for s in same):
            return None
        updates.append((module, views))
        at += rows
    for module, views in updates:
        module.update(views)
    return kinds.pop(), arrays


def agree(got: mx.array, want: mx.array) -> bool:
    """Equal within the rounding of a different order of summation: a few units in the last
    place of `want`'s dtype, relative to each value and to the array's largest."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    tolerance = 2e-2 if want.dtype in (mx.bfloat16, mx.float16) else 1e-4
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    bound = tolerance * (mx.abs(want) + mx.abs(want).max())
    return bool(mx.all(mx.abs(got - want) <= bound).item())
