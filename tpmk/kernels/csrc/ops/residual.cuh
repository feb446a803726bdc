// residual: must match tpmk/kernels/ops/residual.py (Residual).
// x[b, cols] (+)= slot[0] + slot[1] + ... + slot[tp-1], fixed rank order (bit-identical ranks).
// All-gather form (OWNER bit; runs on the owner only): the result also goes to every peer's x.
#pragma once
#include "mk_common.cuh"

__device__ __noinline__ void op_residual(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], c0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS];
  const int stage = ins[isa::F_ARG0], set = ins[isa::F_ARG1];
  const bool ag = ins[isa::F_SIGNAL_PEERS] & isa::SIG_OWNER;   // peer_x[rank] is this rank's x
  const float* slots = reinterpret_cast<const float*>(
      (stage & 1) ? a.peer_attn_slots[a.rank] : a.peer_mlp_slots[a.rank]);
  float* x = reinterpret_cast<float*>(a.x);
  const size_t plane = (size_t)a.bucket * a.hidden;
  const int n4 = n / 4;   // tiles and hidden are multiples of 8 (host-checked): float4 columns
  for (int idx = threadIdx.x; idx < batch * n4; idx += NTHREADS) {
    const size_t off = (size_t)(idx / n4) * a.hidden + c0 + 4 * (idx % n4);
    float4 v[isa::MAX_TP];   // every rank's partial and x in one round trip
#pragma unroll
    for (int r = 0; r < isa::MAX_TP; r++)
      if (r < a.tp) v[r] = __ldcg(reinterpret_cast<const float4*>(slots + r * plane + off));
    const float4 xo = set ? make_float4(0.f, 0.f, 0.f, 0.f) : __ldcg(reinterpret_cast<const float4*>(x + off));
    float4 acc = v[0];
#pragma unroll
    for (int r = 1; r < isa::MAX_TP; r++)
      if (r < a.tp) { acc.x += v[r].x; acc.y += v[r].y; acc.z += v[r].z; acc.w += v[r].w; }
    if (!set) { acc.x = xo.x + acc.x; acc.y = xo.y + acc.y; acc.z = xo.z + acc.z; acc.w = xo.w + acc.w; }
    if (ag) {
      for (int p = 0; p < a.tp; p++) *reinterpret_cast<float4*>(reinterpret_cast<float*>(a.peer_x[p]) + off) = acc;
    } else {
      *reinterpret_cast<float4*>(x + off) = acc;
    }
  }
}
