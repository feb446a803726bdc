// The weight stream of the CUDA-core matvec (batch <= BATCH_CHUNK): the tile's rows flow
// from HBM into a ring of shared-memory stages by TMA bulk copies (cp.async.bulk with an
// mbarrier each), with no register staging and no block-wide barrier per stage.
//   * Thread 0 fills the first S stages BEFORE the instruction waits on its counters
//     (stream_begin in the kernel loop): weights never depend on the step's activations,
//     so up to the whole free shared memory of this SM arrives while it waits.
//   * Then every warp takes its share of each stage's 16-byte vectors, and arrives on the
//     stage's `empty` barrier; warp 0's lane 0 refills a stage once all 16 warps left it.
//   * Each warp's per-row partial sums land in part[row][b][warp], summed in warp order
//     (deterministic) after the last stage.
// Barrier protocol per instruction: thread 0 re-initialises full[i] (1 arrival + the
// stage's bytes) and empty[i] (NWARPS arrivals) for i < S, after the previous op's final
// __syncthreads (no arrival or copy on them is pending then). Stage s lives in slot s % S
// and completes full-barrier phase (s / S) & 1.
#pragma once
#include "mk_common.cuh"

constexpr int STREAM_SLOTS = 16;               // most ring stages
#ifndef MK_STREAM_STAGE
#define MK_STREAM_STAGE (16 * 1024)
#endif
constexpr unsigned STREAM_STAGE = MK_STREAM_STAGE;   // bytes per stage (whole rows; one row if larger)
constexpr int STREAM_SEG = 32 * VEC;           // elements per warp-wide sweep of 16-byte loads

// Shared-memory layout of a streamed linear() (f32 words after linear()'s `red`):
// xs [nb][Kp] (K padded to whole SEG-wide segments, each permuted: xperm4), outs [nb][nrows],
// part [nrows][nb][NWARPS], then the ring at byte offset ring_off.
struct StreamPlan {
  int active;
  int K, nrows, n0;       // tile rows [0, n0) from w0, [n0, nrows) from w1 (row stride K)
  int R, nst0, total, S;  // rows per stage, stages of block 0, all stages, ring slots
  unsigned stage_bytes, ring_off;
  const wtype* w0;
  const wtype* w1;
  unsigned long long* mark;   // MK_STREAM_MARK experiments: this instruction's profile start
};

#ifdef MK_STREAM_MARK
#define STREAM_MARK(n) \
  if (MK_STREAM_MARK == (n) && threadIdx.x == 0 && p.mark) *p.mark = globaltimer_ns();
#else
#define STREAM_MARK(n)
#endif

__device__ __forceinline__ StreamPlan& stream_plan() {
  __shared__ StreamPlan p;
  return p;
}

__device__ __forceinline__ unsigned long long* stream_bars() {   // full[STREAM_SLOTS], empty[...]
  __shared__ __align__(8) unsigned long long bars[2 * STREAM_SLOTS];
  return bars;
}

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_inval(unsigned long long* b) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(b)) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
#ifdef MK_STREAM_TESTWAIT
  asm volatile(
      "{\n .reg .pred p;\n"
      "W: mbarrier.test_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W;\n}" ::"r"(smem_addr(b)), "r"(parity) : "memory");
  return;
#endif
  asm volatile(
      "{\n .reg .pred p;\n"
      "W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W;\n}" ::"r"(smem_addr(b)), "r"(parity) : "memory");
}

// rows [r, r + cnt) of the tile: stage s's share.
__device__ __forceinline__ void stream_stage_rows(const StreamPlan& p, int s, int& r, int& cnt) {
  if (s < p.nst0) {
    r = s * p.R;
    cnt = min(p.R, p.n0 - r);
  } else {
    r = p.n0 + (s - p.nst0) * p.R;
    cnt = min(p.R, p.nrows - r);
  }
}

// Thread 0: stage s into slot s % S. The caller has waited on that slot's empty barrier
// (s >= S). The proxy fence orders this CTA's earlier generic accesses of the slot before
// the async-proxy writes of the copy.
__device__ void stream_issue(const StreamPlan& p, float* smem, int s) {
  int r, cnt;
  stream_stage_rows(p, s, r, cnt);
  const wtype* src = r < p.n0 ? p.w0 + (size_t)r * p.K : p.w1 + (size_t)(r - p.n0) * p.K;
  const unsigned bytes = (unsigned)cnt * p.K * sizeof(wtype);
  unsigned long long* full = stream_bars() + s % p.S;
  char* dst = reinterpret_cast<char*>(smem) + p.ring_off + (size_t)(s % p.S) * p.stage_bytes;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(full)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(full)) : "memory");
}

