// EXPERIMENTAL, off by default (KernelArgs.stream_weights; Megakernel(stream_weights=True)).
// Weight streaming for the CUDA-core matvec (batch <= BATCH_CHUNK): the plain matvec's
// loads, each lane's 16 bytes of each of its warp's MV_ROWS rows per K step, go through a
// per-thread ring of shared-memory slots filled by cp.async instead of registers. Every
// thread issues its first nstages steps when the instruction starts, BEFORE the dependency
// wait (weights never depend on the step's activations), and refills a slot as soon as it
// has read it. A thread only ever reads the bytes it copied itself: no barrier per step,
// the warps stay as independent as in the plain matvec, only deeper.
// History (H200, 2026-12-03, one Llama-3-70B tp=8 rank, batch 1, ctx 1024; plain 11.5 ms):
// whole rows per block-wide stage with one barrier and a block reduction per stage measured
// 22.7 ms with cp.async and 18.4 ms with TMA bulk copies: ~1 us of serial latency per
// stage (wait, shuffles, one thread summing 16 partials, barrier). This per-thread design
// has no per-step block work; it is NOT yet measured or GPU-tested.
//
// Shared memory of a streamed linear() (f32 words from the dynamic base; nb = min(batch, 4)):
//   red [NWARPS * BATCH_CHUNK] | xs [nb * kmax] | outs [nb * out_max] | ring
// ring: nstages slots of [MV_ROWS][NTHREADS] x 16 bytes (32 KB each): consecutive threads,
// consecutive 16 bytes (conflict-free). Fixed for the whole launch (it depends on the batch).
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"

#ifndef MK_RING_MAX
#define MK_RING_MAX 8
#endif
constexpr int RING_MAX = MK_RING_MAX;                 // steps in flight per thread at most
constexpr int SLOT_BYTES = MV_ROWS * NTHREADS * 16;   // one step of every thread

// Launch constants, written by thread 0 before the loop's first barrier.
struct Ring {
  int nstages;     // ring slots (0: streaming off)
  int outs, off;   // outputs and ring offsets (f32 words)
};

