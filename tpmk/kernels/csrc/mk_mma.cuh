// Tensor-core matvec for batched decode: every weight tile is streamed ONCE per pass of
// up to MMA_PASS batch rows (mma.sync m16n8k16, bf16 in, f32 accumulate).
// Weights are the A operand, straight from global memory with 16-byte loads; the k order
// inside each 32-wide k block is permuted (lane t loads k = 8t..8t+7 of its rows, which
// covers two k16 steps) and the B operand (activations, smem) uses the same permutation.
// Activations are f32: they are split into hi + lo bf16 (x = hi + lo to ~2^-17), two MMAs
// each, so the result matches f32 activations x bf16 weights.
// RMSNorm is fused as a post-scale: W (x * w) * rsqrt(mean(x^2) + eps).
#pragma once
#include "mk_common.cuh"

#ifndef MK_FLOAT32   // bf16 weights only
#define MK_HAS_MMA 1

// Smaller batches stay on the CUDA-core matvec (faster at batch 1 on an H200, 2026-12-03).
constexpr int MMA_MIN_BATCH = 5;

constexpr int MMA_PASS = 64;                         // batch rows per pass (8 n-tiles)
constexpr int MMA_KC1 = 4096;                        // K chunk for 1 n-tile; KC = MMA_KC1 / NT
constexpr int MMA_F4 = MMA_KC1 * 8 / 4 / NTHREADS;   // float4 of x per thread per chunk (16)
constexpr int MMA_SS_WORDS = MMA_PASS + MMA_F4 * NTHREADS;   // ss[b], then per-float4 partials
constexpr int MMA_XWORDS = 8 * (MMA_KC1 + 8 * 32);   // NT*8 rows x (KC + 32) x (hi, lo) bf16, in f32 words
constexpr int MMA_OUT_WORDS = MMA_PASS * 128;        // staged outputs [nb][nrows]
constexpr int MMA_SMEM_WORDS = MMA_SS_WORDS + MMA_XWORDS + MMA_OUT_WORDS;   // after the red area

__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned bf2_bits(__nv_bfloat162 h) { return *reinterpret_cast<unsigned*>(&h); }

// Batch rows per pass for a tile of `nrows` outputs (the staging area holds MMA_OUT_WORDS).
__device__ __forceinline__ int mma_pass_rows(int nrows) {
  return max(8, min(MMA_PASS, (MMA_OUT_WORDS / max(nrows, 1)) & ~7));
}

// How a linear op's input rows reach the tensor cores (one mode per call: the fill's
// code carries no per-element branch on the source).
enum FillMode { FILL_PLAIN = 0, FILL_NORM = 1, FILL_MERGE = 2 };

// One K chunk of the B operand: xh/xl[b][kk] = hi/lo bf16 of xin(b0 + b, kc0 + kk) (times the
// norm weight in FILL_NORM), b < NB (rows >= nb are zeros), MMA_F4 float4 per thread.
// Thread float4 e (f = tid + e * NTHREADS) is row f / RF at every chunk, so FILL_NORM sums its
// squares in ssq[f] across chunks (reduced once per pass, not per chunk); it needs the
// norm weights of at most NWV distinct columns per chunk.
template <int NT, int MODE>
__device__ __forceinline__ void mma_fill(const KernelArgs& a, const float* x, int ldx, const wtype* nw,
                                         const float* part, const float* coef, int K, int kc0, int b0,
                                         int nb, __nv_bfloat16* xh, __nv_bfloat16* xl, float* ssq) {
  constexpr int KC = MMA_KC1 / NT, XS = KC + 32, RF = KC / 4;
  constexpr int FG = MODE == FILL_MERGE ? 4 : 8, NWV = RF > NTHREADS ? RF / NTHREADS : 1;
  float wf[NWV][4];
  if constexpr (MODE == FILL_NORM) {
#pragma unroll
    for (int j = 0; j < NWV; j++) {
      const int k = kc0 + (threadIdx.x + j * NTHREADS) % RF * 4;
      const uint2 u = k < K ? __ldg(reinterpret_cast<const uint2*>(nw + k)) : make_uint2(0, 0);
      const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      wf[j][0] = w01.x; wf[j][1] = w01.y; wf[j][2] = w23.x; wf[j][3] = w23.y;
    }
  }
#pragma unroll
  for (int e0 = 0; e0 < MMA_F4; e0 += FG) {
    float4 v[FG];
#pragma unroll
    for (int q = 0; q < FG; q++) {   // all loads first (the smem stores below are generic)
      const int f = threadIdx.x + (e0 + q) * NTHREADS, b = f / RF, k = kc0 + f % RF * 4;
      const bool ok = b < nb && k < K;
      if constexpr (MODE == FILL_MERGE)
        v[q] = ok ? merged4<4>(a, part, coef, b0, b, k) : make_float4(0.f, 0.f, 0.f, 0.f);   // o_proj
      else
        v[q] = ok ? __ldcg(reinterpret_cast<const float4*>(x + (size_t)(b0 + b) * ldx + k))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int q = 0; q < FG; q++) {
      const int e = e0 + q, f = threadIdx.x + e * NTHREADS, b = f / RF, kk = f % RF * 4;
      float4 xv = v[q];
      if constexpr (MODE == FILL_NORM) {
        ssq[f] += xv.x * xv.x + xv.y * xv.y + xv.z * xv.z + xv.w * xv.w;   // this thread's slot
        const float* w = wf[e % NWV];
        xv.x *= w[0]; xv.y *= w[1]; xv.z *= w[2]; xv.w *= w[3];
      }
      const __nv_bfloat162 h0 = __floats2bfloat162_rn(xv.x, xv.y), h1 = __floats2bfloat162_rn(xv.z, xv.w);
      const __nv_bfloat162 l0 = __floats2bfloat162_rn(xv.x - __low2float(h0), xv.y - __high2float(h0));
      const __nv_bfloat162 l1 = __floats2bfloat162_rn(xv.z - __low2float(h1), xv.w - __high2float(h1));
      *reinterpret_cast<uint2*>(xh + b * XS + kk) = make_uint2(bf2_bits(h0), bf2_bits(h1));
      *reinterpret_cast<uint2*>(xl + b * XS + kk) = make_uint2(bf2_bits(l0), bf2_bits(l1));
    }
  }
}

