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
constexpr int MMA_KC1 = 2048;                        // K chunk for 1 n-tile; KC = MMA_KC1 / NT
constexpr int MMA_F4 = MMA_KC1 * 8 / 4 / NTHREADS;   // float4 of x per thread per chunk (8)
constexpr int MMA_SS_WORDS = MMA_PASS + MMA_F4 * NTHREADS;   // ss[b], then per-float4 partials
constexpr int MMA_STAGE_WORDS = 8 * MMA_KC1;         // the next chunk's f32 inputs [NB][KC] (cp.async)
constexpr int MMA_XWORDS = 8 * (MMA_KC1 + 8 * 32);   // NT*8 rows x (KC + 32) x (hi, lo) bf16, in f32 words
constexpr int MMA_OUT_WORDS = MMA_PASS * 128;        // staged outputs [nb][nrows]
constexpr int MMA_OUT_AT = MMA_SS_WORDS + MMA_STAGE_WORDS + MMA_XWORDS;   // outs, after the red area
constexpr int MMA_SMEM_WORDS = MMA_OUT_AT + MMA_OUT_WORDS;

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

// hi + lo bf16 of 4 floats -> xh/xl (x = hi + lo to ~2^-17).
__device__ __forceinline__ void put_hilo(float4 v, __nv_bfloat16* xh, __nv_bfloat16* xl) {
  const __nv_bfloat162 h0 = __floats2bfloat162_rn(v.x, v.y), h1 = __floats2bfloat162_rn(v.z, v.w);
  const __nv_bfloat162 l0 = __floats2bfloat162_rn(v.x - __low2float(h0), v.y - __high2float(h0));
  const __nv_bfloat162 l1 = __floats2bfloat162_rn(v.z - __low2float(h1), v.w - __high2float(h1));
  *reinterpret_cast<uint2*>(xh) = make_uint2(bf2_bits(h0), bf2_bits(h1));
  *reinterpret_cast<uint2*>(xl) = make_uint2(bf2_bits(l0), bf2_bits(l1));
}

