// gate_up: must match tpmk/kernels/ops/gate_up.py (GateUp). RMSNorm(x) @ gate rows
// [ROW0, ROW0+NROWS) and up rows I + same; act = silu(gate) * up.
#pragma once
#include "mk_linear.cuh"

__device__ __noinline__ void op_gate_up(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], l = ins[isa::F_LAYER], c0 = ins[isa::F_ROW0];
  const int n = ins[isa::F_NROWS], H = a.hidden, I = a.inter;
  Tile tile;
  linear_tile(a, ins, tile);   // gate rows c0 + i, then up rows I + c0 + i
  const XSrc src{reinterpret_cast<const float*>(a.x), H,
                 reinterpret_cast<const wtype*>(a.post_norm) + (size_t)l * H};
  float* act = reinterpret_cast<float*>(a.act);
  const int chunk = linear_chunk(batch, 2 * n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    const float* outs = linear(a, batch, H, b0, nb, 2 * n, src, tile.rows, smem);   // [nb, 2n]
    for (int i = threadIdx.x; i < nb * n; i += NTHREADS) {
      const int b = i / n, c = i % n;
      const float gt = outs[b * 2 * n + c], up = outs[b * 2 * n + n + c];
      act[(size_t)(b0 + b) * I + c0 + c] = gt / (1.f + expf(-gt)) * up;
    }
    __syncthreads();
  }
}
