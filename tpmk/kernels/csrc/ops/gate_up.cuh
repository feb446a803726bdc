// gate_up: must match tpmk/kernels/ops/gate_up.py (GateUp). RMSNorm(x) @ gate rows
// [ROW0, ROW0+NROWS) and up rows I + same; act = silu(gate) * up.
#pragma once
#include "mk_linear.cuh"

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// gate_up's input rows: x through the layer's post-attention RMSNorm.
__device__ __forceinline__ XSrc gate_up_src(const KernelArgs& a, const int* ins) {
  return normed_x(a, reinterpret_cast<const wtype*>(a.post_norm) + (size_t)ins[isa::F_LAYER] * a.hidden);
}

// Where a gate_up tile's activations go: columns c0 .. c0 + n of act ([batch, I]), and of its
// bf16 copy for down's tensor cores at a tensor-core batch (mma).
struct GateUpOut {
  float* act;
  __nv_bfloat16* act_bf;
  int c0, n, I;
  bool mma;
};
__device__ __forceinline__ GateUpOut gate_up_dest(const KernelArgs& a, const int* ins, int batch) {
  return GateUpOut{reinterpret_cast<float*>(a.act), reinterpret_cast<__nv_bfloat16*>(a.act_bf), ins[isa::F_ROW0],
                   ins[isa::F_NROWS], a.inter, mma_batch(batch)};
}

// One pass's outputs [nb, 2n] (gate columns, then up) -> act = silu(gate) * up, rows b0..
__device__ __forceinline__ void gate_up_out(const GateUpOut& o, int b0, int nb, const float* outs) {
  const int c0 = o.c0, n = o.n, I = o.I;
  const int n4 = n / 4;   // tiles are multiples of 4 columns (schedule) and I of 8 (host-checked)
  for (int i = threadIdx.x; i < nb * n4; i += NTHREADS) {   // 4 columns per thread
      const int b = i / n4, c = i % n4 * 4;
    const float4 gt = *reinterpret_cast<const float4*>(outs + b * 2 * n + c);
    const float4 up = *reinterpret_cast<const float4*>(outs + b * 2 * n + n + c);
    const float4 v = make_float4(silu(gt.x) * up.x, silu(gt.y) * up.y, silu(gt.z) * up.z, silu(gt.w) * up.w);
    const size_t off = (size_t)(b0 + b) * I + c0 + c;
    *reinterpret_cast<float4*>(o.act + off) = v;
    if (o.mma) store_bf16x4(o.act_bf, off, v);
  }
  __syncthreads();
}

__device__ LINEAR_OP void op_gate_up(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), n = ins[isa::F_NROWS];
  if (batch > 0) prof_mark(a, 7);   // the op's entry
  Tile tile;
  linear_tile(a, ins, isa::OP_GATE_UP, tile);   // gate rows c0 + i, then up rows I + c0 + i
  const XSrc src = gate_up_src(a, ins);
  const GateUpOut dest = gate_up_dest(a, ins, batch);
  const int chunk = linear_chunk(batch, 2 * n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    const float* outs = linear(a, batch, a.hidden, b0, nb, 2 * n, src, tile.rows, smem);   // [nb, 2n]
    gate_up_out(dest, b0, nb, outs);
  }
}
