// residual: must match tpmk/kernels/ops/residual.py (Residual).
// x[b, cols] (+)= slot[0] + slot[1] + ... + slot[tp-1], fixed rank order (bit-identical ranks).
#pragma once
#include "mk_common.cuh"

__device__ void op_residual(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], c0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS];
  const int stage = ins[isa::F_ARG0], set = ins[isa::F_ARG1];
  const float* slots = reinterpret_cast<const float*>(
      (stage & 1) ? a.peer_attn_slots[a.rank] : a.peer_mlp_slots[a.rank]);
  float* x = reinterpret_cast<float*>(a.x);
  const size_t plane = (size_t)a.bucket * a.hidden;
  for (int idx = threadIdx.x; idx < batch * n; idx += NTHREADS) {
    const size_t off = (size_t)(idx / n) * a.hidden + c0 + idx % n;
    float acc = ld_act(slots + off);
    for (int r = 1; r < a.tp; r++) acc += ld_act(slots + r * plane + off);
    x[off] = set ? acc : ld_act(x + off) + acc;
  }
}
