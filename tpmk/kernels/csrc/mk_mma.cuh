// Tensor-core matvec for batched decode: every weight tile is streamed ONCE per pass of
// up to MMA_PASS batch rows (mma.sync m16n8k16, bf16 in, f32 accumulate).
// Weights are the A operand, straight from global memory with 16-byte loads; the k order
// inside each 32-wide k block is permuted (lane t loads k = 8t..8t+7 of its rows, which
// covers two k16 steps) and the B operand (activations, smem) uses the same permutation.
// Activations are bf16, as in the reference engine's cuBLAS matmuls: their producers
// (residual: times the next RMSNorm's weight; attention merge; gate_up) write them rounded
// to bf16 (XSrc.bf), and they are copied into shared memory as they are (cp.async, no
// registers). (Splitting them into hi + lo bf16 planes, f32-exact with two MMAs each, cost
// 6 % of the step at batch 32 and 128 on an H200.)
// RMSNorm is fused as a post-scale: W (x * w) * rsqrt(mean(x^2) + eps), the sum of squares
// from the residual tiles' partials (XSrc.ssq).
#pragma once
#include "mk_common.cuh"

#ifdef MK_HAS_MMA

constexpr int MMA_PASS = isa::MMA_PASS;              // batch rows per pass (MMA_PASS / 8 n-tiles)
constexpr int MMA_KC1 = isa::MMA_KC1;                // K chunk for 1 n-tile; KC = MMA_KC1 / NT
// K chunk with NT n-tiles: MMA_KC1 / NT columns, at most MMA_KC_MAX (the first chunk's
// activations must land before the first MMA). It changes batch <= 16 (NT 1, 2); from NT 4
// on, MMA_KC1 / NT <= 1024 already. 70B tp=8 rank, H100, 2026-12-06: batch 8 at ctx 1024 in
// 11.17 / 11.40 / 11.19 / 11.14 ms with 1024 against 11.64 / 11.79 / 11.65 / 11.41 with 4096
// (MMA_KC1; two calls); 2048: 11.27, 512: 12.10 / 12.30. At ctx 4096, within noise: 12.23 /
// 12.32 against 12.17 / 12.11. o_proj's first 16 KB chunk still lands ~5.5 us after the op's
// entry (probe 8), as its 64 KB one did: a fixed latency, not the bytes. At 256 threads (same
// card, 2026-12-06): batch 8 in 10.59 with 512, 10.24 with 2048 vs 10.15-10.34 with 1024.
#ifndef MMA_KC_MAX
#define MMA_KC_MAX 1024
#endif
// k blocks per load group (a lane's weight loads in flight: 2 U) with NT < 8 n-tiles and with
// NT >= 8 (acc takes NT * 4 registers). 256 threads, H100, ctx 1024, 2026-12-06, one call:
// SMALL 6 / 8 at batch 8 in 10.38 / 10.35 vs 10.15-10.34 ms, at batch 32 in 15.10 / 15.17 vs
// 14.43-14.71; BIG 3 / 4 at batch 128 in 33.21 / 35.18 vs 32.80-32.86.
#ifndef MMA_U_SMALL
#define MMA_U_SMALL 4
#endif
#ifndef MMA_U_BIG
#define MMA_U_BIG 2
#endif
// m-tiles per warp with NT >= MMA_MT_FROM n-tiles (2 by default, from 8 n-tiles, batch >= 33):
// each B fragment read from shared memory feeds MMA_MT m-tiles (at batch 128 the B reads, 16
// n-tiles x 512 bytes per warp per k block, bound the K loop: bench/mma_probe.cu), with
// MMA_U_MT k blocks per load group: a 56-row gate_up tile at batch 128 reads 4 MB of B per SM
// instead of 8, and each B read feeds 4 independent MMAs. H100, ctx 1024, 2026-12-07, each
// variant twice per call, ms: batch 64 / 96 / 128 in 21.33-21.40 / 28.34-28.46 / 31.46-31.55
// with MMA_MT 2 from NT 8 against 20.41-20.92 / 29.99-30.07 / 32.46-32.63 with 1 (ctx 4096,
// batch 128: 41.17-41.22 vs 43.33). With MMA_XD 4 too: 20.16-20.18 / 28.33-28.42 / 31.43-31.54,
// so NT 8 gains with four chunk buffers only. H200, ctx 1024, 2026-12-07, same call, MMA_MT_FROM
// 8 + MMA_XD 4 against MMA_MT_FROM 16 + MMA_XD 2, batch 1 / 8 / 32 / 64 / 128: 7.63 / 7.65,
// 8.82 / 8.97, 12.94 / 12.99, 19.93 / 20.03, 30.32 / 30.31 against 7.62 / 7.61, 8.99 / 9.13,
// 13.28 / 13.26, 20.14 / 20.06, 30.31 / 30.52; the 39 megakernel GPU tests, memcheck and
// racecheck passed with it (and with MMA_MT 2 from NT 16, XD 2, on an H100). MMA_U_MT 2: 99
// spills. MMA_MT 4 does not fit NT 16's split-K partials (static_assert below); at NT 8 alone
// (a trial) it made 125 spills in the kernel and batch 64 10 % slower (H100, 2026-12-07).
#ifndef MMA_MT
#define MMA_MT 2
#endif
#ifndef MMA_MT_FROM
#define MMA_MT_FROM 8
#endif
#ifndef MMA_U_MT
#define MMA_U_MT 1
#endif
// One chunk buffer: NT*8 rows x (KC + 32) bf16 in f32 words, the most at NT = MMA_PASS / 8.
constexpr int MMA_XWORDS = MMA_PASS * (MMA_KC1 * 8 / MMA_PASS + 32) / 2;
// Activation chunk buffers (4 by default): MMA_XD - 1 chunks in flight while one is computed,
// in chunks of 2 / MMA_XD the columns, where they fit the two-buffer layout's words (NT <= 8;
// NT 16 keeps 2). H100, ctx 1024, 2026-12-07, one call, each variant twice: batch 1 / 8 / 32 in
// 8.90 / 8.85, 10.13 / 10.07, 13.94 / 13.77 ms with 4 against 8.91 / 8.93, 10.10 / 10.09,
// 14.08 / 14.23 with 2 (batch 1 does not run it); H200 with MMA_MT_FROM 8: above. 8 buffers:
// 10.82 / 14.74 at batch 8 / 32 (an earlier call, against 10.20 / 14.55). The K loop is bound
// by the weights, not the copies (bench/mma_probe.cu).
#ifndef MMA_XD
#define MMA_XD 4
#endif
template <int NT>   // the K chunk with two buffers
__host__ __device__ constexpr int mma_kc2() { return MMA_KC1 / NT < MMA_KC_MAX ? MMA_KC1 / NT : MMA_KC_MAX; }
template <int NT>
__host__ __device__ constexpr int mma_xd() {
  return MMA_XD * NT * 8 * (mma_kc2<NT>() * 2 / MMA_XD + 32) <= 4 * MMA_XWORDS ? MMA_XD : 2;
}
template <int NT>
__host__ __device__ constexpr int mma_kc() { return mma_kc2<NT>() * 2 / mma_xd<NT>(); }
constexpr int MMA_OUT_WORDS = isa::MMA_OUT_WORDS;    // staged outputs [nb][nrows], at most
constexpr int MMA_OUT_AT = MMA_PASS + 2 * MMA_XWORDS;   // ss, two chunk buffers, then the outputs
static_assert(MMA_OUT_AT == isa::MMA_OUT_AT, "isa.MMA_OUT_AT (the host's layout) drifted");

