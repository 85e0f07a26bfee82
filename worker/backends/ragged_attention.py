"""One-token attention over rows of different lengths, as one CUDA kernel.

In a served batch the rows started at different times, so their KV lengths differ: mlx-lm's
batch cache pads each row on the left, and its attention mask hides the padding. Given a
mask array, MLX's CUDA backend does not use its fused one-token attention kernel: each layer
then runs a matrix product for the scores, the mask, a softmax and a second product, and the
host encodes each of them on every step (docs/benchmarks.md: every served step from c = 8 up
is masked). This kernel reads each row's keys from its first real position (the cache's
public `left_padding`) to the end, so it needs no mask, and does it all in one launch.

One thread block per (row, KV head) computes the attention of every query head that shares
that KV head (grouped-query attention reads the keys and values once). Its warps take the
keys in turn, each lane holding `D / 32` of a key's dimensions; scores and the softmax are
kept in float32 with a running maximum (the online softmax), and the warps' partial sums are
merged in shared memory at the end. Written with `mx.fast.cuda_kernel` (MLX's public API for
custom kernels, compiled on first use by NVRTC); MLX has no CUDA device to run it on any other
backend, where `make` returns None.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from worker.device import on_cuda

log = logging.getLogger(__name__)

WARPS = 8  # warps a block: 256 threads
SHARED_LIMIT = 48 * 1024  # static shared memory a block may declare

SOURCE = """
    constexpr int E = D / 32;
    constexpr float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    const int b = blockIdx.z;
    const int g = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int length = k_shape[2];
    const int first = starts[b];
    const float sc = scale[0];

    float qv[R][E];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const T* qp = q + b * q_strides[0] + (g * R + r) * q_strides[1];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            qv[r][e] = static_cast<float>(qp[(lane * E + e) * q_strides[3]]) * sc;
        }
    }
    float m[R];
    float l[R];
    float acc[R][E];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
        for (int e = 0; e < E; ++e) acc[r][e] = 0.0f;
    }
    const T* kb = k + b * k_strides[0] + g * k_strides[1];
    const T* vb = v + b * v_strides[0] + g * v_strides[1];
    for (int j = first + warp; j < length; j += WARPS) {
        float x[E];
        float y[E];
        const T* kr = kb + j * k_strides[2];
        const T* vr = vb + j * v_strides[2];
#pragma unroll
        for (int e = 0; e < E; ++e) {
            x[e] = static_cast<float>(kr[(lane * E + e) * k_strides[3]]);
            y[e] = static_cast<float>(vr[(lane * E + e) * v_strides[3]]);
        }
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float t = 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) t += qv[r][e] * x[e];
            s[r] = t;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
            for (int r = 0; r < R; ++r) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float mn = fmaxf(m[r], s[r]);
            const float corr = expf(m[r] - mn);
            const float p = expf(s[r] - mn);
            l[r] = l[r] * corr + p;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[r][e] = acc[r][e] * corr + p * y[e];
            m[r] = mn;
        }
    }

    __shared__ float part_m[WARPS][R];
    __shared__ float part_l[WARPS][R];
    __shared__ float part_acc[WARPS][R][D];
    for (int r = 0; r < R; ++r) {
        if (lane == 0) {
            part_m[warp][r] = m[r];
            part_l[warp][r] = l[r];
        }
        for (int e = 0; e < E; ++e) part_acc[warp][r][lane * E + e] = acc[r][e];
    }
    __syncthreads();
    const int heads = q_shape[1];
    for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
        const int r = i / D;
        const int d = i - r * D;
        float top = NEG_INF;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, part_m[w][r]);
        float total = 0.0f;
        float o = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            if (part_m[w][r] == NEG_INF) continue;
            const float c = expf(part_m[w][r] - top);
            total += part_l[w][r] * c;
            o += part_acc[w][r][d] * c;
        }
        out[(static_cast<int64_t>(b) * heads + g * R + r) * D + d] = static_cast<T>(o / total);
    }
