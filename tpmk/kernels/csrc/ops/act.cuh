// act: must match tpmk/kernels/ops/act.py (Act). Columns [ROW0, ROW0+NROWS) of a gate_up split
// over ARG0 K slices: gate and up summed over gu_part[0..ARG0) in slice order, silu(gate) * up
// -> act (and act_bf for down's tensor cores). The partials come from other SMs: L2 loads.
#pragma once
#include "ops/gate_up.cuh"

__device__ void op_act(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), c0 = ins[isa::F_ROW0], n4 = ins[isa::F_NROWS] / 4, S = ins[isa::F_ARG0];
  const int I = a.inter;
  const size_t slice = (size_t)a.bucket * 2 * I;   // f32 words per K slice
  const float4* part = reinterpret_cast<const float4*>(gu_part(a));
  float* act = reinterpret_cast<float*>(a.act);
  __nv_bfloat16* act_bf = reinterpret_cast<__nv_bfloat16*>(a.act_bf);
  const bool mma = mma_batch(batch);
  for (int i = threadIdx.x; i < batch * n4; i += NTHREADS) {   // 4 columns per thread
    const int b = i / n4, c = c0 + i % n4 * 4;
    const size_t g4 = ((size_t)b * 2 * I + c) / 4, u4 = g4 + I / 4;
    float4 gt = __ldcg(part + g4), up = __ldcg(part + u4);
    for (int j = 1; j < S; j++) {
      const float4 g = __ldcg(part + j * slice / 4 + g4), u = __ldcg(part + j * slice / 4 + u4);
      gt.x += g.x; gt.y += g.y; gt.z += g.z; gt.w += g.w;
      up.x += u.x; up.y += u.y; up.z += u.z; up.w += u.w;
    }
    const float4 v = make_float4(silu(gt.x) * up.x, silu(gt.y) * up.y, silu(gt.z) * up.z, silu(gt.w) * up.w);
    const size_t off = (size_t)b * I + c;
    *reinterpret_cast<float4*>(act + off) = v;
    if (mma) store_bf16x4(act_bf, off, v);
  }
}