// Thread float4 e of a chunk is f = tid + e * NTHREADS: row f / RF, columns kc0 + f % RF * 4..+3,
// the same at every chunk (so a normed input keeps its sums of squares in ssq[f] across chunks and
// a thread converts exactly the stage words its own cp.async wrote).
//
// The chunk's f32 input rows are copied to `stage` with cp.async (L2 -> smem, no registers)
// one chunk ahead: they fly while the MMAs of the current chunk run. Rows >= nb and columns
// >= K are zero-filled (src-size 0).
template <int NT>
__device__ __forceinline__ void mma_stage(const float* x, int ldx, int K, int kc0, int b0, int nb, float* stage) {
  constexpr int RF = MMA_KC1 / NT / 4;
#pragma unroll
  for (int e = 0; e < MMA_F4; e++) {
    const int f = threadIdx.x + e * NTHREADS, b = f / RF, k = kc0 + f % RF * 4;
    const bool ok = b < nb && k < K;
    const float* src = ok ? x + (size_t)(b0 + b) * ldx + k : x;
    const unsigned dst = (unsigned)__cvta_generic_to_shared(stage + 4 * f);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// stage -> xh/xl (times the norm weight with NORM, its squares summed into ssq).
template <int NT, bool NORM>
__device__ __forceinline__ void mma_convert(const wtype* nw, int K, int kc0, const float* stage,
                                            __nv_bfloat16* xh, __nv_bfloat16* xl, float* ssq) {
  constexpr int KC = MMA_KC1 / NT, XS = KC + 32, RF = KC / 4;
  static_assert(NTHREADS % RF == 0, "a thread's float4 of a chunk share their 4 columns");
  asm volatile("cp.async.wait_all;" ::: "memory");   // this thread's own copies
  float2 w01, w23;   // the norm weights of this thread's columns
  if constexpr (NORM) {
    const int k = kc0 + threadIdx.x % RF * 4;
    const uint2 u = k < K ? __ldg(reinterpret_cast<const uint2*>(nw + k)) : make_uint2(0, 0);
    w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  }
#pragma unroll
  for (int e = 0; e < MMA_F4; e++) {
    const int f = threadIdx.x + e * NTHREADS, b = f / RF, kk = f % RF * 4;
    float4 v = *reinterpret_cast<const float4*>(stage + 4 * f);
    if constexpr (NORM) {
      ssq[f] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;   // this thread's slot
      v.x *= w01.x; v.y *= w01.y; v.z *= w23.x; v.w *= w23.y;
    }
    put_hilo(v, xh + b * XS + kk, xl + b * XS + kk);
  }
}

// outs[b * nrows + r] = sum_k W[row(r)][k] * xin(b0 + b, k), b < nb <= MMA_PASS (fused norm when src.nw).
// NT n-tiles of 8 batch rows; warps take (m-tile of 16 rows, K part); K parts interleave the
// 32-wide k blocks of each chunk and are summed in fixed order, as are the RMSNorm partials.
// Pipelined: a warp's weight loads run one group of U k blocks ahead of its MMAs, across chunk
// boundaries (weights never wait for activations), and the next chunk's inputs are in flight
// (cp.async) while this chunk's MMAs run; only the f32 -> hi/lo conversion sits between the
// two barriers of a chunk.
template <int NT>
__device__ __noinline__ void matvec_mma_nt(const KernelArgs& a, int K, int b0, int nb, int nrows, const XSrc& src,
                                           const RowMap& row, float* outs, float* sm) {
  constexpr int KC = MMA_KC1 / NT, XS = KC + 32, NB = NT * 8, NKB = KC / 32, RF = KC / 4, U = NT >= 8 ? 2 : 4;
  static_assert(NB * RF == MMA_F4 * NTHREADS, "x chunk = MMA_F4 float4 per thread");
  float* ss = sm;                          // [NB]
  float* ssq = sm + MMA_PASS;              // [MMA_F4 * NTHREADS] per-float4 partials of sum x^2
  float* stage = sm + MMA_SS_WORDS;        // [NB][KC] f32
  __nv_bfloat16* xh = reinterpret_cast<__nv_bfloat16*>(stage + MMA_STAGE_WORDS);
  __nv_bfloat16* xl = xh + NB * XS;
  float* part = stage + MMA_STAGE_WORDS;   // [NWARPS][NT][4][32], reuses xh/xl after the K loop
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mtiles = (nrows + 15) / 16, nchunks = (K + KC - 1) / KC;
  const float* sx = src.x;
  const wtype* nw = src.nw;
  const int ldx = src.ldx;
  for (int mt0 = 0; mt0 < mtiles; mt0 += NWARPS) {
    const int mcount = min(NWARPS, mtiles - mt0), ks = NWARPS / mcount;
    const int mt = mt0 + warp / ks, kp = warp % ks;
    const bool active = warp / ks < mcount;
    const int groups = (NKB + ks * U - 1) / (ks * U);   // per chunk, the same for every warp
    const int ngroups = nchunks * groups;
    const wtype* wa = row(min(mt * 16 + g, nrows - 1));
    const wtype* wb = row(min(mt * 16 + g + 8, nrows - 1));
    // Group gi (chunk gi / groups): k blocks kp + (gi % groups * U + u) * ks of its chunk;
    // zeros past the last group.
    auto load_group = [&](int gi, uint4 (&ua)[U], uint4 (&ub)[U]) {
      const int kc0 = gi / groups * KC, kb0 = kp + gi % groups * U * ks;
      const bool live = active && gi < ngroups;
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int kb = kb0 + u * ks, k = kc0 + kb * 32 + 8 * t;
        const bool ok = live && kb < NKB && k < K;
        ua[u] = ok ? __ldg(reinterpret_cast<const uint4*>(wa + k)) : make_uint4(0, 0, 0, 0);
        ub[u] = ok ? __ldg(reinterpret_cast<const uint4*>(wb + k)) : make_uint4(0, 0, 0, 0);
      }
    };
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) acc[n][i] = 0.f;
#pragma unroll
    for (int e = 0; e < MMA_F4; e++) ssq[e * NTHREADS + threadIdx.x] = 0.f;   // this thread's slots
    uint4 ca[U], cb[U];
    load_group(0, ca, cb);
    mma_stage<NT>(sx, ldx, K, 0, b0, nb, stage);
    for (int c = 0; c < nchunks; c++) {
      const int kc0 = c * KC;
      __syncthreads();   // the previous chunk's xh/xl are no longer read
      if (warp == NWARPS - 1 && kc0 + KC < K) {   // hint: next chunk's weights -> L2
        const unsigned bytes = (unsigned)min(KC, K - kc0 - KC) * sizeof(wtype);
        for (int r = lane; r < nrows; r += 32)
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row(r) + kc0 + KC), "r"(bytes) : "memory");
      }
      if (nw) mma_convert<NT, true>(nw, K, kc0, stage, xh, xl, ssq);
      else mma_convert<NT, false>(nw, K, kc0, stage, xh, xl, ssq);
      __syncthreads();   // xh/xl hold chunk c; the stage is free
      if (c + 1 < nchunks) mma_stage<NT>(sx, ldx, K, kc0 + KC, b0, nb, stage);
      for (int gc = 0; gc < groups; gc++) {
        uint4 na[U], nb2[U];
        load_group(c * groups + gc + 1, na, nb2);
        if (active) {
#pragma unroll
          for (int u = 0; u < U; u++) {
            const int kbu = kp + (gc * U + u) * ks;
            if (kbu < NKB && kc0 + kbu * 32 < K) {   // warp-uniform
#pragma unroll
              for (int n = 0; n < NT; n++) {
                const int off = (n * 8 + g) * XS + kbu * 32 + 8 * t;
                const uint4 bh = *reinterpret_cast<const uint4*>(xh + off);
                const uint4 bl = *reinterpret_cast<const uint4*>(xl + off);
                mma_bf16(acc[n], ca[u].x, cb[u].x, ca[u].y, cb[u].y, bh.x, bh.y);
                mma_bf16(acc[n], ca[u].z, cb[u].z, ca[u].w, cb[u].w, bh.z, bh.w);
                mma_bf16(acc[n], ca[u].x, cb[u].x, ca[u].y, cb[u].y, bl.x, bl.y);
                mma_bf16(acc[n], ca[u].z, cb[u].z, ca[u].w, cb[u].w, bl.z, bl.w);
              }
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; u++) { ca[u] = na[u]; cb[u] = nb2[u]; }
      }
    }
    __syncthreads();   // chunk reads and ssq updates done
    if (nw)   // row b: the float4 f in [b * RF, (b + 1) * RF), fixed order
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
      if (nw) v *= rsqrtf(ss[b] / K + a.eps);
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
