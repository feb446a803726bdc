// o_proj: must match tpmk/kernels/ops/o_proj.py (OProj). Merge the attention splits
// (while loading the input), rows [ROW0, ROW0+NROWS) of o_proj[l] ([H, Hq*D]),
// push the partial sum to attn slot[rank] of every peer.
#pragma once
#include "mk_linear.cuh"

__device__ __noinline__ void op_o_proj(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const XSrc src{nullptr, 0, nullptr, reinterpret_cast<const float*>(a.attn_part)};
  linear_push(a, ins, hdr[isa::H_BATCH], src, a.peer_attn_slots, smem);
}
