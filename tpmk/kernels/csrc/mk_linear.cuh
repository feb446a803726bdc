// linear(): the one entry point of every matvec op (qkv, o_proj, gate_up, down, lm_head).
// batch >= MMA_MIN_BATCH (bf16): tensor-core passes of up to MMA_PASS rows (mk_mma.cuh), each
// weight tile read once per pass; smaller batches: CUDA-core matvec over BATCH_CHUNK rows.
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"

// Batch rows per linear() call for a tile of nrows outputs.
__device__ __forceinline__ int linear_chunk(int batch, int nrows) {
#ifdef MK_HAS_MMA
  if (mma_batch(batch)) return mma_pass_rows(nrows);
#endif
  return BATCH_CHUNK;
}

// Returns outs [nb][nrows]: outs[b * nrows + r] = W[row(r)] . xin(b0 + b) for b < nb <=
// linear_chunk(batch, nrows). Ends with __syncthreads(): outs is readable by every thread
// (and writable until the caller's next __syncthreads()).
__device__ __noinline__ float* linear(const KernelArgs& a, int batch, int K, int b0, int nb, int nrows,
                         const XSrc& src, const RowMap& row, float* smem) {
  float* red = smem;
  float* base = smem + NWARPS * BATCH_CHUNK;
#ifdef MK_HAS_MMA
  if (mma_batch(batch)) {
    float* outs = base + MMA_OUT_AT;
    matvec_mma(a, K, b0, nb, nrows, src, row, outs, base);
    return outs;
  }
#endif
  float* xs = base;
  float* outs = xs + min(BATCH_CHUNK, a.bucket) * a.kmax;   // [nb][nrows] (megakernel.smem_bytes)
  prof_mark(a, 5);
#ifdef MK_GU_SPLIT
  load_normed(a, src.x, src.ldx, b0, nb, K, src.nw, xs, red, src.k0);
#else
  load_normed(a, src.x, src.ldx, b0, nb, K, src.nw, xs, red);
#endif
  prof_mark(a, 1);
  matvec(K, xs, nb, nrows, row, [&](int r, int b, float v) { outs[b * nrows + r] = v; });
  __syncthreads();
  prof_mark(a, 2);
  return outs;
}

// A row-parallel op (o_proj, down; `op` its opcode): this instruction's tile over every batch pass, each
// pass's [nb, n] partial sums pushed to rows b0.. of slot[rank] (columns ROW0..ROW0+n) of
// every peer, or of the tile's owner only (OWNER bit: reduce-scatter); `slots`: the
// peers' slot arrays ([tp, bucket, H] f32 each).
__device__ __forceinline__ void linear_push(const KernelArgs& a, const int* ins, int op, int batch, const XSrc& src,
                                            const unsigned long long* slots, float* smem) {
  if (batch > 0) prof_mark(a, 7);   // the op's entry
  Tile tile;
  linear_tile(a, ins, op, tile);
  const int c0 = ins[isa::F_ROW0], n = tile.nrows, chunk = linear_chunk(batch, n);
  const bool rs = ins[isa::F_SIGNAL_PEERS] & isa::SIG_OWNER;
  const int p0 = rs ? owner_rank(a, ins) : 0, p1 = rs ? p0 + 1 : a.tp;
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    const float* outs = linear(a, batch, tile.K, b0, nb, n, src, tile.rows, smem);   // [nb, n]
    prof_mark(a, 10);   // the pass's outputs staged (the last pass's)
    for (int i = threadIdx.x; i < nb * n; i += NTHREADS) {
      const size_t off = ((size_t)a.rank * a.bucket + b0 + i / n) * a.hidden + c0 + i % n;
      for (int p = p0; p < p1; p++) reinterpret_cast<float*>(slots[p])[off] = outs[i];
    }
    __syncthreads();
  }
}