// xs row stride: K rounded up to whole segments (xperm4 of a partial last segment stays in it).
__device__ __forceinline__ int stream_kpad(int K) { return (K + STREAM_SEG - 1) / STREAM_SEG * STREAM_SEG; }

// Thread 0, before the instruction's counter waits: plan the stream of a linear op's tile
// (tile: from linear_tile) and start its first S stages. Inactive (the register matvec
// runs) on the tensor-core path, for more than one batch pass, or when fewer than 3 stages fit.
__device__ bool stream_begin(const KernelArgs& a, const Tile& t, int batch, float* smem) {
  StreamPlan& p = stream_plan();
  p.active = 0;
#ifdef MK_STREAM_OFF
  return false;
#endif
  if (mma_batch(batch) || batch > BATCH_CHUNK || t.nrows <= 0) return false;
  const unsigned row_bytes = (unsigned)t.K * sizeof(wtype);
  const int nb = batch, Kp = stream_kpad(t.K);
  const unsigned words = NWARPS * BATCH_CHUNK + nb * Kp + nb * t.nrows + t.nrows * nb * NWARPS;
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  p.ring_off = (4 * words + 127) & ~127u;
  p.R = max(1u, STREAM_STAGE / row_bytes);
  p.stage_bytes = p.R * row_bytes;
  if (dyn < p.ring_off + 3 * p.stage_bytes) return false;
  p.S = min(STREAM_SLOTS, (int)((dyn - p.ring_off) / p.stage_bytes));
  p.K = t.K;
  p.nrows = t.nrows;
  p.n0 = min(t.rows.n0, t.nrows);
  p.w0 = t.rows.w0;
  p.w1 = t.rows.w1;
  p.nst0 = (p.n0 + p.R - 1) / p.R;
  p.total = p.nst0 + (p.nrows - p.n0 + p.R - 1) / p.R;
  p.active = 1;
  unsigned long long* bars = stream_bars();
  for (int i = 0; i < p.S; i++) {
    mbar_inval(bars + i);
    mbar_inval(bars + STREAM_SLOTS + i);
    mbar_init(bars + i, 1);
    mbar_init(bars + STREAM_SLOTS + i, NWARPS);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");   // inits -> the TMA unit
  for (int s = 0; s < min(p.S, p.total); s++) stream_issue(p, smem, s);
#ifdef MK_STREAM_LAND
  const unsigned long long t0 = globaltimer_ns();
  for (int s = 0; s < min(p.S, p.total); s++) mbar_wait(stream_bars() + s, 0);
  if (p.mark) p.mark[1] = globaltimer_ns() - t0;   // overwritten by the op's end
  const long long c0 = clock64();
  for (int s = 0; s < min(p.S, p.total); s++) mbar_wait(stream_bars() + s, 0);
  const long long c1 = clock64();
  if (p.mark && blockIdx.x == 50)
    printf("land %d stages %u B: %llu ns; waits on landed stages %lld cycles each\n", min(p.S, p.total),
           p.stage_bytes, globaltimer_ns() - t0, (c1 - c0) / min(p.S, p.total));
#endif
  return true;
}

// Thread 0, when the instruction is abandoned (timeout, abort): its copies still land in
// shared memory; wait for them before the CTA exits.
__device__ void stream_drain() {
  const StreamPlan& p = stream_plan();
  if (!p.active) return;
  for (int s = 0; s < min(p.S, p.total); s++) mbar_wait(stream_bars() + s, 0);
}

// Every warp: its contiguous share of each stage's (row, segment) sweeps; the per-row sums
// -> part[(row * NB + b) * NWARPS + warp] (the rows a warp does not touch keep 0). xs: the
// inputs with each lane's VEC elements of a segment at float4s lane and 32 + lane (xperm4).
template <int NB>
__device__ void stream_consume(const StreamPlan& p, float* smem, const float* xs, float* part) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int segs = (p.K + STREAM_SEG - 1) / STREAM_SEG, Kp = stream_kpad(p.K);
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  unsigned long long* bars = stream_bars();
#ifdef MK_STREAM_CLOCKS
  long long cw = 0, cc = 0, cf = 0, ct = clock64();
#endif
  for (int s = 0; s < p.total; s++) {
    const int slot = s % p.S;
    if (threadIdx.x == 0 && s >= 1 && s - 1 + p.S < p.total) {   // refill stage s - 1's slot
      mbar_wait(bars + STREAM_SLOTS + (s - 1) % p.S, ((s - 1) / p.S) & 1);
      stream_issue(p, smem, s - 1 + p.S);
    }
#ifdef MK_STREAM_LANE0
    if (lane == 0) mbar_wait(bars + slot, (s / p.S) & 1);
    __syncwarp();
#else
    mbar_wait(bars + slot, (s / p.S) & 1);
#endif
    if (s == 0) { STREAM_MARK(2) }
#ifdef MK_STREAM_CLOCKS
    const long long cw1 = clock64();
    cw += cw1 - ct;
#endif
    int r, cnt;
    stream_stage_rows(p, s, r, cnt);
    const wtype* ws = reinterpret_cast<const wtype*>(reinterpret_cast<const char*>(smem) + p.ring_off +
                                                     (size_t)slot * p.stage_bytes);
    const int items = cnt * segs, it0 = warp * items / NWARPS, it1 = (warp + 1) * items / NWARPS;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; b++) acc[b] = 0.f;
    int jcur = it0 / segs;
    auto flush = [&]() {
#pragma unroll
      for (int b = 0; b < NB; b++) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) part[((r + jcur) * NB + b) * NWARPS + warp] = v;
        acc[b] = 0.f;
      }
    };
    for (int it = it0; it < it1; it++) {
      const int j = it / segs, sg = it - j * segs;
      if (j != jcur) {
        flush();
        jcur = j;
      }
      if (sg * STREAM_SEG + lane * VEC >= p.K) continue;   // a partial last segment
#ifdef MK_STREAM_NOCOMPUTE
      continue;
#endif
      float f[VEC];
      unpack(*reinterpret_cast<const uint4*>(ws + (size_t)j * p.K + sg * STREAM_SEG + lane * VEC), f);
#pragma unroll
      for (int b = 0; b < NB; b++)
#pragma unroll
        for (int h = 0; h < VEC / 4; h++) {
          const float4 xv = x4[(b * Kp + sg * STREAM_SEG) / 4 + h * 32 + lane];
          acc[b] += f[4 * h] * xv.x + f[4 * h + 1] * xv.y + f[4 * h + 2] * xv.z + f[4 * h + 3] * xv.w;
        }
    }
