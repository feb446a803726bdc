// down: must match tpmk/kernels/ops/down.py (Down). act @ rows [ROW0, ROW0+NROWS) of
// down[l] ([H, I]); push the partial sum to MLP slot[rank] of every peer.
#pragma once
#include "mk_common.cuh"

__device__ void op_down(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], l = ins[isa::F_LAYER], c0 = ins[isa::F_ROW0];
  const int n = ins[isa::F_NROWS], I = a.inter;
  float* red = smem;
  float* xs = red + NWARPS * BATCH_CHUNK;
  const wtype* W = reinterpret_cast<const wtype*>(a.down) + (size_t)l * a.hidden * I;
  for (int b0 = 0; b0 < batch; b0 += BATCH_CHUNK) {
    const int nb = min(BATCH_CHUNK, batch - b0);
    load_normed(a, reinterpret_cast<const float*>(a.act), I, b0, nb, I, nullptr, xs, red);
    matvec(I, xs, nb, n, [&](int r) { return W + (size_t)(c0 + r) * I; },
           [&](int r, int b, float v) {
             for (int p = 0; p < a.tp; p++)
               reinterpret_cast<float*>(a.peer_mlp_slots[p])[((size_t)a.rank * a.bucket + b0 + b) * a.hidden + c0 + r] = v;
           });
    __syncthreads();
  }
}
