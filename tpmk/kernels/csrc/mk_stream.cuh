// The weight stream of the CUDA-core matvec (batch <= BATCH_CHUNK): the tile's weights flow
// from HBM into shared memory by TMA bulk copies (cp.async.bulk, one mbarrier each), one
// private slot per warp, so no warp ever waits for another.
//   * The tile is cut into chunks (whole rows, or an equal K-range of one row when a row is
//     larger than a slot); warp w takes chunks w, w + NWARPS, ... through slot w.
//   * Every warp starts its first chunk BEFORE the instruction waits on its counters
//     (stream_begin, in the kernel loop): weights never depend on the step's activations, so
//     up to all of this SM's free shared memory arrives while it waits.
//   * A warp waits on its slot's barrier, sums its chunk, and its lane 0 starts its next chunk
//     into the same slot. Per-(row, K-range) sums go to part[] and are added in K order
//     (deterministic).
// Why per-warp slots: a ring shared by all warps (each stage split over the 16 warps, an
// `empty` barrier per stage) reached only ~15 GB/s per SM. An mbarrier wait costs ~250
// cycles even on a landed stage, and every warp paid it, plus an arrive and a warp
// reduction, per 16 KB stage. The TMA unit itself landed 128 KB in 2.1 us (~60 GB/s per SM).
// (H200 probes, 2026-12-04.)
// Barriers: full[w] (1 arrival + the chunk's bytes per phase) initialised once per launch
// (stream_init); uses[w] counts its completed phases, so warp w's i-th chunk of an instruction
// completes phase uses[w] + i (parity & 1). Re-initialising the 16 barriers per instruction
// cost thread 0 ~4 us before every wait (~250 cycles per mbarrier operation).
#pragma once
#include "mk_common.cuh"

constexpr int STREAM_SEG = 32 * VEC;   // elements per warp-wide sweep of 16-byte loads

// Shared-memory layout of a streamed linear() (f32 words after linear()'s `red`):
// xs [nb][Kp] (K padded to whole segments, each segment permuted: xperm4), outs [nb][nrows],
// part [nrows][m][nb], then NWARPS slots of slot_bytes at byte offset ring_off.
struct StreamPlan {
  int active;
  int K, nrows, n0;        // tile rows [0, n0) from w0, [n0, nrows) from w1 (row stride K)
  int R, m;                // a chunk: R whole rows (m == 1), or K / m of one row (R == 1)
  int nc0, total;          // chunks of block 0, all chunks
  unsigned slot_bytes, ring_off;
  const wtype* w0;
  const wtype* w1;
};

__device__ __forceinline__ StreamPlan& stream_plan() {
  __shared__ StreamPlan p;
  return p;
}

__device__ __forceinline__ unsigned long long* stream_bars() {   // full[NWARPS]
  __shared__ __align__(8) unsigned long long bars[NWARPS];
  return bars;
}

__device__ __forceinline__ unsigned* stream_uses() {   // completed phases of full[w]
  __shared__ unsigned uses[NWARPS];
  return uses;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra W;\n}" ::"r"(smem_addr(b)), "r"(parity) : "memory");
}

// xs row stride: K rounded up to whole segments (xperm4 of a partial last segment stays in it).
__device__ __forceinline__ int stream_kpad(int K) { return (K + STREAM_SEG - 1) / STREAM_SEG * STREAM_SEG; }

// The generic-proxy shared-memory accesses ordered before this point (by the caller's barrier:
// the op's __syncthreads, or the warp's __syncwarp after reading its slot) happen before the
// async-proxy writes of the copies this thread issues next.
__device__ __forceinline__ void stream_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Chunk c: rows [r, r + cnt) of the tile, K-range [k0, k0 + kn).
struct StreamChunk {
  int r, cnt, k0, kn;
};

