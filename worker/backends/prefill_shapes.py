"""Prefill shapes: a joining group's prefill padded to a few shapes (rows batch, rows.py).

On MLX's CUDA backend a prefill at a shape the process has not met costs 17-60 ms more than
at a known one (cuBLASLt's plans, CUDA graphs, the allocator: docs/benchmarks.md), and a
server's groups rarely repeat one: the rows, the prompt positions and the cached prefix's
length all vary from group to group. With `engine.prefill_shapes = "bucketed"` (the default
on MLX's CUDA backend) a group short enough to pad is padded:
- its positions to a multiple of POSITION_BUCKET (right padding, as for prompts of
  different lengths: the batch's finalize moves it to the left);
- its keys after its first chunk (the longest cached prefix plus the chunk) to a multiple of
  KEY_BUCKET, with a dead row whose cache holds that many zero positions less the chunk (the
  other rows are left-padded to it, as they are to the longest prefix);
- its rows to ROW_BUCKETS, with dead rows of padding tokens.
Dead rows leave at the join (`BatchKVCache.filter`, which also drops the left padding every
row left has), so what decodes is what would have without them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

POSITION_BUCKET = 32
KEY_BUCKET = 256
SMALL_ROWS = (1, 2, 4, 8)  # then multiples of 8
# Padding costs compute and memory in proportion to the positions: a group is padded only
# while its longest prompt has at most this many positions to run and its keys reach at most
# MAX_KEYS (a long prefill pays a new shape's cost once over a long pass).
MAX_POSITIONS = 1024
MAX_KEYS = 8192


def row_bucket(rows: int) -> int:
    """The rows a group of `rows` is padded to: 1, 2, 4, 8, then multiples of 8."""
    for size in SMALL_ROWS:
        if rows <= size:
            return size
    return -(-rows // 8) * 8


def position_bucket(positions: int) -> int:
    return -(-positions // POSITION_BUCKET) * POSITION_BUCKET


def key_padding(prefix: int, chunk: int) -> int:
    """The cached length a dead row needs for the keys after a first chunk of `chunk`
    positions over a longest prefix of `prefix` to make a multiple of KEY_BUCKET; 0 when
    they do already."""
    keys = -(-(prefix + chunk) // KEY_BUCKET) * KEY_BUCKET
    return 0 if keys == prefix + chunk else keys - chunk


def padded(rests: list[list[int]], caches: list[list[Any]], chunk_size: int) -> Any:
    """The dead rows a group (its rows' tokens to prefill and caches) is padded with: a
    list of (tokens, caches) for them, and the positions every row is padded to; None when
    the group is too long to pad."""
    longest = max(len(r) for r in rests)
    positions = position_bucket(longest)
    prefix = max(c[0].offset for c in caches)
    first = min(chunk_size, positions)
    if positions > MAX_POSITIONS or prefix + first > MAX_KEYS or positions == 0:
        return None
    lead = key_padding(prefix, first) if prefix else 0
    rows = len(rests) + (lead > 0)
    dead = [([0] * positions, _zeros(caches, 0)) for _ in range(row_bucket(rows) - len(rests))]
    if lead:
        dead[0] = ([0] * positions, _zeros(caches, lead))
    return dead, positions


def _zeros(caches: list[list[Any]], length: int) -> list[Any]:
    """One cache a layer holding `length` zero positions (shaped as a row of `caches`)."""
    out = []
    for layer in range(len(caches[0])):
        cache = KVCache()
        if length:
            keys = next(c[layer].keys for c in caches if c[layer].keys is not None)
            values = next(c[layer].values for c in caches if c[layer].values is not None)
            _, heads, _, dk = keys.shape
            cache.update_and_fetch(
                mx.zeros((1, heads, length, dk), keys.dtype),
                mx.zeros((1, values.shape[1], length, values.shape[3]), values.dtype),
            )
        out.append(cache)
    return out