__device__ __forceinline__ Ring& ring() {
  __shared__ Ring r;
  return r;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Wait until at most n of this thread's cp.async groups are pending (0 <= n < 8).
__device__ __forceinline__ void cp_async_wait(int n) {
  switch (n) {
#define MK_WAIT_CASE(k) case k: asm volatile("cp.async.wait_group " #k ";" ::: "memory"); break;
    MK_WAIT_CASE(0) MK_WAIT_CASE(1) MK_WAIT_CASE(2) MK_WAIT_CASE(3) MK_WAIT_CASE(4) MK_WAIT_CASE(5)
    MK_WAIT_CASE(6)
#undef MK_WAIT_CASE
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}
static_assert(RING_MAX <= 8, "cp_async_wait covers up to 7 pending groups");

// Thread 0, once per launch.
__device__ void ring_init(const KernelArgs& a, int batch) {
  Ring& r = ring();
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const int nb = min(max(batch, 1), BATCH_CHUNK);
  r.outs = NWARPS * BATCH_CHUNK + nb * a.kmax;
  r.off = (r.outs + nb * a.out_max + 31) & ~31;
  const long long room = (long long)dyn - 4ll * r.off;
  r.nstages = !a.stream_weights || room < 2ll * SLOT_BYTES ? 0 : (int)min((long long)RING_MAX, room / SLOT_BYTES);
#ifdef MK_DEBUG_RING
  if (blockIdx.x == 0) printf("ring: dyn %u B, off %d words, %d slots of %d B\n", dyn, r.off, r.nstages, SLOT_BYTES);
#endif
}

// Does a linear() of this batch and K stream its weights? (Same answer for every thread.)
#ifdef MK_HAS_MMA
static_assert(MMA_MIN_BATCH > BATCH_CHUNK, "streamed batches must take the CUDA-core matvec");
#endif
__device__ __forceinline__ bool stream_on(int batch, int K) {
  return ring().nstages > 0 && batch >= 1 && batch <= BATCH_CHUNK && K % VEC == 0;
}

// One thread's step sequence over its warp's share of a tile: step t = (row group gi,
// K chunk kc) with t = gi * nk + kc; the lane's 16 bytes at k of each of the group's rows.
struct ThreadSteps {
  MvSplit m;
  int nk, steps;
  __device__ __forceinline__ ThreadSteps(int K, int nrows) : m(mv_split(K, nrows)) {
    constexpr int STEP = 32 * VEC;
    const int warp = threadIdx.x >> 5, gstep = NWARPS / m.ks, g0 = warp / m.ks;
    // At least one (empty) step per group: a warp past the end of K still writes its zero
    // split-K partials, as the plain matvec does.
    nk = m.kend > m.kbeg ? (m.kend - m.kbeg + STEP - 1) / STEP : 1;
    steps = g0 < m.groups ? (m.groups - g0 + gstep - 1) / gstep * nk : 0;
  }
  __device__ __forceinline__ int r0(int t) const { return ((threadIdx.x >> 5) / m.ks + t / nk * (NWARPS / m.ks)) * MV_ROWS; }
  __device__ __forceinline__ int k(int t) const { return m.kbeg + t % nk * 32 * VEC + (threadIdx.x & 31) * VEC; }
};

__device__ __forceinline__ uint4* ring_slot(float* smem, int slot, int j) {
  return reinterpret_cast<uint4*>(smem + ring().off) + (slot * MV_ROWS + j) * NTHREADS + threadIdx.x;
}

// Copy step t (one cp.async group, possibly empty) into slot t % nstages.
__device__ __forceinline__ void stream_issue(float* smem, const ThreadSteps& ts, const RowMap& row, int nrows, int t) {
  const int r0 = ts.r0(t), k = ts.k(t), slot = t % ring().nstages;
  if (k < ts.m.kend) {
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++) {
      const wtype* src = row(min(r0 + j, nrows - 1)) + k;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(ring_slot(smem, slot, j))), "l"(src)
                   : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Every thread, at an instruction's start (before its dependency wait): the first steps
// of its share of the tile, when the instruction streams. Returns whether it streams.
__device__ bool stream_start(const KernelArgs& a, const int* ins, int batch, float* smem) {
  if (ring().nstages == 0) return false;   // streaming off (the default): nothing per instruction
  Tile t;
  if (!linear_tile(a, ins, t) || !stream_on(batch, t.K)) return false;
  const ThreadSteps ts(t.K, t.nrows);
  for (int s = 0; s < min(ring().nstages, ts.steps); s++) stream_issue(smem, ts, t.rows, t.nrows, s);
  return true;
}

// The plain matvec (matvec_nb) with its weights from the ring: step t waits for its own
// group, reads its slot and computes, then refills the slot with step t + nstages.
template <int NB, typename OutFn>
__device__ void matvec_ring_nb(int K, const float* xs, int nrows, const RowMap& row, float* smem, OutFn out) {
  const ThreadSteps ts(K, nrows);
  const int nst = ring().nstages;
  float acc[MV_ROWS][NB];
  for (int t = 0; t < ts.steps; t++) {
    if (t % ts.nk == 0) {
#pragma unroll
      for (int j = 0; j < MV_ROWS; j++)
#pragma unroll
        for (int b = 0; b < NB; b++) acc[j][b] = 0.f;
    }
    cp_async_wait(min(ts.steps, nst + t) - t - 1);   // groups issued so far: min(steps, nst + t)
    const int k = ts.k(t);
    if (k < ts.m.kend) {
      uint4 u[MV_ROWS];
#pragma unroll
      for (int j = 0; j < MV_ROWS; j++) u[j] = *ring_slot(smem, t % nst, j);
      mv_fma<NB>(xs, K, k, u, acc);   // uses u: the slot is read before the refill below
    }
    if (t + nst < ts.steps) stream_issue(smem, ts, row, nrows, t + nst);
    if (t % ts.nk == ts.nk - 1) mv_group_out<NB>(ts.m, ts.r0(t), nrows, acc, out);
  }
  mv_combine<NB>(ts.m, nrows, out);
}

// outs[b * nrows + r]; out of line, so its registers never weigh on the plain path's.
__device__ __noinline__ void matvec_ring(int K, const float* xs, int nb, int nrows, const RowMap& row,
                                         float* smem, float* outs) {
  auto out = [&](int r, int b, float v) { outs[b * nrows + r] = v; };
  if (nb == 1) matvec_ring_nb<1>(K, xs, nrows, row, smem, out);
  else if (nb == 2) matvec_ring_nb<2>(K, xs, nrows, row, smem, out);
  else if (nb == 3) matvec_ring_nb<3>(K, xs, nrows, row, smem, out);
  else matvec_ring_nb<4>(K, xs, nrows, row, smem, out);
}
