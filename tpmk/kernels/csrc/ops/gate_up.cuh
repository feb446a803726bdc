// gate_up: must match tpmk/kernels/ops/gate_up.py (GateUp). RMSNorm(x) @ gate rows
// [ROW0, ROW0+NROWS) and up rows I + same; act = silu(gate) * up. Split over K (ARG1 = S > 1
// slices of ARG2 = H / S columns; builds with MK_GU_SPLIT only): columns [ARG0 H / S,
// (ARG0 + 1) H / S) only, the partial sums -> gu_part[ARG0] (ops/act.cuh sums the slices).
#pragma once
#include "mk_linear.cuh"

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

// gate_up's K-slice partials [S, bucket, 2 I] f32: right after act (Megakernel.act_and_gu_part).
__device__ __forceinline__ float* gu_part(const KernelArgs& a) {
  return reinterpret_cast<float*>(a.act) + (size_t)a.bucket * a.inter;
}

__device__ LINEAR_OP void op_gate_up(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), l = ins[isa::F_LAYER], c0 = ins[isa::F_ROW0];
  const int n = ins[isa::F_NROWS], H = a.hidden, I = a.inter;
  if (batch > 0) prof_mark(a, 7);   // the op's entry
  Tile tile;
  linear_tile(a, ins, isa::OP_GATE_UP, tile);   // gate rows c0 + i, then up rows I + c0 + i
#ifdef MK_GU_SPLIT
  const int S = ins[isa::F_ARG1], K = tile.K;
  XSrc src = normed_x(a, reinterpret_cast<const wtype*>(a.post_norm) + (size_t)l * H);
  if (S > 1) src = src.slice(ins[isa::F_ARG0] * K);
  float* part = gu_part(a) + (size_t)ins[isa::F_ARG0] * a.bucket * 2 * I;
#else
  const int K = H;
  const XSrc src = normed_x(a, reinterpret_cast<const wtype*>(a.post_norm) + (size_t)l * H);
#endif
  float* act = reinterpret_cast<float*>(a.act);
  __nv_bfloat16* act_bf = reinterpret_cast<__nv_bfloat16*>(a.act_bf);   // for down's tensor cores
  const bool mma = mma_batch(batch);
  const int n4 = n / 4;   // tiles are multiples of 4 columns (schedule) and I of 8 (host-checked)
  const int chunk = linear_chunk(batch, 2 * n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    const float* outs = linear(a, batch, K, b0, nb, 2 * n, src, tile.rows, smem);   // [nb, 2n]
    for (int i = threadIdx.x; i < nb * n4; i += NTHREADS) {   // 4 columns per thread
      const int b = i / n4, c = i % n4 * 4;
      const float4 gt = *reinterpret_cast<const float4*>(outs + b * 2 * n + c);
      const float4 up = *reinterpret_cast<const float4*>(outs + b * 2 * n + n + c);
#ifdef MK_GU_SPLIT
      if (S > 1) {   // the slice's partials: gate at column c0 + c of the row, up at I + c0 + c
        float* p = part + (size_t)(b0 + b) * 2 * I + c0 + c;
        *reinterpret_cast<float4*>(p) = gt;
        *reinterpret_cast<float4*>(p + I) = up;
        continue;
      }
#endif
      const float4 v = make_float4(silu(gt.x) * up.x, silu(gt.y) * up.y, silu(gt.z) * up.z, silu(gt.w) * up.w);
      const size_t off = (size_t)(b0 + b) * I + c0 + c;
      *reinterpret_cast<float4*>(act + off) = v;
      if (mma) store_bf16x4(act_bf, off, v);
    }
    __syncthreads();
  }
}
