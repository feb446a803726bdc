// o_proj: must match tpmk/kernels/ops/o_proj.py (OProj). Merge the attention splits
// (while loading the input), rows [ROW0, ROW0+NROWS) of o_proj[l] ([H, Hq*D]),
// push the partial sum to attn slot[rank] of every peer.
#pragma once
#include "mk_common.cuh"

__device__ void op_o_proj(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], l = ins[isa::F_LAYER], c0 = ins[isa::F_ROW0];
  const int n = ins[isa::F_NROWS], D = a.head_dim, S = a.num_splits, K = a.q_heads * D;
  float* xs = smem + NWARPS * BATCH_CHUNK;
  const float* part = reinterpret_cast<const float*>(a.attn_part);
  const wtype* W = reinterpret_cast<const wtype*>(a.o_proj) + (size_t)l * a.hidden * K;
  for (int b0 = 0; b0 < batch; b0 += BATCH_CHUNK) {
    const int nb = min(BATCH_CHUNK, batch - b0);
    for (int i = threadIdx.x; i < nb * K; i += NTHREADS) {
      const int b = i / K, h = (i % K) / D, d = i % D;
      const float* p = part + ((size_t)(b0 + b) * a.q_heads + h) * S * (D + 2);
      float M = isa::NEG_INF;
      for (int s = 0; s < S; s++) M = fmaxf(M, ld_act(p + s * (D + 2) + D));
      float num = 0.f, den = 0.f;
      for (int s = 0; s < S; s++) {
        const float w = expf(ld_act(p + s * (D + 2) + D) - M);
        num += w * ld_act(p + s * (D + 2) + d);
        den += w * ld_act(p + s * (D + 2) + D + 1);
      }
      xs[b * K + i % K] = num / den;
    }
    __syncthreads();
    matvec(K, xs, nb, n, [&](int r) { return W + (size_t)(c0 + r) * K; },
           [&](int r, int b, float v) {
             for (int p = 0; p < a.tp; p++)
               reinterpret_cast<float*>(a.peer_attn_slots[p])[((size_t)a.rank * a.bucket + b0 + b) * a.hidden + c0 + r] = v;
           });
    __syncthreads();
  }
}