// Weight rows through ldg_w<true> (mk_common.cuh): not kept in L1, and a 256-byte
// L2 fetch: a warp reads each of its 16 rows in 64-byte pieces, one per k block, and the K-part
// warps interleave their k blocks, so ks = 4 warps together cover each 256-byte span
// (batch 8 / 32 / 128 at 12.76 / 17.86 / 37.53 ms vs 13.86 / 19.01 / 39.28 without, H200,
// 2026-12-04; asking L2 for each m-tile's rows 1 or 2 chunks ahead was slower: 14.06 / 18.44 /
// 41.16 and 14.22 / 18.99 / 39.68).

__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 matrices from shared memory, transposed (ldmatrix .trans): lane l gives the
// address of row l; register i holds matrix i's fragment (the B operand of a row-major [k][n]).
__device__ __forceinline__ void ldsm_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// Batch rows per pass for a tile of `nrows` outputs (the staging area holds MMA_OUT_WORDS).
__device__ __forceinline__ int mma_pass_rows(int nrows) {
  return max(8, min(MMA_PASS, (MMA_OUT_WORDS / max(nrows, 1)) & ~7));
}

// Columns [kc0, kc0 + KC) of input rows b0.. -> xd ([NB][XS]), 16 bytes per cp.async (L2 ->
// smem), committed as one group. A thread copies column kk = tid % R8 * 8 of rows
// row0 + i * RS (row0 = tid / R8, RS = NTHREADS / R8, i < P = NB / RS): `src` is its first one
// (row b0 + row0, column kc0 + kk), `dst` its smem twin. Rows >= nb and columns >= K are
// zero-filled (src-size 0; `safe` is read instead).
template <int NT>
__device__ __forceinline__ void mma_stage(const __nv_bfloat16* src, int ldx, int rows_left, bool k_ok,
                                          const __nv_bfloat16* safe, __nv_bfloat16* dst) {
  constexpr int KC = mma_kc<NT>(), XS = KC + 32, NB = NT * 8, R8 = KC / 8, RS = NTHREADS / R8, P = NB / RS;
  static_assert(NTHREADS % R8 == 0 && P * RS == NB && P >= 1, "a chunk = P rows per thread");
#pragma unroll
  for (int e = 0; e < P; e++) {
    const int r = e * RS;
    const bool ok = k_ok && r < rows_left;
    const __nv_bfloat16* s = ok ? src + (size_t)r * ldx : safe;
    cp_async16(dst + r * XS, s, ok ? 16 : 0);
  }
  cp_async_commit();
}

