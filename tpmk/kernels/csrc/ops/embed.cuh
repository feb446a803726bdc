// embed: must match tpmk/kernels/ops/embed.py (Embed). Columns [ROW0, ROW0+NROWS) of
// the owning rank's embedding row (zeros elsewhere) -> slot[rank] of every peer (stage 0).
#pragma once
#include "mk_common.cuh"

__device__ __noinline__ void op_embed(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), c0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS];
  const int* tokens = hdr + isa::HDR_TOKENS;
  const wtype* E = reinterpret_cast<const wtype*>(a.embed);
  for (int idx = threadIdx.x; idx < batch * n; idx += NTHREADS) {
    const int b = idx / n, c = c0 + idx % n;
    const int local = tokens[b] - a.rank * a.vocab_local;
    const float v = (local >= 0 && local < a.vocab_local) ? to_f(E[(size_t)local * a.hidden + c]) : 0.f;
    for (int p = 0; p < a.tp; p++)
      reinterpret_cast<float*>(a.peer_mlp_slots[p])[((size_t)a.rank * a.bucket + b) * a.hidden + c] = v;
  }
}