__device__ __forceinline__ StreamChunk stream_chunk(const StreamPlan& p, int c) {
  const int base = c < p.nc0 ? 0 : p.n0, u = c < p.nc0 ? c : c - p.nc0, end = c < p.nc0 ? p.n0 : p.nrows;
  StreamChunk ch;
  if (p.m == 1) {
    ch.r = base + u * p.R;
    ch.cnt = min(p.R, end - ch.r);
    ch.k0 = 0;
    ch.kn = p.K;
  } else {
    ch.r = base + u / p.m;
    ch.cnt = 1;
    ch.kn = p.K / p.m;
    ch.k0 = u % p.m * ch.kn;
  }
  return ch;
}

// Any one thread, after stream_fence(): chunk c into its warp's slot (c % NWARPS), whose
// previous chunk that warp has read.
__device__ void stream_issue(const StreamPlan& p, float* smem, int c) {
  const StreamChunk ch = stream_chunk(p, c);
  const wtype* src = (ch.r < p.n0 ? p.w0 + (size_t)ch.r * p.K : p.w1 + (size_t)(ch.r - p.n0) * p.K) + ch.k0;
  // Whole rows are contiguous; a K-range is one row's.
  const unsigned bytes = (unsigned)(ch.cnt == 1 ? ch.kn : ch.cnt * p.K) * sizeof(wtype);
  unsigned long long* full = stream_bars() + c % NWARPS;
  char* dst = reinterpret_cast<char*>(smem) + p.ring_off + (size_t)(c % NWARPS) * p.slot_bytes;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(full)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(full)) : "memory");
}

// Lane 0 of every warp, before the instruction's counter waits: plan the stream of a linear
// op's tile (from linear_tile; every warp computes the same plan, thread 0 also stores it for
// the op) and start this warp's first chunk, so the 16 copies start in parallel (one thread
// issuing all of them took ~4 us). False (the register matvec runs) on the tensor-core path,
// for more than one batch pass, when the slots would be under 512 bytes, or for a row larger
// than a slot whose K is not whole segments.
__device__ bool stream_begin(const Tile& t, int batch, float* smem) {
  StreamPlan p;
  p.active = 0;
  const unsigned row_bytes = (unsigned)t.K * sizeof(wtype);
  const int nb = batch, segs = stream_kpad(t.K) / STREAM_SEG;
#ifndef MK_STREAM_OFF
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  // part[] is sized for the largest split, K / segs per chunk.
  const unsigned words = NWARPS * BATCH_CHUNK + nb * stream_kpad(t.K) + nb * t.nrows + t.nrows * segs * nb;
  p.ring_off = (4 * words + 127) & ~127u;
  p.slot_bytes = dyn > p.ring_off ? (dyn - p.ring_off) / NWARPS / 128 * 128 : 0;
  p.active = !mma_batch(batch) && batch <= BATCH_CHUNK && t.nrows > 0 && p.slot_bytes >= 512 &&
             (row_bytes <= p.slot_bytes || t.K % STREAM_SEG == 0);
#endif
  if (threadIdx.x == 0) stream_plan().active = p.active;
  if (!p.active) return false;
  if (row_bytes <= p.slot_bytes) {
    p.m = 1;
    p.R = p.slot_bytes / row_bytes;
  } else {   // the fewest equal K-ranges of whole segments that fit a slot
    p.R = 1;
    p.m = (row_bytes + p.slot_bytes - 1) / p.slot_bytes;
    while (segs % p.m != 0) p.m++;
  }
  p.K = t.K;
  p.nrows = t.nrows;
  p.n0 = min(t.rows.n0, t.nrows);
  p.w0 = t.rows.w0;
  p.w1 = t.rows.w1;
  p.nc0 = p.m == 1 ? (p.n0 + p.R - 1) / p.R : p.n0 * p.m;
  p.total = p.nc0 + (p.m == 1 ? (p.nrows - p.n0 + p.R - 1) / p.R : (p.nrows - p.n0) * p.m);
  if (threadIdx.x == 0) stream_plan() = p;
  const int warp = threadIdx.x >> 5;
  if (warp < p.total) {
    stream_fence();
    stream_issue(p, smem, warp);
  }
  return true;
}