// outs[b * nrows + r] = sum_k W[row(r)][k] * xin(b0 + b, k), b < nb <= MMA_PASS (fused norm when src.nw).
// NT n-tiles of 8 batch rows; warps take (MT m-tiles of 16 rows, K part); K parts interleave
// the 32-wide k blocks of each chunk and are summed in fixed order, as are the RMSNorm partials.
// Pipelined: a warp's weight loads run one group of U k blocks ahead of its MMAs, across chunk
// boundaries (weights never wait for activations), and the next XD - 1 chunks' inputs are in
// flight (cp.async into the other buffers) while this chunk's MMAs run: one barrier per chunk.
template <int NT>
__device__ __noinline__ void matvec_mma_nt(const KernelArgs& a, int K, int b0, int nb, int nrows, const XSrc& src,
                                           const RowMap& row, float* outs, float* sm) {
  constexpr int MT = NT >= MMA_MT_FROM ? MMA_MT : 1;   // m-tiles per warp
  constexpr int KC = mma_kc<NT>(), XS = KC + 32, NB = NT * 8, NKB = KC / 32;
  constexpr int U = NT < 8 ? MMA_U_SMALL : MT > 1 ? MMA_U_MT : MMA_U_BIG;
  constexpr int XD = mma_xd<NT>();
  static_assert(NWARPS * MT * NT * 4 * 32 <= 2 * MMA_XWORDS, "the split-K partials fit in the chunk buffers");
  static_assert(XD * NB * XS <= 4 * MMA_XWORDS, "the chunk buffers fit their shared memory");
  float* ss = sm;                          // [NB] sums of squares of the rows (with src.nw)
  __nv_bfloat16* xbuf = reinterpret_cast<__nv_bfloat16*>(sm + MMA_PASS);   // XD x [NB][XS]
  float* part = sm + MMA_PASS;             // [NWARPS][MT][NT][4][32], reuses the buffers after the K loop
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mtiles = (nrows + 16 * MT - 1) / (16 * MT), nchunks = (K + KC - 1) / KC;   // units of MT m-tiles
  const int row0 = threadIdx.x / (KC / 8), kk = threadIdx.x % (KC / 8) * 8;   // this thread's copies
  const __nv_bfloat16* xsrc = src.bf + (size_t)(b0 + row0) * src.ldx + kk;
  __nv_bfloat16* xdst = xbuf + row0 * XS + kk;
  auto stage = [&](int c) {   // chunk c's activations into buffer c % XD
    mma_stage<NT>(xsrc + c * KC, src.ldx, nb - row0, c * KC + kk < K, src.bf, xdst + c % XD * NB * XS);
  };
  for (int mt0 = 0; mt0 < mtiles; mt0 += NWARPS) {
    const int mcount = min(NWARPS, mtiles - mt0), ks = NWARPS / mcount;
    const int mt = mt0 + warp / ks, kp = warp % ks, r0 = mt * 16 * MT;
    const bool active = warp / ks < mcount && r0 < nrows;
    const int groups = (NKB + ks * U - 1) / (ks * U);   // per chunk, the same for every warp
    const int ngroups = nchunks * groups;
    const wtype* wa[MT];
    const wtype* wb[MT];
#pragma unroll
    for (int j = 0; j < MT; j++) {
      wa[j] = row(min(r0 + 16 * j + g, nrows - 1));
      wb[j] = row(min(r0 + 16 * j + g + 8, nrows - 1));
    }
    // Group gi (chunk gi / groups): k blocks kp + (gi % groups * U + u) * ks of its chunk;
    // zeros past the last group. Slot j * U + u: m-tile j's k block u.
    auto load_group = [&](int gi, uint4 (&ua)[MT * U], uint4 (&ub)[MT * U]) {
      const int kc0 = gi / groups * KC, kb0 = kp + gi % groups * U * ks;
      const bool live = active && gi < ngroups;
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int kb = kb0 + u * ks, k = kc0 + kb * 32 + 8 * t;
        const bool ok = live && kb < NKB && k < K;
#pragma unroll
        for (int j = 0; j < MT; j++) {
          ua[j * U + u] = ok ? ldg_w<true>(wa[j] + k) : make_uint4(0, 0, 0, 0);
          ub[j * U + u] = ok ? ldg_w<true>(wb[j] + k) : make_uint4(0, 0, 0, 0);
        }
      }
    };
    float acc[MT][NT][4];
#pragma unroll
    for (int j = 0; j < MT; j++)
#pragma unroll
      for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][n][i] = 0.f;
    uint4 ca[MT * U], cb[MT * U];
    load_group(0, ca, cb);
    for (int c = 0; c < XD - 1; c++) stage(c);
    if (src.nw && mt0 == 0) {   // row b's sum of squares: its residual tiles' partials in fixed
      // order; a warp's rows b = warp + r NWARPS load together (one round trip per 32 partials)
      constexpr int R = MMA_PASS / NWARPS;
      float s2[R];
#pragma unroll
      for (int r = 0; r < R; r++) s2[r] = 0.f;
      for (int j = lane; j < src.nss; j += 32)
#pragma unroll
        for (int r = 0; r < R; r++)
          if (warp + r * NWARPS < nb) s2[r] += ld_act(src.ssq + (size_t)(b0 + warp + r * NWARPS) * src.nss + j);
#pragma unroll
      for (int r = 0; r < R; r++) {
        const float t = warp_sum(s2[r]);
        if (lane == 0 && warp + r * NWARPS < nb) ss[warp + r * NWARPS] = t;
      }
    }
    for (int c = 0; c < nchunks; c++) {
      const int kc0 = c * KC;
      if constexpr (XD == 2) cp_async_wait_all();   // this thread's copies of chunk c
      else cp_async_wait<XD - 2>();   // (one commit group per chunk, empty ones past the last)
      __syncthreads();   // everyone's copies of chunk c landed; chunk c - 1's buffer is no longer read
      if (c == 0 && mt0 == 0) prof_mark(a, 8);   // the first chunk's activations landed
      if (c + XD - 1 < nchunks) stage(c + XD - 1);
      else if constexpr (XD > 2) cp_async_commit();
      const __nv_bfloat16* xc = xbuf + c % XD * NB * XS;
      for (int gc = 0; gc < groups; gc++) {
        uint4 na[MT * U], nb2[MT * U];
        load_group(c * groups + gc + 1, na, nb2);
        if (active) {
#pragma unroll
          for (int u = 0; u < U; u++) {
            const int kbu = kp + (gc * U + u) * ks;
            if (kbu < NKB && kc0 + kbu * 32 < K) {   // warp-uniform
#pragma unroll
              for (int n = 0; n < NT; n++) {
                const int off = (n * 8 + g) * XS + kbu * 32 + 8 * t;
                const uint4 bx = *reinterpret_cast<const uint4*>(xc + off);
#pragma unroll
                for (int j = 0; j < MT; j++) {
                  const uint4 &A = ca[j * U + u], &B = cb[j * U + u];
                  mma_bf16(acc[j][n], A.x, B.x, A.y, B.y, bx.x, bx.y);
                  mma_bf16(acc[j][n], A.z, B.z, A.w, B.w, bx.z, bx.w);
                }
              }
            }
          }
        }
#pragma unroll
        for (int u = 0; u < MT * U; u++) { ca[u] = na[u]; cb[u] = nb2[u]; }
      }
    }
    if constexpr (XD > 2) cp_async_wait_all();   // the zero-filled stages past a short K too
    __syncthreads();   // the chunk buffers are no longer read
    prof_mark(a, 9);   // the K loop's MMAs done (the last m-tile pass's)
    if (active)
