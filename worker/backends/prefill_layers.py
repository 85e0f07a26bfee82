"""A prefill's decoder layers with the attention of prefill_attention.py.

mlx-lm's layers call MLX's attention with a mask array, which over several queries MLX's
CUDA backend runs unfused (docs/benchmarks.md). For the architectures decode_step.py knows
(llama, mistral, qwen2, qwen3: full attention in every layer), `PrefillLayers.run` computes
a layer as mlx-lm's does, through the layer's own modules (norms, projections, RoPE, MLP)
in the same order and dtypes, and only the attention itself is the kernel's: a query sees
its row's keys from the row's left padding up to its own position, read from the batch
cache's public `state` before the layer writes its keys. The cache is written through its
own `update_and_fetch` (a prefill bucket's view, prefill_buckets.py, or the batch cache),
so everything else sees the caches it always did. At load groups.py's first-token probe
checks these layers, with MLX's attention in the kernel's place, against the model's
forward pass, and prefill_attention.py checks the kernel against MLX's attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

Attend = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], mx.array]


class PrefillLayers:
    """`run(block, x, cache)`: the decoder layer `block` over x (rows, n, hidden) with its
    batch cache (or a view of it), attention by `attend(q, k, v, base, starts)` (rows, n,
    heads, D)."""

    def __init__(self, attend: Attend, head_norms: bool) -> None:
        self.attend = attend
        self.head_norms = head_norms  # qwen3: per-head norms of queries and keys
        self._base: tuple[int, mx.array] | None = None  # the last chunk's start, as an array

    def base(self, end: int) -> mx.array:
        """`end` as the kernel's input: made once a chunk, not once a layer."""
        if self._base is None or self._base[0] != end:
            self._base = (end, mx.array([end], dtype=mx.int32))
        return self._base[1]

    def run(self, block: Any, x: mx.array, cache: Any) -> mx.array:
        attn = block.self_attn
        h = block.input_layernorm(x)
        rows, n, _ = h.shape
        q = attn.q_proj(h).reshape(rows, n, attn.n_heads, -1)
        k = attn.k_proj(h).reshape(rows, n, attn.n_kv_heads, -1)
        v = attn.v_proj(h).reshape(rows, n, attn.n_kv_heads, -1)
        if self.head_norms:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(k, offset=cache.offset)
        _, _, _, left, end = cache.state  # the positions before this chunk's, its padding
        keys, values = cache.update_and_fetch(k, v)
        starts = left if left.dtype == mx.int32 else left.astype(mx.int32)
        out = self.attend(q, keys, values, self.base(end), starts)
        h = x + attn.o_proj(out.reshape(rows, n, -1))
        return h + block.mlp(block.post_attention_layernorm(h))


def takes(caches: list[Any]) -> bool:
    """Whether these caches hand `run` what it reads: mlx-lm's batch cache's state (keys,
    values, offset, left padding, positions written), directly or through a view."""
    if not caches:
        return False
    state = caches[0].state
    return isinstance(state, tuple) and len(state) == 5 and isinstance(state[4], int)
