"""A one-token decode step of our own for Llama-family models, on the model's own weights.

On a GPU a decode step is bound by the host: mlx-lm's forward pass builds the graph of every
operation of every layer in Python at every step, and MLX encodes each one as a kernel
(docs/benchmarks.md; issue 23). This step computes the same function with fewer, cheaper
graph nodes:
- each decoder layer is two `mx.compile`d functions, taking the layer's weights as inputs
  (one trace serves every layer): the input norm, Q/K/V projections, the head norms where
  the model has them and RoPE; then the output projection, residual, norm, gated MLP and
  residual. Compilation fuses their elementwise chains and replays the traced graph without
  Python's per-operation work;
- the RoPE positions and the attention mask are computed once a step, not once a layer;
- a token's queries, keys and values are reshaped straight to the attention's layout (one
  position: no transposes), and the attention's output straight back;
- attention itself is MLX's fused `scaled_dot_product_attention` over the layer's own cache,
  written through the cache's public `update_and_fetch`, so that the rest of the engine
  (prefill, joins, compaction, the prefix cache) sees the caches it always did; on MLX's
  CUDA backend (`engine.decode_attention`, "auto" or "kernel"), rows of different lengths
  (a mask for MLX's attention, which it then runs unfused) take one kernel of our own
  instead (ragged_attention.py).

The operations are the model's own, in its order and dtypes, so greedy tokens are the same
(tests compare them with mlx-lm's forward pass). `build` takes only the architectures it
knows (llama, mistral, qwen2, qwen3 with plain or quantized linear layers and full
attention in every layer), and checks its step against the model's forward pass on a probe
before it is used: a model it does not know, or an mlx-lm whose model no longer computes
what this step does, keeps mlx-lm's forward pass (logged). A prefill (several tokens a
row) runs the model's own forward pass, or, where the project's prefill attention runs
(prefill_layers.py), the same two compiled functions around it over the chunk's positions
(`project`, `close`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.backends import ragged_attention
from worker.backends.cpu_ops import compile_lock
from worker.backends.projections import Projection, agree, apply, fuse_into, projection, split
from worker.device import on_cpu, on_cuda

log = logging.getLogger(__name__)

ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
PROBE_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Shape:
    """What every decoder layer of the model shares: the static part of both traces."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    head_norm_eps: float | None  # qwen3's per-head query and key norms
    projections: tuple[Projection, ...]  # q, k, v, o, gate, up, down; fused: qkv, o, gate+up, down
    fused: bool = False


@dataclass(slots=True)
class Layer:
    attend: list[mx.array]  # input norm; q, k, v arrays; head norms
    mlp: list[mx.array]  # o arrays; post-attention norm; gate, up, down arrays
    counts: tuple[int, ...]  # arrays per projection, in Shape.projections' order


def _layer(block: Any, fuse: bool = False) -> tuple[Shape, Layer] | None:
    attn, mlp = block.self_attn, block.mlp
    modules = [
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.up_proj,
        mlp.down_proj,
    ]
    found: list[tuple[Projection, list[mx.array]]] = []
    for module in modules:
        one = projection(module)
        if one is None:
            return None
        found.append(one)
    norm, post_norm = block.input_layernorm, block.post_attention_layernorm
    if not isinstance(norm, nn.RMSNorm) or not isinstance(post_norm, nn.RMSNorm):
        return None
    if post_norm.eps != norm.eps:
        return None
    head_norms: list[Any] = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if head_norms != [None, None] and not all(isinstance(n, nn.RMSNorm) for n in head_norms):
        return None
    head_norm_arrays = [n.weight for n in head_norms] if head_norms[0] is not None else []
    if fuse:
        if len({f[0] for f in found[:3]}) != 1 or len({f[0] for f in found[4:6]}) != 1:
            return None
        qkv, gate_up = fuse_into(modules[:3], found[:3]), fuse_into(modules[4:6], found[4:6])
        if qkv is None or gate_up is None:
            return None
        found = [qkv, found[3], gate_up, found[6]]
        attend_count = 1
    else:
        attend_count = 3
    heads = attn.n_heads
    shape = Shape(
        heads,
        attn.n_kv_heads,
        attn.q_proj.weight.shape[0] // heads,  # output rows, packed or not
        norm.eps,
        head_norms[0].eps if head_norms[0] is not None else None,
        tuple(f[0] for f in found),
        fuse,
    )
    arrays = [f[1] for f in found]
    attend = [norm.weight] + [a for one in arrays[:attend_count] for a in one] + head_norm_arrays
    rest = [a for one in arrays[attend_count + 1 :] for a in one]
    mlp_arrays = [*arrays[attend_count], post_norm.weight, *rest]
    return shape, Layer(attend, mlp_arrays, tuple(len(a) for a in arrays))


