// lm_head: must match tpmk/kernels/ops/lm_head.py (LmHead). Final RMSNorm(x) @ local
// vocab rows [ROW0, ROW0+NROWS); padded ids -> NEG_INF; logits stored locally; the
// tile's best (value, global id; first id on ties) -> cand[rank, TILE, b] of every peer.
#pragma once
#include "mk_linear.cuh"

__device__ __noinline__ void op_lm_head(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], r0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS];
  const int tile = ins[isa::F_TILE], H = a.hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const wtype* W = reinterpret_cast<const wtype*>(a.lm_head) + (size_t)r0 * H;
  const RowMap rows{W, W, n, H};
  const XSrc src{reinterpret_cast<const float*>(a.x), H, reinterpret_cast<const wtype*>(a.final_norm), nullptr};
  float* logits = reinterpret_cast<float*>(a.logits);
  const int gid0 = a.rank * a.vocab_local + r0;
  const int chunk = linear_chunk(batch, n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    float* outs = linear(a, batch, H, b0, nb, n, src, rows, smem);   // [nb, n]
    for (int i = threadIdx.x; i < nb * n; i += NTHREADS) {
      const int b = i / n, r = i % n;
      const float v = gid0 + r < a.vocab_size ? outs[i] : isa::NEG_INF;
      logits[(size_t)(b0 + b) * a.vocab_local + r0 + r] = v;
      outs[i] = v;
    }
    __syncthreads();
    for (int b = warp; b < nb; b += NWARPS) {
      float best = __int_as_float(0xff800000);
      int arg = 0x7fffffff;
      for (int r = lane; r < n; r += 32) {
        const float v = outs[b * n + r];
        if (v > best) { best = v; arg = r; }   // lane-strided: first max within the lane
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
        if (ov > best || (ov == best && oa < arg)) { best = ov; arg = oa; }
      }
      if (lane == 0)
        for (int p = 0; p < a.tp; p++) {
          float* c = reinterpret_cast<float*>(a.peer_cand[p]) +
                     (((size_t)a.rank * a.n_lm_tiles + tile) * a.bucket + b0 + b) * 2;
          c[0] = best;
          c[1] = (float)(gid0 + arg);
        }
    }
    __syncthreads();
  }
}
