// o_proj: must match tpmk/kernels/ops/o_proj.py (OProj). Merge the attention splits
// (while loading the input), rows [ROW0, ROW0+NROWS) of o_proj[l] ([H, Hq*D]),
// push the partial sum to attn slot[rank] of every peer.
#pragma once
#include "mk_linear.cuh"

__device__ __noinline__ void op_o_proj(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], c0 = ins[isa::F_ROW0];
  const int n = ins[isa::F_NROWS], K = a.q_heads * a.head_dim;
  Tile tile;
  linear_tile(a, ins, tile);
  const XSrc src{nullptr, 0, nullptr, reinterpret_cast<const float*>(a.attn_part)};
  const int chunk = linear_chunk(batch, n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    const float* outs = linear(a, batch, K, b0, nb, n, src, tile.rows, smem);   // [nb, n]
    for (int i = threadIdx.x; i < nb * n; i += NTHREADS) {
      const size_t off = ((size_t)a.rank * a.bucket + b0 + i / n) * a.hidden + c0 + i % n;
      for (int p = 0; p < a.tp; p++) reinterpret_cast<float*>(a.peer_attn_slots[p])[off] = outs[i];
    }
    __syncthreads();
  }
}