"""


class RaggedAttention:
    """`attend(q, k, v, starts)`: softmax(q k^T * scale) v for one query position a row,
    over each row's keys from `starts[row]` on. q is (rows, heads, 1, D); k and v are
    (rows, kv_heads, length, D), views of the cache's buffers (read through their strides,
    not copied); starts (rows,) int32 (`int32` makes them so, once a step)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.group = heads // kv_heads
        self.scale = mx.array([scale], dtype=mx.float32)
        self._templates: dict[mx.Dtype, list[tuple[str, Any]]] = {}  # by the queries' dtype
        self.kernel = mx.fast.cuda_kernel(
            name="ragged_decode_attention",
            input_names=["q", "k", "v", "starts", "scale"],
            output_names=["out"],
            source=SOURCE,
            ensure_row_contiguous=False,
        )

    @staticmethod
    def int32(starts: mx.array) -> mx.array:
        return starts if starts.dtype == mx.int32 else starts.astype(mx.int32)

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, starts: mx.array) -> mx.array:
        threads = WARPS * 32
        template = self._templates.get(q.dtype)
        if template is None:
            template = [("T", q.dtype), ("D", self.head_dim), ("R", self.group), ("WARPS", WARPS)]
            self._templates[q.dtype] = template
        out: mx.array = self.kernel(  # type: ignore[operator]
            inputs=[q, k, v, starts, self.scale],
            template=template,
            grid=(threads, self.kv_heads, q.shape[0]),
            threadgroup=(threads, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )[0]
        return out


def fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this layout: whole query groups, dimensions a multiple of
    the warp's 32 lanes, and the warps' partial sums within a block's shared memory."""
    if kv_heads <= 0 or heads % kv_heads or head_dim % 32 or head_dim > 256:
        return False
    group = heads // kv_heads
    return WARPS * group * (head_dim + 2) * 4 <= SHARED_LIMIT


def make(
    heads: int, kv_heads: int, head_dim: int, scale: float, dtype: mx.Dtype = mx.bfloat16
) -> RaggedAttention | None:
    """The kernel for this layout on MLX's CUDA backend, checked in `dtype` (the model's),
    else None (another backend, a layout it does not take, a kernel that fails its check:
    the caller keeps MLX's attention with a mask)."""
    if not on_cuda():
        return None
    if not fits(heads, kv_heads, head_dim):
        layout = f"{heads} heads, {kv_heads} KV heads of {head_dim}"
        log.info("ragged attention: MLX's masked attention (%s)", layout)
        return None
    try:
        attend = RaggedAttention(heads, kv_heads, head_dim, scale)
        agrees = _agrees(attend, scale, dtype)
    except Exception as exc:  # a kernel that does not build keeps MLX's attention
        log.warning("ragged attention: MLX's masked attention (the kernel failed: %s)", exc)
        return None
    if not agrees:
        log.warning("ragged attention: MLX's masked attention (the kernel's output differs)")
        return None
    return attend


def _agrees(attend: RaggedAttention, scale: float, dtype: mx.Dtype) -> bool:
    """Whether the kernel computes `reference` on rows of three lengths, the keys and values
    read as views inside larger buffers (as the cache hands them over)."""
    key = mx.random.key(0)
    kq, kk, kv = mx.random.split(key, 3)
    shape = (3, attend.kv_heads, 16, attend.head_dim)
    q = mx.random.normal((3, attend.heads, 1, attend.head_dim), key=kq).astype(dtype)
    k = mx.random.normal(shape, key=kk).astype(dtype)[..., 2:13, :]
    v = mx.random.normal(shape, key=kv).astype(dtype)[..., 2:13, :]
    starts = mx.array([0, 4, 10], dtype=mx.int32)
    got = attend(q, k, v, starts).astype(mx.float32)
    want = reference(q, k, v, starts, scale).astype(mx.float32)
    return bool(mx.allclose(got, want, rtol=2e-2, atol=2e-2).item())


def reference(q: mx.array, k: mx.array, v: mx.array, starts: mx.array, scale: float) -> Any:
    """What the kernel computes, with MLX's own attention and a mask built from `starts`
    (tests and the GPU check compare the two)."""
    length = k.shape[2]
    mask = mx.arange(length)[None, :] >= starts[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask[:, None, None, :])