// outs[b * nrows + r] = sum_k W[row(r)][k] * xin(b0 + b, k), b < nb <= MMA_PASS (fused norm when src.nw).
// NT n-tiles of 8 batch rows. Per K chunk: all threads fill x[NB][KC] (16 float4 each, loads
// batched), then warps (m-tile of 16 rows, K part) run the MMAs; K parts interleave 32-wide
// k blocks of the chunk and are summed in fixed order, as are the RMSNorm partial sums.
template <int NT>
__device__ __noinline__ void matvec_mma_nt(const KernelArgs& a, int K, int b0, int nb, int nrows, const XSrc& src,
                                           const RowMap& row, float* outs, float* sm) {
  constexpr int KC = MMA_KC1 / NT, XS = KC + 32, NB = NT * 8, NKB = KC / 32, RF = KC / 4;
  constexpr int U = NT >= 8 ? 2 : 4;
  static_assert(NB * RF == MMA_F4 * NTHREADS, "x chunk = MMA_F4 float4 per thread");
  float* ss = sm;                          // [NB]
  float* ssq = sm + MMA_PASS;              // [MMA_F4 * NTHREADS] per-float4 partials of sum x^2
  __nv_bfloat16* xh = reinterpret_cast<__nv_bfloat16*>(sm + MMA_SS_WORDS);
  __nv_bfloat16* xl = xh + NB * XS;
  float* part = sm + MMA_SS_WORDS;         // [NWARPS][NT][4][32], reuses the chunk after the K loop
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mtiles = (nrows + 15) / 16;
  const float* sx = src.x;
  const float* sp = src.part;
  const wtype* nw = src.nw;
  const int ldx = src.ldx, mode = sp ? FILL_MERGE : nw ? FILL_NORM : FILL_PLAIN;
  float* coef = outs;   // o_proj split weights, until the epilogue (o_proj tiles: mtiles <= NWARPS)
  if (sp) merge_coefs(a, sp, b0, nb, coef);   // read after the first __syncthreads
  for (int mt0 = 0; mt0 < mtiles; mt0 += NWARPS) {
    const int mcount = min(NWARPS, mtiles - mt0), ks = NWARPS / mcount;
    const int mt = mt0 + warp / ks, kp = warp % ks;
    const bool active = warp / ks < mcount;
    const wtype* wa = row(min(mt * 16 + g, nrows - 1));
    const wtype* wb = row(min(mt * 16 + g + 8, nrows - 1));
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) acc[n][i] = 0.f;
#pragma unroll
    for (int e = 0; e < MMA_F4; e++) ssq[e * NTHREADS + threadIdx.x] = 0.f;   // this thread's slots
    for (int kc0 = 0; kc0 < K; kc0 += KC) {
      __syncthreads();   // the previous chunk (or pass) is no longer read
      if (warp == NWARPS - 1 && kc0 + KC < K) {   // hint: next chunk's weights -> L2
        const unsigned bytes = (unsigned)min(KC, K - kc0 - KC) * sizeof(wtype);
        for (int r = lane; r < nrows; r += 32)
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row(r) + kc0 + KC), "r"(bytes) : "memory");
      }
      if (mode == FILL_NORM)
        mma_fill<NT, FILL_NORM>(a, sx, ldx, nw, sp, coef, K, kc0, b0, nb, xh, xl, ssq);
      else if (mode == FILL_MERGE)
        mma_fill<NT, FILL_MERGE>(a, sx, ldx, nw, sp, coef, K, kc0, b0, nb, xh, xl, ssq);
      else
        mma_fill<NT, FILL_PLAIN>(a, sx, ldx, nw, sp, coef, K, kc0, b0, nb, xh, xl, ssq);
      __syncthreads();
      if (active) {
        for (int kb = kp; kb < NKB; kb += ks * U) {
          uint4 ua[U], ub[U];
#pragma unroll
          for (int u = 0; u < U; u++) {
            const int k = kc0 + (kb + u * ks) * 32 + 8 * t;
            const bool ok = kb + u * ks < NKB && k < K;
            ua[u] = ok ? __ldg(reinterpret_cast<const uint4*>(wa + k)) : make_uint4(0, 0, 0, 0);
            ub[u] = ok ? __ldg(reinterpret_cast<const uint4*>(wb + k)) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int u = 0; u < U; u++) {
            const int kbu = kb + u * ks;
            if (kbu < NKB && kc0 + kbu * 32 < K) {   // warp-uniform
#pragma unroll
              for (int n = 0; n < NT; n++) {
                const int off = (n * 8 + g) * XS + kbu * 32 + 8 * t;
                const uint4 bh = *reinterpret_cast<const uint4*>(xh + off);
                const uint4 bl = *reinterpret_cast<const uint4*>(xl + off);
                mma_bf16(acc[n], ua[u].x, ub[u].x, ua[u].y, ub[u].y, bh.x, bh.y);
                mma_bf16(acc[n], ua[u].z, ub[u].z, ua[u].w, ub[u].w, bh.z, bh.w);
                mma_bf16(acc[n], ua[u].x, ub[u].x, ua[u].y, ub[u].y, bl.x, bl.y);
                mma_bf16(acc[n], ua[u].z, ub[u].z, ua[u].w, ub[u].w, bl.z, bl.w);
              }
            }
          }
        }
      }
    }
    __syncthreads();   // chunk reads and ssq updates done
    if (mode == FILL_NORM)   // row b: the float4 f in [b * RF, (b + 1) * RF), fixed order
      for (int b = warp; b < NB; b += NWARPS) {
        float s2 = 0.f;
        for (int f = b * RF + lane; f < (b + 1) * RF; f += 32) s2 += ssq[f];
        s2 = warp_sum(s2);
        if (lane == 0) ss[b] = s2;
      }
    if (active)
