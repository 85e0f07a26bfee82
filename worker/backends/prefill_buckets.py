"""Prefills at a few shapes (`engine.prefill_shapes`, "buckets" or "auto" under CUDA; the rows
batch, rows.py).

On MLX's CUDA backend an operation at a shape met for the first time costs far more than at a
known one (cuBLASLt's plans, CUDA graphs: docs/benchmarks.md measured a cached agent turn's
prefill at 17-36 ms the first time against 8-12 after). A served prefill rarely repeats a
shape: its attention runs over every key before it (the cached prefix and the new tokens),
so a conversation's next turn, one token longer or a thousand, is a new shape, and so is
each new prompt length. Here a group's prefill runs at rounded shapes instead:
- its tokens are padded at the end to a bucket (`bucket(n, TOKEN_BUCKET)`): causal attention
  keeps a real token from seeing the padding after it, and the cache drops the padding's
  KV once the prompts are in (`BatchKVCache.trim`);
- its attention runs over the keys up to a bucket of positions (`bucket(n, KEY_BUCKET)`),
  the cache's buffer grown to that length, the positions not written yet masked out.
Buckets are multiples of their least size up to four times it, then four a doubling (at
most a quarter more than asked), so a conversation growing turn after turn meets a new
shape every few turns rather than at each. The rest of the batch is unchanged: the cache
holds the same KV at the same positions.

Through mlx-lm's public cache API only: the batch cache's `state` (read and set), `trim`,
`offset`; the model finds `update_and_fetch` and `make_mask` on the view, as on a cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from worker.backends.unpadded import CacheView
from worker.device import on_cuda

TOKEN_BUCKET = 64  # a prefill chunk's positions
KEY_BUCKET = 256  # the positions attention runs over (mlx-lm's batch cache grows by 256)


def bucket(n: int, least: int) -> int:
    """`n` rounded up: to a multiple of `least` up to 4 * least, then to one of four steps
    between powers of two (a quarter of the power below n)."""
    if n <= 4 * least:
        return max(least, -(-n // least) * least)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def padded_width(width: int, chunk: int) -> int:
    """A group's prefill width with its last chunk padded to a bucket (chunks of `chunk`
    positions before it are left as they are: prefill_step_size is one shape already)."""
    full = (width - 1) // chunk * chunk if width > chunk else 0
    return full + min(chunk, bucket(width - full, TOKEN_BUCKET))


class BucketedCache(CacheView):
    """A batch cache as a prefill's forward pass sees it: keys and values written as the
    cache writes them, handed to attention up to a bucket of positions, with the mask that
    hides what lies past each query (and each row's left padding)."""

    __slots__ = ()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v, offset, left, end = self.cache.state
        n = keys.shape[2]
        written = end + n
        width = bucket(written, KEY_BUCKET)
        if k is None or k.shape[2] < width:
            grow_k = mx.zeros((*keys.shape[:2], width - end, keys.shape[3]), keys.dtype)
            grow_v = mx.zeros((*values.shape[:2], width - end, values.shape[3]), values.dtype)
            if k is None:
                k, v = grow_k, grow_v
            else:
                k = mx.concatenate([k[..., :end, :], grow_k], axis=2)
                v = mx.concatenate([v[..., :end, :], grow_v], axis=2)
        k[..., end:written, :] = keys
        v[..., end:written, :] = values
        self.cache.state = (k, v, offset + n, left, written)
        return k[..., :width, :], v[..., :width, :]

    def make_mask(
        self, N: int, return_array: bool = True, window_size: int | None = None, **_: Any
    ) -> mx.array:
        """(rows, 1, N, bucket) booleans: a query sees the keys at or before its position
        (within `window_size` of it, when the model asks for a window) and at or after its
        row's left padding."""
        _, _, _, left, end = self.cache.state
        cols = mx.arange(bucket(end + N, KEY_BUCKET))[None]
        rows = mx.arange(end, end + N)[:, None]
        mask = rows >= cols
        if window_size is not None:
            mask = mask & (rows < cols + window_size)
        return mask & (left[:, None, None, None] <= cols)


def wanted(setting: str) -> bool:
    """Whether `engine.prefill_shapes` puts prefills at buckets here: "auto" does on MLX's
    CUDA backend, where it was measured (docs/benchmarks.md), not on a CPU (more to compute,
    no cost of a new shape to save) nor on Metal (not measured)."""
    if setting == "auto":
        return on_cuda()
    return setting == "buckets"


def views(caches: list[Any]) -> list[BucketedCache] | None:
    """Views of a group's caches for its prefill, or None where they are not mlx-lm's plain
    batch cache of the state this module reads (keys, values, offset, left padding, end)."""
    from mlx_lm.models.cache import BatchKVCache

    if not caches or any(type(c) is not BatchKVCache for c in caches):
        return None
    state = caches[0].state
    if not isinstance(state, tuple) or len(state) != 5 or not isinstance(state[4], int):
        return None
    return [BucketedCache(c) for c in caches]
