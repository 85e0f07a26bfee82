"""A prefill's attention over a cached prefix as one tensor-core kernel, on MLX's CUDA backend.

A cached agent turn prefills a few hundred new tokens over thousands of cached positions,
and its attention is most of the forward pass (docs/benchmarks.md: 9 of 12 ms at the 1B
shape on an H100). Over several queries MLX's CUDA backend runs attention either through
cuDNN, which builds a graph for every new shape (64-82 ms the first time) and takes a mask
array as a bias, or composed of separate operations: a product for the scores, the mask, a
float32 softmax and a second product, each a pass over a (queries x keys) matrix.

Here it is one kernel of our own (`mx.fast.cuda_kernel`, compiled by NVRTC on first use),
in the manner of FlashAttention-2: a block takes 64 queries of one head, its four warps 16
each, and walks the keys 64 at a time through shared memory; each warp computes its scores
with the tensor cores (`mma.sync` m16n8k16, bfloat16 or float16 in, float32 out), keeps a
running maximum and sum per query (the online softmax, in float32), and adds the tile's
probabilities times the values into float32 accumulators held in registers. Keys and
values come into shared memory 16 bytes a load, every load of a tile issued before any is
stored (two bytes a load where their rows are not whole and aligned). No scores matrix is
written, no mask array is built (a query sees the keys from its row's first real
position, the cache's left padding, up to its own position, read from two integers), and a
new length is no new graph nor kernel: the lengths are arguments.

`attend(q, k, v, base, starts)`: q (rows, heads, n, D); keys and values (rows, kv_heads,
width, D), views of the cache's buffers read through their strides; query i of row b sees
keys starts[b] <= j <= base + i (and j < width). The output is (rows, n, heads, D): the
layout the output projection reads, with no transpose. The CUDA sources are in
prefill_attention_cuda.py.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from worker.backends.prefill_attention_cuda import COMBINE_SOURCE, HEADER, SOURCE, SPLIT_SOURCE
from worker.device import on_cuda

log = logging.getLogger(__name__)

QUERIES = 64  # a block's queries (four warps of 16)
THREADS = 128
DTYPES = (mx.bfloat16, mx.float16)  # the tensor cores' inputs here
# "auto" takes the kernel for heads of the sizes it was measured faster at, on an H100:
# Llama-3.2-1B's 64 and Llama-3.1-8B's 128 dimensions (docs/benchmarks.md)
AUTO_HEAD_DIMS = (64, 128)


class PrefillAttention:
    """`attend(q, k, v, base, starts)`: softmax(q k^T * scale) v over each query's visible
    keys (module docstring), as (rows, n, heads, D).

    A block takes 64 queries of one head. Where that makes too few blocks to keep the GPU
    busy (a hundred new tokens over thousands of cached keys: 2 blocks a head, each walking
    every key), each block's keys are split over several blocks instead, as FlashDecoding
    does: each writes its share's attention and log-sum in float32, and a second kernel
    weighs them together."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.group = heads // kv_heads
        self.scale = mx.array([scale], dtype=mx.float32)
        self._templates: dict[mx.Dtype, list[tuple[str, Any]]] = {}
        inputs = ["q", "k", "v", "starts", "base", "scale"]
        self.kernel = mx.fast.cuda_kernel(
            name="prefill_flash_attention",
            input_names=inputs,
            output_names=["out"],
            source=SOURCE,
            header=HEADER,
            ensure_row_contiguous=False,
        )
        self.split_kernel = mx.fast.cuda_kernel(
            name="prefill_flash_attention_split",
            input_names=inputs,
            output_names=["parts", "sums"],
            source=SPLIT_SOURCE,
            header=HEADER,
            ensure_row_contiguous=False,
        )
        self.combine = mx.fast.cuda_kernel(
            name="prefill_flash_attention_combine",
            input_names=["parts", "sums"],
            output_names=["out"],
            source=COMBINE_SOURCE,
        )

    def __call__(
        self, q: mx.array, k: mx.array, v: mx.array, base: mx.array, starts: mx.array
    ) -> mx.array:
        rows, heads, n, dim = q.shape
        if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"prefill attention: {q.dtype} queries over {k.dtype} keys")
        template = self._templates.get(q.dtype)
        if template is None:
            template = [("T", q.dtype), ("D", dim), ("R", self.group), ("THREADS", THREADS)]
            self._templates[q.dtype] = template
        tiles = -(-n // QUERIES)
        parts = splits(tiles * heads * rows, k.shape[2])
        inputs = [q, k, v, starts, base, self.scale]
        grid = (tiles * parts * THREADS, heads, rows)
        if parts == 1:
            out: mx.array = self.kernel(  # type: ignore[operator]
                inputs=inputs,
                template=template,
                grid=grid,
                threadgroup=(THREADS, 1, 1),
                output_shapes=[(rows, n, heads, dim)],
                output_dtypes=[q.dtype],
            )[0]
            return out
        shares, sums = self.split_kernel(  # type: ignore[operator]
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(parts, rows, n, heads, dim), (parts, rows, n, heads)],
            output_dtypes=[mx.float32, mx.float32],
        )
        cells = rows * n * heads * dim
        out = self.combine(  # type: ignore[operator]
            inputs=[shares, sums],
            template=[("T", q.dtype), ("D", dim)],
            grid=(-(-cells // 256) * 256, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(rows, n, heads, dim)],
            output_dtypes=[q.dtype],
        )[0]
        return out


SPLIT_BELOW = 128  # blocks under which a tile's keys are split (at 128 and up it lost)
BLOCKS = 528  # blocks that keep an H100's or H200's 132 multiprocessors busy, four each
SHARE = 256  # the fewest keys a split block takes


def splits(blocks: int, keys: int) -> int:
    """Over how many blocks each query tile's keys are split: none from SPLIT_BELOW blocks
    up (on an H100 the parts' writes and the second kernel cost more than the added blocks
    gained at 128 and 256 blocks), else enough for BLOCKS blocks in all, each taking at
    least SHARE keys (faster at 32 and 64 blocks: docs/benchmarks.md)."""
    if blocks >= SPLIT_BELOW:
        return 1
    return max(1, min(-(-BLOCKS // blocks), keys // SHARE))


def fits(heads: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes this layout: whole query groups, head dimensions a multiple
    of 32 up to 128 (a block's loads, shared memory), a dtype the tensor cores take."""
    if kv_heads <= 0 or heads % kv_heads:
        return False
    return head_dim % 32 == 0 and 32 <= head_dim <= 128 and dtype in DTYPES


def reference(
    q: mx.array, k: mx.array, v: mx.array, base: int | mx.array, starts: mx.array, scale: float
) -> mx.array:
    """What the kernel computes, with MLX's own attention and the mask it implies, in the
    kernel's output layout (tests and the load-time check compare the two)."""
    n, width = q.shape[2], k.shape[2]
    cols = mx.arange(width)
    mask = (cols[None] <= (base + mx.arange(n))[:, None])[None, None] & (
        cols[None, None, None] >= starts[:, None, None, None]
    )
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3)


def make(
    heads: int, kv_heads: int, head_dim: int, scale: float, dtype: mx.Dtype
) -> PrefillAttention | None:
    """The kernel for this layout on MLX's CUDA backend, checked in `dtype` (the model's)
    against `reference`; else None (another backend, a layout it does not take, a kernel
    that does not build or agree: the caller keeps MLX's attention)."""
    if not on_cuda():
        log.info("prefill attention: MLX's (the kernel runs on MLX's CUDA backend only)")
        return None
    if not fits(heads, kv_heads, head_dim, dtype):
        layout = f"{heads} heads, {kv_heads} KV heads of {head_dim}, {dtype}"
        log.info("prefill attention: MLX's (%s)", layout)
        return None
    try:
        attend = PrefillAttention(heads, kv_heads, head_dim, scale)
        off = disagreement(attend, scale, dtype)
    except Exception as exc:  # a kernel that does not build keeps MLX's attention
        log.warning("prefill attention: MLX's (the kernel failed: %s)", exc)
        return None
    if off is not None:
        log.warning("prefill attention: MLX's (the kernel's output differs: %s)", off)
        return None
    return attend


CASES = (  # rows, queries, base, width, starts, contiguous keys: what the check runs
    (1, 5, 0, 5, (0,), True),  # a short prompt alone
    (3, 70, 130, 256, (0, 7, 129), True),  # left padding, a tile and a bit, unwritten keys
    (2, 64, 64, 256, (0, 40), True),  # a chunk inside a key bucket
    (1, 60, 1000, 1280, (0,), True),  # keys split over blocks (`splits`) up to 127 heads
    (2, 60, 1000, 1280, (0, 300), True),  # the same with left padding (up to 63 heads)
    (2, 70, 130, 256, (0, 9), False),  # keys and values not contiguous: two bytes a load
)


def disagreement(attend: PrefillAttention, scale: float, dtype: mx.Dtype) -> str | None:
    """None where the kernel computes `reference` on CASES, the keys and values read as
    views inside larger buffers (as the cache hands them over), or transposed; else where
    it differs."""
    keys = mx.random.split(mx.random.key(0), 3)
    for rows, n, base, width, starts, contiguous in CASES:
        dim, kvh = attend.head_dim, attend.kv_heads
        q = mx.random.normal((rows, attend.heads, n, dim), key=keys[0]).astype(dtype)
        if contiguous:
            shape = (rows, kvh, width + 32, dim)
            k = mx.random.normal(shape, key=keys[1]).astype(dtype)[..., :width, :]
            v = mx.random.normal(shape, key=keys[2]).astype(dtype)[..., :width, :]
        else:
            shape = (rows, kvh, dim, width)
            k = mx.swapaxes(mx.random.normal(shape, key=keys[1]).astype(dtype), -1, -2)
            v = mx.swapaxes(mx.random.normal(shape, key=keys[2]).astype(dtype), -1, -2)
        first = mx.array(starts, dtype=mx.int32)
        got = attend(q, k, v, mx.array([base], dtype=mx.int32), first).astype(mx.float32)
        want = reference(q, k, v, base, first, scale).astype(mx.float32)
        if not mx.allclose(got, want, rtol=2e-2, atol=2e-2).item():
            worst = mx.max(mx.abs(got - want)).item()
            layout = "" if contiguous else " (transposed keys)"
            return f"{rows} rows of {n} queries over {width} keys{layout}: off by up to {worst:.3g}"
    return None
