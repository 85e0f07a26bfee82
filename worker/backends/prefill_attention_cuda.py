"""The CUDA sources of prefill_attention.py's kernels, as `mx.fast.cuda_kernel` takes them: a
header of helpers (the tensor cores' `mma.sync` m16n8k16 for bfloat16 and float16, packing),
the attention's body, its two ends (the output written whole, or a split block's part and
log-sum), and the kernel that weighs split parts together. MLX puts each body in a function
of the inputs (with `<name>_shape` and `<name>_strides`) and outputs named where the kernel
is made, templated on the names given at each call (T, D, R, THREADS)."""

from __future__ import annotations

# the tensor cores' product and packing for one input type: its name in CUDA, in the PTX
# instruction, and the intrinsic that packs two floats into its pair type
MMA = """
template <> struct gw_mma<{T}> {{
  static __device__ __forceinline__ void run(
      float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {{
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 "
        "{{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }}
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {{
    {pair} v = {pack}(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }}
}};"""

HEADER = (
    """
template <typename T> struct gw_mma;"""
    + MMA.format(T="__nv_bfloat16", ptx="bf16", pair="__nv_bfloat162", pack="__floats2bfloat162_rn")
    + MMA.format(T="__half", ptx="f16", pair="__half2", pack="__floats2half2_rn")
    + """
// two 16-bit values as one register, the first in the low half (the operands' order)
template <typename T>
__device__ __forceinline__ uint32_t gw_bits(const T* p, bool lo_in, const T* q, bool hi_in) {
  const uint32_t lo = lo_in ? *reinterpret_cast<const unsigned short*>(p) : 0u;
  const uint32_t hi = hi_in ? *reinterpret_cast<const unsigned short*>(q) : 0u;
  return lo | (hi << 16);
}
"""
)