// Thread 0, once per launch, before the first __syncthreads.
__device__ void stream_init() {
  for (int w = 0; w < NWARPS; w++) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(stream_bars() + w)) : "memory");
    stream_uses()[w] = 0;
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");   // the inits -> the TMA unit
}

// Thread 0, when the instruction is abandoned (timeout, abort), after a __syncthreads: its
// copies still land in shared memory; wait for them before the CTA exits.
__device__ void stream_drain() {
  const StreamPlan& p = stream_plan();
  if (!p.active) return;
  for (int c = 0; c < min(NWARPS, p.total); c++) mbar_wait(stream_bars() + c, stream_uses()[c] & 1);
}

// Every warp: its chunks; each (row, K-range) sum -> part[(row * m + q) * NB + b].
// xs: the inputs with each lane's VEC elements of a segment at float4s lane and 32 + lane
// (xperm4; bf16), or lane (f32).
template <int NB>
__device__ void stream_consume(const StreamPlan& p, float* smem, const float* xs, float* part) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, Kp = stream_kpad(p.K);
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  unsigned long long* full = stream_bars() + warp;
  const wtype* slot = reinterpret_cast<const wtype*>(reinterpret_cast<const char*>(smem) + p.ring_off +
                                                     (size_t)warp * p.slot_bytes);
  const unsigned uses = stream_uses()[warp];
  int i = 0;
  for (int c = warp; c < p.total; c += NWARPS, i++) {
    const StreamChunk ch = stream_chunk(p, c);
    const int nseg = (ch.kn + STREAM_SEG - 1) / STREAM_SEG;
    mbar_wait(full, (uses + i) & 1);
    for (int j = 0; j < ch.cnt; j++) {
      float acc[NB];
#pragma unroll
      for (int b = 0; b < NB; b++) acc[b] = 0.f;
#pragma unroll 4
      for (int sg = 0; sg < nseg; sg++) {
        const int k = sg * STREAM_SEG + lane * VEC;   // within the chunk's K-range
        if (k >= ch.kn) continue;                     // a partial last segment
        float f[VEC];
        unpack(*reinterpret_cast<const uint4*>(slot + (size_t)j * ch.kn + k), f);
        const int x0 = (ch.k0 + sg * STREAM_SEG) / 4 + lane;
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
          for (int h = 0; h < VEC / 4; h++) {
            const float4 xv = x4[b * Kp / 4 + x0 + h * 32];
            acc[b] += f[4 * h] * xv.x + f[4 * h + 1] * xv.y + f[4 * h + 2] * xv.z + f[4 * h + 3] * xv.w;
          }
      }
      const int q = ch.k0 / ch.kn;
#pragma unroll
      for (int b = 0; b < NB; b++) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) part[((ch.r + j) * p.m + q) * NB + b] = v;
      }
    }
    __syncwarp();   // every lane's reads of the slot precede lane 0's next copy into it
    if (lane == 0 && c + NWARPS < p.total) {
      stream_fence();
      stream_issue(p, smem, c + NWARPS);
    }
  }
  if (lane == 0) stream_uses()[warp] = uses + i;   // read again after the op's __syncthreads
}

// linear() on the stream (stream_plan().active): outs [NB][nrows], readable by every thread.
template <int NB>
__device__ float* linear_stream(const KernelArgs& a, const XSrc& src, float* smem) {
  const StreamPlan& p = stream_plan();
  float* xs = smem + NWARPS * BATCH_CHUNK;
  float* outs = xs + NB * stream_kpad(p.K);
  float* part = outs + NB * p.nrows;
  load_normed(a, src.x, src.ldx, 0, NB, p.K, src.nw, xs, smem, true, stream_kpad(p.K));   // ends with __syncthreads
  stream_consume<NB>(p, smem, xs, part);
  __syncthreads();
  for (int i = threadIdx.x; i < NB * p.nrows; i += NTHREADS) {
    const int b = i / p.nrows, r = i % p.nrows;
    float t = 0.f;
    for (int q = 0; q < p.m; q++) t += part[(r * p.m + q) * NB + b];
    outs[i] = t;
  }
  __syncthreads();
  return outs;
}