#pragma unroll
      for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) part[((warp * NT + n) * 4 + i) * 32 + lane] = acc[n][i];
    __syncthreads();
    // C fragment: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g + 8, same cols).
    for (int idx = threadIdx.x; idx < mcount * 16 * nb; idx += NTHREADS) {
      const int b = idx % nb, m = idx / nb / 16, r16 = idx / nb % 16, r = (mt0 + m) * 16 + r16;
      if (r >= nrows) continue;
      const int n = b >> 3, i = (r16 >> 3) * 2 + (b & 1), ln = (r16 & 7) * 4 + ((b & 7) >> 1);
      float v = 0.f;
      for (int p = 0; p < ks; p++) v += part[(((m * ks + p) * NT + n) * 4 + i) * 32 + ln];
      if (mode == FILL_NORM) v *= rsqrtf(ss[b] / K + a.eps);
      outs[b * nrows + r] = v;
    }
  }
  __syncthreads();
}

__device__ void matvec_mma(const KernelArgs& a, int K, int b0, int nb, int nrows, const XSrc& src,
                           const RowMap& row, float* outs, float* sm) {
  if (nb <= 8) matvec_mma_nt<1>(a, K, b0, nb, nrows, src, row, outs, sm);
  else if (nb <= 16) matvec_mma_nt<2>(a, K, b0, nb, nrows, src, row, outs, sm);
  else if (nb <= 32) matvec_mma_nt<4>(a, K, b0, nb, nrows, src, row, outs, sm);
  else matvec_mma_nt<8>(a, K, b0, nb, nrows, src, row, outs, sm);
}
#endif  // MK_HAS_MMA