BODY = """
    constexpr int BQ = 64;
    constexpr int BK = 64;
    constexpr int DP = D / 2;       // a key's pairs of dimensions
    constexpr int KS = DP + 4;      // a key's row in shared memory, in pairs (padded: no conflicts)
    constexpr int VS = BK / 2 + 4;  // a dimension's row of pairs of keys (padded)
    constexpr float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    __shared__ uint32_t ks[BK * KS];
    __shared__ uint32_t vs[D * VS];

    const int tiles = (q_shape[2] + BQ - 1) / BQ;
    const int splits = gridDim.x / tiles;  // blocks a tile's keys are split over
    const int tile = blockIdx.x / splits;
    const int part = blockIdx.x - tile * splits;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int g = h / R;
    const int n = q_shape[2];
    const int heads = q_shape[1];
    const int width = k_shape[2];
    const int first = starts[b];
    const int origin = base[0];
    const float sl2 = scale[0] * 1.4426950408889634f;
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int gid = lane >> 2;
    const int tig = lane & 3;
    const int q0 = tile * BQ + warp * 16;

    // the warp's 16 queries, the A operand: register c holds row gid (+8 when c is odd),
    // dimensions 2 tig, 2 tig + 1 (+8 from c = 2)
    uint32_t qa[D / 16][4];
    const T* qb = q + b * q_strides[0] + h * q_strides[1];
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int row = q0 + gid + (c & 1) * 8;
        const int col = s * 16 + (c >> 1) * 8 + tig * 2;
        const T* p = qb + row * q_strides[2] + col * q_strides[3];
        qa[s][c] = gw_bits<T>(p, row < n, p + q_strides[3], row < n);
      }
    }
    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
      for (int c = 0; c < 4; ++c) o[dn][c] = 0.0f;
    }
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;  // rows gid and gid + 8
    const int p0 = origin + q0 + gid;
    const int p1 = p0 + 8;
    // this block's keys: its share of the tile's, whole key tiles each
    const int begin = (first / BK) * BK;
    const int reach = min(width, origin + n);  // past the last key any query sees
    const int share = ((reach - begin + splits - 1) / splits + BK - 1) / BK * BK;
    const int lo = begin + part * share;
    const int last = min(min(width, origin + min(n, tile * BQ + BQ)), lo + share);
    const bool some = q0 < n;
    const T* kb = k + b * k_strides[0] + g * k_strides[1];
    const T* vb = v + b * v_strides[0] + g * v_strides[1];
    // keys and values read 16 bytes at a time where their rows are whole and aligned (a
    // cache's buffers are); else two bytes at a time
    constexpr int KC = D / 8;  // a key's 16-byte pieces
    constexpr int KN = BK * KC / THREADS;  // a thread's pieces of a key tile
    constexpr int VN = BK / 2 * KC / THREADS;  // a thread's (pair of keys, piece) of a value tile
    const bool wide = k_strides[3] == 1 && v_strides[3] == 1 && k_strides[2] % 8 == 0 &&
        v_strides[2] % 8 == 0 && reinterpret_cast<unsigned long long>(kb) % 16 == 0 &&
        reinterpret_cast<unsigned long long>(vb) % 16 == 0;

    for (int j0 = lo; j0 < last; j0 += BK) {
      __syncthreads();
      if (wide) {
        // 16 bytes a load, every load of a tile issued before any is stored: one memory
        // latency a tile, not one a load
        uint4 kr[KN];
#pragma unroll
        for (int r = 0; r < KN; ++r) {
          const int i = tid + r * THREADS;
          const int j = j0 + i / KC;
          kr[r] = j < width ? *reinterpret_cast<const uint4*>(kb + j * k_strides[2] + i % KC * 8)
                            : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int r = 0; r < KN; ++r) {
          const int i = tid + r * THREADS;
          uint32_t* w = ks + (i / KC) * KS + (i % KC) * 4;
          w[0] = kr[r].x;
          w[1] = kr[r].y;
          w[2] = kr[r].z;
          w[3] = kr[r].w;
        }
        uint4 lo[VN];
        uint4 hi[VN];
#pragma unroll
        for (int r = 0; r < VN; ++r) {
          const int i = tid + r * THREADS;
          const int j = j0 + 2 * (i / KC);
          const T* p = vb + j * v_strides[2] + i % KC * 8;
          lo[r] = j < width ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
          hi[r] = j + 1 < width ? *reinterpret_cast<const uint4*>(p + v_strides[2])
                                : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int r = 0; r < VN; ++r) {
          const int i = tid + r * THREADS;
          uint32_t* w = vs + (i % KC) * 8 * VS + i / KC;  // dimension 8 c, pair of keys
          const uint32_t a[4] = {lo[r].x, lo[r].y, lo[r].z, lo[r].w};
          const uint32_t c[4] = {hi[r].x, hi[r].y, hi[r].z, hi[r].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            w[(2 * e) * VS] = (a[e] & 0xffffu) | (c[e] << 16);
            w[(2 * e + 1) * VS] = (a[e] >> 16) | (c[e] & 0xffff0000u);
          }
        }
      } else {
        for (int i = tid; i < BK * DP; i += THREADS) {
          const int key = i / DP;
          const int pair = i - key * DP;
          const int j = j0 + key;
          const T* p = kb + j * k_strides[2] + 2 * pair * k_strides[3];
          ks[key * KS + pair] = gw_bits<T>(p, j < width, p + k_strides[3], j < width);
        }
        for (int i = tid; i < D * (BK / 2); i += THREADS) {
          const int d = i % D;
          const int pair = i / D;
          const int j = j0 + 2 * pair;
          const T* p = vb + j * v_strides[2] + d * v_strides[3];
          vs[d * VS + pair] = gw_bits<T>(p, j < width, p + v_strides[2], j + 1 < width);
        }
      }
      __syncthreads();
      if (!some || j0 > origin + q0 + 15) continue;  // no query of this warp sees the tile

      float s[BK / 8][4];
#pragma unroll
      for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nt][c] = 0.0f;
      }
#pragma unroll
      for (int st = 0; st < D / 16; ++st) {
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) {
          const uint32_t* kr = ks + (nt * 8 + gid) * KS + st * 8 + tig;
          gw_mma<T>::run(s[nt], qa[st], kr[0], kr[4]);
        }
      }
      // scores: register c of tile nt is row gid (+8 from c = 2), key nt * 8 + 2 tig (+1 odd c)
      float x0 = NEG_INF, x1 = NEG_INF;
#pragma unroll
      for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = j0 + nt * 8 + tig * 2 + (c & 1);
          const int p = (c & 2) ? p1 : p0;
          const float y = (j >= first && j <= p && j < width) ? s[nt][c] * sl2 : NEG_INF;
          s[nt][c] = y;
          if (c & 2) x1 = fmaxf(x1, y); else x0 = fmaxf(x0, y);
        }
      }
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 1));
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, 2));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 1));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, 2));
      const float n0 = fmaxf(m0, x0);
      const float n1 = fmaxf(m1, x1);
      const float u0 = n0 == NEG_INF ? 0.0f : n0;  // a row that has seen no key yet
      const float u1 = n1 == NEG_INF ? 0.0f : n1;
      const float a0 = exp2f(m0 - u0);
      const float a1 = exp2f(m1 - u1);
      m0 = n0;
      m1 = n1;
      float r0 = 0.0f, r1 = 0.0f;
#pragma unroll
      for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float e = exp2f(s[nt][c] - ((c & 2) ? u1 : u0));
          s[nt][c] = e;
          if (c & 2) r1 += e; else r0 += e;
        }
      }
      l0 = l0 * a0 + r0;
      l1 = l1 * a1 + r1;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        o[dn][0] *= a0;
        o[dn][1] *= a0;
        o[dn][2] *= a1;
        o[dn][3] *= a1;
      }
      // the probabilities of two key tiles of 8 are the A operand over 16 keys
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = gw_mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = gw_mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = gw_mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = gw_mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          const uint32_t* vr = vs + (dn * 8 + gid) * VS + kk * 8 + tig;
          gw_mma<T>::run(o[dn], pa, vr[0], vr[4]);
        }
      }
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
"""