class DecodeStep:
    """`step(tokens, caches, masked)`: the logits of one decode step (rows, vocabulary)."""

    def __init__(
        self,
        model: Any,
        shape: Shape,
        layers: list[Layer],
        ragged: Callable[[mx.array, mx.array, mx.array, mx.array], mx.array] | None = None,
    ) -> None:
        self.model = model
        self.shape = shape
        self.layers = layers
        # rows of different lengths attend through one kernel instead of a mask (CUDA)
        self.ragged = ragged
        inner = model.model
        rope = inner.layers[0].self_attn.rope
        self.scale = inner.layers[0].self_attn.scale
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.head: Callable[[mx.array], mx.array] = (
            model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens.as_linear
        )
        counts = layers[0].counts
        kinds = shape.projections
        heads, kv_heads, head_dim, eps = shape.heads, shape.kv_heads, shape.head_dim, shape.eps
        norm_eps = shape.head_norm_eps

        def attend(
            x: mx.array, offset: mx.array, arrays: list[mx.array]
        ) -> tuple[mx.array, mx.array, mx.array]:
            rows, n = x.shape[0], x.shape[1]
            h = mx.fast.rms_norm(x, arrays[0], eps)
            if shape.fused:
                y = apply(h, kinds[0], arrays[1 : 1 + counts[0]])
                q, k, v = mx.split(y, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
            else:
                qkv = split(arrays[1:], counts[:3])
                q, k, v = (apply(h, kinds[i], qkv[i]) for i in range(3))
            if n == 1:  # one position: straight to the attention's layout
                q = q.reshape(rows, heads, 1, head_dim)
                k = k.reshape(rows, kv_heads, 1, head_dim)
                v = v.reshape(rows, kv_heads, 1, head_dim)
            else:  # a prefill chunk's (project)
                q = q.reshape(rows, n, heads, head_dim).transpose(0, 2, 1, 3)
                k = k.reshape(rows, n, kv_heads, head_dim).transpose(0, 2, 1, 3)
                v = v.reshape(rows, n, kv_heads, head_dim).transpose(0, 2, 1, 3)
            if norm_eps is not None:
                q = mx.fast.rms_norm(q, arrays[-2], norm_eps)
                k = mx.fast.rms_norm(k, arrays[-1], norm_eps)
            return rope(q, offset=offset), rope(k, offset=offset), v

        def finish(x: mx.array, out: mx.array, arrays: list[mx.array]) -> mx.array:
            rows = x.shape[0]
            o_at = 1 if shape.fused else 3
            o_count = counts[o_at]
            o, norm, rest = arrays[:o_count], arrays[o_count], arrays[o_count + 1 :]
            h = x + apply(out.reshape(rows, x.shape[1], heads * head_dim), kinds[o_at], o)
            m = mx.fast.rms_norm(h, norm, eps)
            if shape.fused:
                gate_up, down = split(rest, counts[2:])
                g, u = mx.split(apply(m, kinds[2], gate_up), 2, axis=-1)
                a = nn.silu(g) * u
                return h + apply(a, kinds[3], down)
            gate, up, down = split(rest, counts[4:])
            a = nn.silu(apply(m, kinds[4], gate)) * apply(m, kinds[5], up)
            return h + apply(a, kinds[6], down)

        self._attend = mx.compile(attend)
        self._finish = mx.compile(finish)
        # The row counts met: each new one is a new trace of both functions (and on CUDA,
        # kernels built for it); the step trace (worker/steptrace.py) counts them. A
        # prefill's chunks (`project`, `close`) trace their own shapes, not counted here.
        self.row_counts: set[int] = set()

    def project(self, i: int, x: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        """Layer i's queries, keys and values (rows, heads, n, D) for x (rows, n, hidden) at
        positions from `offset` (each row's), as the step computes them: one compiled call
        (a prefill's layers, prefill_layers.py)."""
        return self._attend(x, offset, self.layers[i].attend)

    def close(self, i: int, x: mx.array, out: mx.array) -> mx.array:
        """Layer i's output for its input x (rows, n, hidden) and its attention's `out`
        (rows, n, heads, D): the rest of the layer, one compiled call."""
        return self._finish(x, out, self.layers[i].mlp)

    def __call__(self, tokens: mx.array, caches: Sequence[Any], masked: bool) -> mx.array:
        """Logits of one step: `tokens` (rows,) are each row's next input; `caches` the
        model's layer caches (BatchKVCache, or KVCache for one row); `masked`: some row is
        padded (mlx-lm's mask for the cache, else none, as MLX's fused kernel wants)."""
        self.row_counts.add(tokens.shape[0])
        x = self.embed(tokens[:, None])
        ragged = self.ragged if masked and type(caches[0]) is BatchKVCache else None
        mask = create_attention_mask(x, caches[0]) if masked and ragged is None else None
        # the rows' first real positions, where the kernel starts reading their keys
        starts: Any = None
        if ragged is not None:
            starts = ragged_attention.RaggedAttention.int32(caches[0].left_padding)
        offset = caches[0].offset
        if not isinstance(offset, mx.array):
            offset = mx.array(offset)
        for layer, cache in zip(self.layers, caches, strict=True):
            q, k, v = self._attend(x, offset, layer.attend)
            k, v = cache.update_and_fetch(k, v)
            if ragged is not None:
                out = ragged(q, k, v, starts)
            else:
                out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            x = self._finish(x, out, layer.mlp)
        return self.head(self.norm(x))[:, -1, :]


def wanted(setting: str) -> bool:
    """Whether `engine.decode_step = setting` runs this step on this process's device:
    "auto" where it was measured faster than mlx-lm's forward pass (MLX's CUDA backend and
    its CPU, docs/benchmarks.md), not on Metal, where it has not been measured."""
    if setting == "auto":
        return on_cpu() or on_cuda()
    return setting == "compiled"


def build(
    model: Any,
    fuse: bool = False,
    asked: bool = True,
    ragged: bool = False,
    ragged_asked: bool = False,
) -> DecodeStep | None:
    """The model's decode step, or None (and why, logged) where it keeps mlx-lm's. With
    `fuse` (`engine.decode_projections = "stacked"`), each layer's Q, K and V projections
    are one matrix, and so are its gate and up projections: fewer, larger multiplications;
    the model's own layers then read slices of those matrices, so the weights are not held
    twice (projections.py). `asked`: the configuration named the step (a model it does not
    know is then a warning; under "auto", only news). `ragged`: on MLX's CUDA backend, rows
    of different lengths attend through ragged_attention.py's kernel instead of MLX's
    attention with a mask (`ragged_asked`: the configuration named the kernel; where it
    cannot run, a warning)."""
    reason = unsupported(model)
    if reason is None:
        found = [_layer(block) for block in model.model.layers]
        if any(f is None for f in found):
            reason = "a decoder layer of a kind the step does not know"
        else:
            shapes = {f[0] for f in found if f is not None}
            if len(shapes) != 1:
                reason = "decoder layers of different shapes"
    if reason is not None:
        log.log(
            logging.WARNING if asked else logging.INFO,
            "decode step: mlx-lm's forward pass (%s)",
            reason,
        )
        return None
    shape = shapes.pop()
    attention = model.model.layers[0].self_attn
    dtype = model.model.norm.weight.dtype  # the model's activations'
    kernel = (
        ragged_attention.make(shape.heads, shape.kv_heads, shape.head_dim, attention.scale, dtype)
        if ragged
        else None
    )
    if ragged_asked and kernel is None:
        log.warning(
            "engine.decode_attention = 'kernel': MLX's attention with a mask (the kernel "
            "runs on MLX's CUDA backend only, for the layouts it takes; logged above)"
        )
    # The probe checks the step's own structure with MLX's attention: the kernel rounds
    # otherwise than MLX's masked attention (float32 throughout, as MLX's fused kernel does),
    # which drifts past the probe's tolerance over a model's layers in bfloat16; it was
    # checked against that attention, op for op, when made.
    step = DecodeStep(model, shape, [f[1] for f in found if f is not None])
    found.clear()  # the step holds the layers' arrays now, and only the step
    # On MLX's CPU the probe compiles the step's kernels (once a machine, cached on disk):
    # one process at a time, as the CPU warm-up does.
    with _lock():
        matches: bool | None = None
        for attempt in range(1, PROBE_ATTEMPTS + 1):
            try:
                matches = probe(model, step)
                break
            except Exception as exc:  # e.g. a kernel library another user's process half-wrote
                log.warning("decode step: probe attempt %d failed: %s", attempt, exc)
                time.sleep(0.5 * attempt)
    if matches is None:
        log.warning("decode step: mlx-lm's forward pass (the compiled step could not be built)")
        return None
    if not matches:
        log.warning(
            "decode step: mlx-lm's forward pass (the compiled step's logits differ from the "
            "model's on a probe: this mlx-lm's model computes something else)"
        )
        return None
    if fuse:
        # Stacked after the probe, which checked the step's structure with the projections
        # apart: cuBLAS multiplies a stacked matrix in another order than three separate
        # ones, and in bfloat16 that drifts past the probe's tolerance over a model's layers
        # (docs/lab/2026-12-gpu-runs.md); the stacked step's first layer is checked against the
        # apart step's here instead. The step's arrays are the weights that the stacking
        # replaces: dropped first, so that they are not held twice meanwhile.
        hidden = model.model.norm.weight.shape[0]
        inputs = _inputs(step.shape, hidden, dtype)
        with _lock():
            want = _outputs(step, inputs)
            del step
            step = _stacked(model, inputs, want)
    step.ragged = kernel
    fused = " (stacked projections)" if step.shape.fused else ""
    log.info("decode step: compiled, %d layers%s", len(step.layers), fused)
    return step


def _lock() -> contextlib.AbstractContextManager[Any]:
    """On MLX's CPU, kernels compile once a machine, cached on disk: one process at a time."""
    return compile_lock() if on_cpu() else contextlib.nullcontext()


Inputs = list[tuple[mx.array, mx.array, mx.array]]


def _inputs(shape: Shape, hidden: int, dtype: mx.Dtype) -> Inputs:
    """A layer's inputs, as the probe steps: 1 row (one offset) and 2 rows (one a row)."""
    out = []
    for rows, offset in ((1, mx.array(3)), (2, mx.array([3, 5]))):
        kx, ka = mx.random.split(mx.random.key(rows))
        x = mx.random.normal((rows, 1, hidden), key=kx).astype(dtype)
        attn = mx.random.normal((rows, shape.heads, 1, shape.head_dim), key=ka).astype(dtype)
        out.append((x, offset, attn))
    return out


def _outputs(step: DecodeStep, inputs: Inputs) -> list[mx.array]:
    """The first layer's Q, K, V, gate and up projections one by one, and its two compiled
    functions' outputs, on `inputs` (on MLX's CPU this compiles the step's kernels)."""
    shape, layer = step.shape, step.layers[0]
    kinds, counts = shape.projections, layer.counts
    out: list[mx.array] = []
    for x, offset, attn in inputs:
        if shape.fused:
            widths = [shape.heads * shape.head_dim, (shape.heads + shape.kv_heads) * shape.head_dim]
            stacked = apply(x, kinds[0], layer.attend[1 : 1 + counts[0]])
            out += mx.split(stacked, widths, axis=-1)
            stacked = apply(x, kinds[2], layer.mlp[counts[1] + 1 :][: counts[2]])
            out += mx.split(stacked, 2, axis=-1)
        else:
            qkv = split(layer.attend[1:], counts[:3])
            gate_up = split(layer.mlp[counts[3] + 1 :], counts[4:6])
            out += [apply(x, kinds[i], qkv[i]) for i in range(3)]
            out += [apply(x, kinds[4 + i], gate_up[i]) for i in range(2)]
        out += [*step._attend(x, offset, layer.attend), step._finish(x, attn, layer.mlp)]
    mx.eval(out)
    return out


def _stacked(model: Any, inputs: Inputs, want: list[mx.array]) -> DecodeStep:
    """The step over stacked projections, where its first layer computes `want` (the apart
    step's `_outputs`) within the rounding of another order of summation; else, logged, the
    step with them apart again over the model's weights (some or all of them now views of
    stacked arrays, equal to the originals bit for bit: nothing is held twice either way)."""
    try:
        found = [_layer(block, fuse=True) for block in model.model.layers]
        why = "a layer's projections did not stack (of different kinds, or views unequal)"
        if all(f is not None for f in found):
            layers = [f for f in found if f is not None]
            step = DecodeStep(model, layers[0][0], [f[1] for f in layers])
            got = _outputs(step, inputs)
            if all(agree(g, w) for g, w in zip(got, want, strict=True)):
                return step
            why = "stacked, they multiply otherwise than apart on this backend"
    except Exception as exc:  # e.g. out of memory for a layer's stacked copy
        why = f"stacking failed: {exc}"
    log.warning("decode step: projections kept apart (%s)", why)
    layers = [f for f in (_layer(block) for block in model.model.layers) if f is not None]
    # the same modules as the probed step's, some reading views now: each layer as before
    assert len(layers) == len(model.model.layers)
    return DecodeStep(model, layers[0][0], [f[1] for f in layers])


def unsupported(model: Any) -> str | None:
    """Why the model is not one whose layers this module knows, or None."""
    model_type = getattr(model, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model type {model_type!r}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers:
        return "no decoder layers where mlx-lm keeps them"
    if any(b is None for b in layers) or getattr(inner, "pipeline_size", 1) > 1:
        return "a pipeline shard of the model (its activations pass between ranks)"
    if any(getattr(block, "use_sliding", False) for block in layers):
        return "sliding-window layers"
    if not hasattr(inner, "embed_tokens"):
        return "no embed_tokens"
    if not isinstance(getattr(inner, "norm", None), nn.RMSNorm):
        return "a final norm of another kind"
    # One trace serves every layer with the first layer's RoPE: mlx-lm builds each layer's
    # from the same settings (the probe checks that they compute the same).
    ropes = {type(getattr(b.self_attn, "rope", None)) for b in layers}
    if len(ropes) != 1 or type(None) in ropes:
        return "layers with rotary embeddings of different kinds"
    return None


def probe(model: Any, step: DecodeStep) -> bool:
    """Whether the step's logits match the model's for a few steps after a short prefill:
    one row on a KVCache, then two rows of different lengths on a BatchKVCache (per-row
    offsets and the padding's mask), as the rows batch steps. On MLX's CPU this also
    compiles the kernels of those layouts, at load rather than on the first requests. (Two
    rows of one length differ only in passing no mask to MLX's attention, outside the
    compiled functions; 60 ms a load on the bench model, where all three cases took 130.)"""
    vocab = step.embed.weight.shape[0] if hasattr(step.embed, "weight") else 2
    layers = len(model.model.layers)

    def prefilled(lengths: list[int]) -> list[Any]:
        rows = []
        for n in lengths:
            caches = [KVCache() for _ in range(layers)]
            model((mx.arange(1, n + 1) % vocab).reshape(1, -1), cache=caches)
            rows.append(caches)
        if len(rows) == 1:
            return rows[0]
        return [BatchKVCache.merge([row[i] for row in rows]) for i in range(layers)]

    for lengths, masked in (([5], False), ([5, 3], True)):
        mine, theirs = prefilled(lengths), prefilled(lengths)
        token = mx.array([3 % vocab] * len(lengths))
        for _ in range(2):
            want = model(token[:, None], cache=theirs)[:, -1, :].astype(mx.float32)
            got = step(token, mine, masked=masked).astype(mx.float32)
            if want.shape != got.shape or not mx.allclose(got, want, rtol=2e-2, atol=2e-2).item():
                return False
            token = mx.argmax(want, axis=-1)
    return True
