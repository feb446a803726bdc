// gate_up: must match tpmk/kernels/ops/gate_up.py (GateUp). RMSNorm(x) @ gate rows
// [ROW0, ROW0+NROWS) and up rows I + same; act = silu(gate) * up.
#pragma once
#include "mk_common.cuh"

__device__ void op_gate_up(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], l = ins[isa::F_LAYER], c0 = ins[isa::F_ROW0];
  const int n = ins[isa::F_NROWS], H = a.hidden, I = a.inter;
  float* red = smem;
  float* xs = red + NWARPS * BATCH_CHUNK;
  float* outs = xs + BATCH_CHUNK * a.kmax;   // [nb, 2n]
  const wtype* W = reinterpret_cast<const wtype*>(a.gate_up) + (size_t)l * 2 * I * H;
  float* act = reinterpret_cast<float*>(a.act);
  for (int b0 = 0; b0 < batch; b0 += BATCH_CHUNK) {
    const int nb = min(BATCH_CHUNK, batch - b0);
    load_normed(a, reinterpret_cast<const float*>(a.x), H, b0, nb, H,
                reinterpret_cast<const wtype*>(a.post_norm) + (size_t)l * H, xs, red);
    matvec(H, xs, nb, 2 * n, [&](int r) { return W + (size_t)(r < n ? c0 + r : I + c0 + r - n) * H; },
           [&](int r, int b, float v) { outs[b * 2 * n + r] = v; });
    __syncthreads();
    for (int i = threadIdx.x; i < nb * n; i += NTHREADS) {
      const int b = i / n, c = i % n;
      const float gt = outs[b * 2 * n + c], up = outs[b * 2 * n + n + c];
      act[(size_t)(b0 + b) * I + c0 + c] = gt / (1.f + expf(-gt)) * up;
    }
    __syncthreads();
  }
}
