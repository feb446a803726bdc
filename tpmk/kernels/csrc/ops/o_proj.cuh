// o_proj: must match tpmk/kernels/ops/o_proj.py (OProj). attn_out (merged by the attention
// groups' last splits) @ rows [ROW0, ROW0+NROWS) of o_proj[l] ([H, Hq*D]), push the
// partial sum to attn slot[rank] of every peer.
#pragma once
#include "mk_linear.cuh"

__device__ LINEAR_OP void op_o_proj(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const XSrc src{reinterpret_cast<const float*>(a.attn_out), a.q_heads * a.head_dim, nullptr,
                 reinterpret_cast<const __nv_bfloat16*>(a.attn_bf), nullptr, 0};
  linear_push(a, ins, isa::OP_O_PROJ, step_batch(), src, a.peer_attn_slots, smem);
}