#ifdef MK_STREAM_CLOCKS
    const long long cc1 = clock64();
    cc += cc1 - cw1;
#endif
    if (it0 < it1) flush();
    __syncwarp();
    if (lane == 0) mbar_arrive(bars + STREAM_SLOTS + slot);
#ifdef MK_STREAM_CLOCKS
    ct = clock64();
    cf += ct - cc1;
#endif
  }
#ifdef MK_STREAM_CLOCKS
  if (p.mark && blockIdx.x == 50 && threadIdx.x == 32)
    printf("clocks K %d rows %d stages %d: wait %lld compute %lld flush+arrive %lld per stage\n", p.K, p.nrows,
           p.total, cw / p.total, cc / p.total, cf / p.total);
#endif
}

// linear() on the stream (stream_plan().active): outs [NB][nrows], readable by every thread.
template <int NB>
__device__ float* linear_stream(const KernelArgs& a, const XSrc& src, float* smem) {
  const StreamPlan& p = stream_plan();
  float* xs = smem + NWARPS * BATCH_CHUNK;
  float* outs = xs + NB * stream_kpad(p.K);
  float* part = outs + NB * p.nrows;
  for (int i = threadIdx.x; i < p.nrows * NB * NWARPS; i += NTHREADS) part[i] = 0.f;
  load_normed(a, src.x, src.ldx, 0, NB, p.K, src.nw, xs, smem, true, stream_kpad(p.K));   // ends with __syncthreads
  STREAM_MARK(1)
  stream_consume<NB>(p, smem, xs, part);
  STREAM_MARK(3)
  __syncthreads();
  for (int i = threadIdx.x; i < NB * p.nrows; i += NTHREADS) {
    const float* pr = part + ((i % p.nrows) * NB + i / p.nrows) * NWARPS;
    float t = 0.f;
    for (int w = 0; w < NWARPS; w++) t += pr[w];
    outs[i] = t;
  }
  __syncthreads();
  return outs;
}
