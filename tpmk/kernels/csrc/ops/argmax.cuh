// argmax: must match tpmk/kernels/ops/argmax.py (Argmax). Candidates in (rank, tile)
// order = increasing vocab id; strict '>' keeps the first maximum like torch.argmax.
#pragma once
#include "mk_common.cuh"

__device__ __noinline__ void op_argmax(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], nc = a.tp * a.n_lm_tiles;
  const float* cand = reinterpret_cast<const float*>(a.peer_cand[a.rank]);
  int* out = reinterpret_cast<int*>(a.tokens_out);
  for (int b = threadIdx.x; b < batch; b += NTHREADS) {
    float best = __int_as_float(0xff800000);
    int tok = -1;
    for (int c = 0; c < nc; c++) {
      const float v = ld_act(cand + ((size_t)c * a.bucket + b) * 2);
      if (v > best) { best = v; tok = (int)ld_act(cand + ((size_t)c * a.bucket + b) * 2 + 1); }
    }
    out[b] = tok;
  }
}
