// Shared device helpers of the megakernel: types, vector loads, reductions,
// the fused-RMSNorm input loader and the matvec core used by every linear op.
#pragma once
#include <cuda_bf16.h>
#include "isa_generated.cuh"

#ifndef MK_FLOAT32
typedef __nv_bfloat16 wtype;            // model dtype: weights and KV cache
#else
typedef float wtype;
#endif

constexpr int NTHREADS = 512;
constexpr int NWARPS = NTHREADS / 32;
constexpr int VEC = 16 / sizeof(wtype);   // elements per 16-byte load
constexpr int BATCH_CHUNK = 4;            // batch rows per matvec pass (inputs in smem)
constexpr int UNROLL = 2;                 // x MV_ROWS 16-byte weight loads in flight per lane

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ wtype from_f(float v) { return (wtype)v; }

// 16 bytes of weights -> VEC floats.
__device__ __forceinline__ void unpack(const uint4& u, float* f) {
  if constexpr (sizeof(wtype) == 2) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  } else {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of v over the block for each of n values; red: NWARPS * n floats of smem.
__device__ void block_sum(float* v, int n, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = 0; i < n; i++) {
    float s = warp_sum(v[i]);
    if (lane == 0) red[warp * n + i] = s;
  }
  __syncthreads();
  for (int i = 0; i < n; i++) {
    float s = 0.f;
    for (int w = 0; w < NWARPS; w++) s += red[w * n + i];
    v[i] = s;
  }
  __syncthreads();
}

// Activations written by other CTAs in this launch are read with ld.global.cg
// (L2, never a stale L1 line); the acquire in wait_counter orders them.
__device__ __forceinline__ float ld_act(const float* p) { return __ldcg(p); }

// Rows of a linear op's weight tile: r < n0 -> w0 + r * ld, else w1 + (r - n0) * ld.
struct RowMap {
  const wtype* w0;
  const wtype* w1;
  int n0, ld;
  __device__ __forceinline__ const wtype* operator()(int r) const {
    return r < n0 ? w0 + (size_t)r * ld : w1 + (size_t)(r - n0) * ld;
  }
};

// A linear op's input rows: x[b * ldx + k] (RMSNorm with weight nw fused when nw != null),
// or, when part != null, the attention output merged from its splits (o_proj).
struct XSrc {
  const float* x;
  int ldx;
  const wtype* nw;
  const float* part;   // [bucket, Hq, splits, D + 2]: acc[D], m, l per split
};

// Split weights of the attention merge: coef[(b * Hq + h) * S + s] = e^(m_s - M) / sum_s' e^(m_s' - M) l_s'
// for rows b0 + b, b < nb (part: [bucket, Hq, S, D + 2] = acc[D], m, l per split).
__device__ void merge_coefs(const KernelArgs& a, const float* part, int b0, int nb, float* coef) {
  const int D = a.head_dim, S = a.num_splits;
  for (int i = threadIdx.x; i < nb * a.q_heads; i += NTHREADS) {
    const float* p = part + ((size_t)b0 * a.q_heads + i) * S * (D + 2);
    float M = isa::NEG_INF;
    for (int s = 0; s < S; s++) M = fmaxf(M, ld_act(p + s * (D + 2) + D));
    float den = 0.f;
    for (int s = 0; s < S; s++) den += expf(ld_act(p + s * (D + 2) + D) - M) * ld_act(p + s * (D + 2) + D + 1);
    const float inv = 1.f / den;
    for (int s = 0; s < S; s++) coef[i * S + s] = expf(ld_act(p + s * (D + 2) + D) - M) * inv;
  }
}

// Merged attention output of row b0 + b, k..k+3 (one head: D % 4 == 0): sum_s coef_s acc_s[d].
__device__ __forceinline__ float4 merged4(const KernelArgs& a, const float* part, const float* coef,
                                          int b0, int b, int k) {
  const int D = a.head_dim, S = a.num_splits, h = k / D, d = k % D;
  const float* p = part + (((size_t)(b0 + b) * a.q_heads + h) * S) * (D + 2) + d;
  const float* c = coef + (b * a.q_heads + h) * S;
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < S; s++) {
    const float2 u = __ldcg(reinterpret_cast<const float2*>(p + s * (D + 2)));
    const float2 v = __ldcg(reinterpret_cast<const float2*>(p + s * (D + 2) + 2));
    const float w = c[s];
    r.x += w * u.x; r.y += w * u.y; r.z += w * v.x; r.w += w * v.y;
  }
  return r;
}