#pragma unroll
      for (int j = 0; j < MT; j++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
          for (int i = 0; i < 4; i++) part[(((warp * MT + j) * NT + n) * 4 + i) * 32 + lane] = acc[j][n][i];
    __syncthreads();
    // The pass's m-tiles m (K part p of tile m: warp m / MT ks + p, its m-tile m % MT), each
    // output the fixed-order sum of its K parts, times the RMSNorm scale.
    // C fragment: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g + 8, same cols), so lane
    // ln's acc[n][i] is row 8 (i / 2) + ln / 4 of the m-tile, batch row 8 n + 2 (ln % 4) + i % 2.
    // Threads walk (m, n, i, ln) with ln fastest: a warp reads 32 consecutive partials (no bank
    // conflicts; with the batch row fastest, 8 lanes shared a bank) and its stores to outs hit 8
    // banks (32 lanes on one with nrows % 32 == 0).
    for (int idx = threadIdx.x; idx < mcount * MT * NT * 128; idx += NTHREADS) {
      const int ln = idx & 31, i = (idx >> 5) & 3, n = (idx >> 7) % NT, m = idx / (NT * 128);   // m-tile m of the pass
      const int r16 = (i >> 1) * 8 + (ln >> 2), b = n * 8 + (ln & 3) * 2 + (i & 1), r = (mt0 * MT + m) * 16 + r16;
      if (r >= nrows || b >= nb) continue;
      float v = 0.f;
      for (int p = 0; p < ks; p++) v += part[((((m / MT * ks + p) * MT + m % MT) * NT + n) * 4 + i) * 32 + ln];
#ifdef MK_GU_SPLIT
      if (src.nw) v *= rsqrtf(ss[b] / src.ldx + a.eps);   // the whole row's norm (a K slice's too)
#else
      if (src.nw) v *= rsqrtf(ss[b] / K + a.eps);
#endif
      outs[b * nrows + r] = v;
    }
    __syncthreads();   // part is read; the next m-tile pass refills the buffers under it
  }
}

static_assert(MMA_PASS % 8 == 0 && MMA_PASS <= 128, "matvec_mma dispatches up to 16 n-tiles");
__device__ void matvec_mma(const KernelArgs& a, int K, int b0, int nb, int nrows, const XSrc& src,
                           const RowMap& row, float* outs, float* sm) {
  if (nb <= 8) matvec_mma_nt<1>(a, K, b0, nb, nrows, src, row, outs, sm);
  else if (nb <= 16) matvec_mma_nt<2>(a, K, b0, nb, nrows, src, row, outs, sm);
  else if (nb <= 32) matvec_mma_nt<4>(a, K, b0, nb, nrows, src, row, outs, sm);
  else if (nb <= 64) matvec_mma_nt<8>(a, K, b0, nb, nrows, src, row, outs, sm);
  else matvec_mma_nt<16>(a, K, b0, nb, nrows, src, row, outs, sm);
}
#endif  // MK_HAS_MMA