SOURCE = (
    BODY
    + """
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;  // a query that sees no key: zeros
    const float i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const int row0 = q0 + gid;
    const int row1 = row0 + 8;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      const int d = dn * 8 + tig * 2;
      if (row0 < n) {
        T* w = out + ((static_cast<int64_t>(b) * n + row0) * heads + h) * D + d;
        w[0] = static_cast<T>(o[dn][0] * i0);
        w[1] = static_cast<T>(o[dn][1] * i0);
      }
      if (row1 < n) {
        T* w = out + ((static_cast<int64_t>(b) * n + row1) * heads + h) * D + d;
        w[0] = static_cast<T>(o[dn][2] * i1);
        w[1] = static_cast<T>(o[dn][3] * i1);
      }
    }
"""
)
SPLIT_SOURCE = (
    BODY
    + """
    // this split's attention, normalized, and its log-sum (base 2) for `combine`
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
    const float i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const int row0 = q0 + gid;
    const int row1 = row0 + 8;
    const int64_t slab = static_cast<int64_t>(part) * q_shape[0] + b;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      const int d = dn * 8 + tig * 2;
      if (row0 < n) {
        float* w = parts + ((slab * n + row0) * heads + h) * D + d;
        w[0] = o[dn][0] * i0;
        w[1] = o[dn][1] * i0;
      }
      if (row1 < n) {
        float* w = parts + ((slab * n + row1) * heads + h) * D + d;
        w[0] = o[dn][2] * i1;
        w[1] = o[dn][3] * i1;
      }
    }
    if (tig == 0) {
      if (row0 < n) sums[(slab * n + row0) * heads + h] = l0 > 0.0f ? m0 + log2f(l0) : NEG_INF;
      if (row1 < n) sums[(slab * n + row1) * heads + h] = l1 > 0.0f ? m1 + log2f(l1) : NEG_INF;
    }
"""
)
COMBINE_SOURCE = """
    // out[b, i, h, :] from the splits' parts: each weighed by its share of the whole sum
    const int64_t at = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t per = static_cast<int64_t>(parts_shape[1]) * parts_shape[2] * parts_shape[3];
    if (at >= per * D) return;
    const int64_t cell = at / D;
    const int splits = parts_shape[0];
    float top = -cuda::std::numeric_limits<float>::infinity();
    for (int s = 0; s < splits; ++s) top = fmaxf(top, sums[s * per + cell]);
    float total = 0.0f;
    float acc = 0.0f;
    if (top != -cuda::std::numeric_limits<float>::infinity()) {
      for (int s = 0; s < splits; ++s) {
        const float w = exp2f(sums[s * per + cell] - top);
        total += w;
        acc += w * parts[s * per * D + at];
      }
    }
    out[at] = static_cast<T>(total > 0.0f ? acc / total : 0.0f);
"""