// Raw input x[b0 + b][k..k+3] (before the norm weight); K and ldx are multiples of 8.
// o_proj (s.part): coef from merge_coefs for the same b0.
__device__ __forceinline__ float4 xin_load4(const KernelArgs& a, const XSrc& s, const float* coef,
                                            int b0, int b, int k) {
  if (!s.part) return __ldcg(reinterpret_cast<const float4*>(s.x + (size_t)(b0 + b) * s.ldx + k));
  return merged4(a, s.part, coef, b0, b, k);
}

// xs[b][k] = rmsnorm(x[b0 + b]) * w (w may be null: plain copy), b < nb, k < K.
__device__ void load_normed(const KernelArgs& a, const float* x, int ldx, int b0, int nb, int K,
                            const wtype* w, float* xs, float* red) {
  float ss[BATCH_CHUNK] = {0.f, 0.f, 0.f, 0.f};
  for (int b = 0; b < nb; b++) {   // 16-byte loads (K, ldx multiples of 8: checked on the host)
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)(b0 + b) * ldx);
    float4* xo = reinterpret_cast<float4*>(xs + b * K);
#pragma unroll 4
    for (int k = threadIdx.x; k < K / 4; k += NTHREADS) {
      const float4 v = __ldcg(xr + k);
      xo[k] = v;
      ss[b] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  }
  if (w == nullptr) { __syncthreads(); return; }
  block_sum(ss, nb, red);
  for (int b = 0; b < nb; b++) {
    float r = rsqrtf(ss[b] / K + a.eps);
    for (int k = threadIdx.x; k < K; k += NTHREADS) xs[b * K + k] *= r * to_f(w[k]);
  }
  __syncthreads();
}

