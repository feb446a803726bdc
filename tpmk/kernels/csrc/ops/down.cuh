// down: must match tpmk/kernels/ops/down.py (Down). act @ rows [ROW0, ROW0+NROWS) of
// down[l] ([H, I]); push the partial sum to MLP slot[rank] of every peer.
#pragma once
#include "mk_linear.cuh"

__device__ LINEAR_OP void op_down(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const XSrc src{reinterpret_cast<const float*>(a.act), a.inter, nullptr,
                 reinterpret_cast<const __nv_bfloat16*>(a.act_bf), nullptr, 0};
  linear_push(a, ins, isa::OP_DOWN, step_batch(), src, a.peer_mlp_slots, smem);
}
