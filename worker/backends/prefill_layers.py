"""A prefill's decoder layers with the attention of prefill_attention.py.

mlx-lm's layers call MLX's attention with a mask array, which over several queries MLX's
CUDA backend runs unfused (docs/benchmarks.md). For the architectures decode_step.py knows
(llama, mistral, qwen2, qwen3: full attention in every layer), `PrefillLayers.run` computes
a layer as mlx-lm's does, through the layer's own modules (norms, projections, RoPE, MLP) in
the same order and dtypes, and only the attention itself is the kernel's: a query sees its
row's keys from the row's left padding up to its own position, read from the batch cache's
public `state` before the layer writes its keys. The cache is written through its own
`update_and_fetch` (a prefill bucket's view, prefill_buckets.py, or the batch cache), so
everything else sees the caches it always did. Where the compiled decode step runs
(decode_step.py), the layer around the attention is its two compiled functions instead of
the modules' calls, over the chunk's positions: the same operations, fewer for MLX to build
and launch (a cached turn's forward pass 1-14 % sooner on an H200, docs/benchmarks.md). At
load groups.py's first-token probe checks these layers, with MLX's attention in the kernel's
place, against the model's forward pass, and prefill_attention.py checks the kernel against
MLX's attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from worker.backends.decode_step import DecodeStep

Attend = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], mx.array]


class PrefillLayers:
    """`run(i, block, x, cache)`: decoder layer i (`block`) over x (rows, n, hidden) with its
    batch cache (or a view of it), attention by `attend(q, k, v, base, starts)` (rows, n,
    heads, D)."""

    def __init__(self, attend: Attend, head_norms: bool, step: DecodeStep | None = None) -> None:
        self.attend = attend
        self.head_norms = head_norms  # qwen3: per-head norms of queries and keys
        # the compiled decode step: its two traced functions compute the layer around the
        # attention for a chunk too (fewer operations to build and run than the modules')
        self.step = step
        self._base: tuple[int, mx.array] | None = None  # the last chunk's start, as an array

    def base(self, end: int) -> mx.array:
        """`end` as the kernel's input: made once a chunk, not once a layer."""
        if self._base is None or self._base[0] != end:
            self._base = (end, mx.array([end], dtype=mx.int32))
        return self._base[1]

    def run(self, i: int, block: Any, x: mx.array, cache: Any) -> mx.array:
        """Layer i (`block`) over x."""
        step, attn = self.step, block.self_attn
        offset = cache.offset
        if step is not None:
            q, k, v = step.project(i, x, offset)  # the batch cache's: an array
        else:
            q, k, v = self._project(attn, block.input_layernorm(x), offset)
        _, _, _, left, end = cache.state  # the positions before this chunk's, its padding
        keys, values = cache.update_and_fetch(k, v)
        starts = left if left.dtype == mx.int32 else left.astype(mx.int32)
        out = self.attend(q, keys, values, self.base(end), starts)
        if step is not None:
            return step.close(i, x, out)
        h = x + attn.o_proj(out.reshape(*x.shape[:2], -1))
        return h + block.mlp(block.post_attention_layernorm(h))

    def _project(self, attn: Any, h: mx.array, offset: Any) -> tuple[mx.array, ...]:
        """The layer's own modules: queries, keys and values (rows, heads, n, D)."""
        rows, n, _ = h.shape
        q = attn.q_proj(h).reshape(rows, n, attn.n_heads, -1)
        k = attn.k_proj(h).reshape(rows, n, attn.n_kv_heads, -1)
        v = attn.v_proj(h).reshape(rows, n, attn.n_kv_heads, -1)
        if self.head_norms:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def takes(caches: list[Any]) -> bool:
    """Whether these caches hand `run` what it reads: mlx-lm's batch cache's state (keys,
    values, offset, left padding, positions written), directly or through a view."""
    if not caches:
        return False
    state = caches[0].state
    return isinstance(state, tuple) and len(state) == 5 and isinstance(state[4], int)