// For each local row r < nrows: out(r, b, sum_k W[row(r)][k] * xs[b][k]).
// A warp takes MV_ROWS rows at once so each shared-memory read of xs feeds
// MV_ROWS * VEC FMAs (smem bandwidth, not HBM, was the limit with one row).
constexpr int MV_ROWS = 4;
template <int NB, typename RowFn, typename OutFn>
__device__ void matvec_nb(int K, const float* xs, int nrows, RowFn row, OutFn out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r0 = warp * MV_ROWS; r0 < nrows; r0 += NWARPS * MV_ROWS) {
    const wtype* wr[MV_ROWS];
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++) wr[j] = row(min(r0 + j, nrows - 1));
    float acc[MV_ROWS][NB];
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++)
#pragma unroll
      for (int b = 0; b < NB; b++) acc[j][b] = 0.f;
    for (int k0 = lane * VEC; k0 < K; k0 += 32 * VEC * UNROLL) {
      uint4 u[UNROLL][MV_ROWS];
#pragma unroll
      for (int i = 0; i < UNROLL; i++) {
        const int k = k0 + i * 32 * VEC;
#pragma unroll
        for (int j = 0; j < MV_ROWS; j++)
          u[i][j] = k < K ? __ldg(reinterpret_cast<const uint4*>(wr[j] + k)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < UNROLL; i++) {
        const int k = k0 + i * 32 * VEC;
        if (k < K) {
#pragma unroll
          for (int b = 0; b < NB; b++) {
            float xv[VEC];
            const float4* xb = reinterpret_cast<const float4*>(xs + b * K + k);
#pragma unroll
            for (int v = 0; v < VEC / 4; v++) {
              const float4 t = xb[v];
              xv[4 * v] = t.x; xv[4 * v + 1] = t.y; xv[4 * v + 2] = t.z; xv[4 * v + 3] = t.w;
            }
#pragma unroll
            for (int j = 0; j < MV_ROWS; j++) {
              float f[VEC];
              unpack(u[i][j], f);
#pragma unroll
              for (int e = 0; e < VEC; e++) acc[j][b] += f[e] * xv[e];
            }
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++)
#pragma unroll
      for (int b = 0; b < NB; b++) acc[j][b] = warp_sum(acc[j][b]);
    if (lane == 0)
#pragma unroll
      for (int j = 0; j < MV_ROWS; j++)
        if (r0 + j < nrows)
#pragma unroll
          for (int b = 0; b < NB; b++) out(r0 + j, b, acc[j][b]);
  }
}

// One block-wide scratch for the split-K partials (a static __shared__ inside the
// template would be duplicated per instantiation).
__device__ __forceinline__ float* matvec_scratch() {
  __shared__ float part[NWARPS * MV_ROWS * BATCH_CHUNK];
  return part;
}

// Few rows (at most NWARPS / 2 row groups): warps also split K, so every warp streams
// weights; the K-slice partials are summed in fixed order (deterministic).
// Called by every thread of the block (contains __syncthreads).
template <int NB, typename RowFn, typename OutFn>
__device__ void matvec_splitk_nb(int K, const float* xs, int nrows, RowFn row, OutFn out) {
  float* part = matvec_scratch();   // [NWARPS][MV_ROWS][BATCH_CHUNK]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups = (nrows + MV_ROWS - 1) / MV_ROWS;
  int ks = 1;
  while (ks * 2 * groups <= NWARPS) ks *= 2;
  constexpr int STEP = 32 * VEC;
  const int kslice = (K + ks * STEP - 1) / (ks * STEP) * STEP;
  const int grp = warp / ks, kp = warp % ks;
  if (grp < groups) {
    const int r0 = grp * MV_ROWS;
    const wtype* wr[MV_ROWS];
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++) wr[j] = row(min(r0 + j, nrows - 1));
    float acc[MV_ROWS][NB];
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++)
#pragma unroll
      for (int b = 0; b < NB; b++) acc[j][b] = 0.f;
    const int kend = min(K, (kp + 1) * kslice);
    for (int k0 = kp * kslice + lane * VEC; k0 < kend; k0 += STEP * UNROLL) {
      uint4 u[UNROLL][MV_ROWS];
#pragma unroll
      for (int i = 0; i < UNROLL; i++) {
        const int k = k0 + i * STEP;
#pragma unroll
        for (int j = 0; j < MV_ROWS; j++)
          u[i][j] = k < kend ? __ldg(reinterpret_cast<const uint4*>(wr[j] + k)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < UNROLL; i++) {
        const int k = k0 + i * STEP;
        if (k < kend) {
#pragma unroll
          for (int b = 0; b < NB; b++) {
            float xv[VEC];
            const float4* xb = reinterpret_cast<const float4*>(xs + b * K + k);
#pragma unroll
            for (int v = 0; v < VEC / 4; v++) {
              const float4 t = xb[v];
              xv[4 * v] = t.x; xv[4 * v + 1] = t.y; xv[4 * v + 2] = t.z; xv[4 * v + 3] = t.w;
            }
#pragma unroll
            for (int j = 0; j < MV_ROWS; j++) {
              float f[VEC];
              unpack(u[i][j], f);
#pragma unroll
              for (int e = 0; e < VEC; e++) acc[j][b] += f[e] * xv[e];
            }
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++)
#pragma unroll
      for (int b = 0; b < NB; b++) {
        const float t = warp_sum(acc[j][b]);
        if (lane == 0) part[(warp * MV_ROWS + j) * BATCH_CHUNK + b] = t;
      }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nrows * NB; i += NTHREADS) {
    const int r = i / NB, b = i % NB, g = r / MV_ROWS, j = r % MV_ROWS;
    float t = 0.f;
    for (int p = 0; p < ks; p++) t += part[((g * ks + p) * MV_ROWS + j) * BATCH_CHUNK + b];
    out(r, b, t);
  }
  __syncthreads();
}

template <typename RowFn, typename OutFn>
__device__ void matvec(int K, const float* xs, int nb, int nrows, RowFn row, OutFn out) {
  if ((nrows + MV_ROWS - 1) / MV_ROWS * 2 <= NWARPS) {
    if (nb == 1) matvec_splitk_nb<1>(K, xs, nrows, row, out);
    else if (nb == 2) matvec_splitk_nb<2>(K, xs, nrows, row, out);
    else if (nb == 3) matvec_splitk_nb<3>(K, xs, nrows, row, out);
    else matvec_splitk_nb<4>(K, xs, nrows, row, out);
    return;
  }
  if (nb == 1) matvec_nb<1>(K, xs, nrows, row, out);
  else if (nb == 2) matvec_nb<2>(K, xs, nrows, row, out);
  else if (nb == 3) matvec_nb<3>(K, xs, nrows, row, out);
  else matvec_nb<4>(K, xs, nrows, row, out);
}
