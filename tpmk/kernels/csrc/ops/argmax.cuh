// argmax: must match tpmk/kernels/ops/argmax.py (Argmax). Rows [ROW0, ROW0 + NROWS) below the
// step's batch: row b's global top-TOPK from every rank's tile candidates (cand:
// isa.cand_shape, each tile's list sorted) -> topk_values/topk_ids[b], value desc then id asc
// (mk_topk.cuh: a total order, so the split of the work below does not change the result);
// tokens_out[b] = its first id, the lowest id of the maximum, as torch.argmax.
// Work split: W warps per row (a power of two, all 16 for one row, one for >= 16 rows);
// each thread keeps the best TOPK of its tiles, each warp merges its lanes' lists, then
// the row's first warp merges the W warp lists through shared memory.
#pragma once
#include "mk_topk.cuh"

__device__ __noinline__ void op_argmax(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int r0 = ins[isa::F_ROW0], r1 = min(r0 + ins[isa::F_NROWS], step_batch());
  const int nc = a.tp * a.n_lm_tiles, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int wpr = NWARPS;
  while (wpr > 1 && wpr * (r1 - r0) > NWARPS) wpr >>= 1;
  const int rows_per_pass = NWARPS / wpr, tw = warp % wpr;
  const float* cand = reinterpret_cast<const float*>(a.peer_cand[a.rank]);
  float* lists = smem;   // [NWARPS][TOPK] x (value, id bits): host sizes smem >= 2 * NWARPS * TOPK
  float* values = reinterpret_cast<float*>(a.topk_values);
  int* ids = reinterpret_cast<int*>(a.topk_ids);
  int* out = reinterpret_cast<int*>(a.tokens_out);
  for (int b0 = r0; b0 < r1; b0 += rows_per_pass) {
    const int b = b0 + warp / wpr;
    TopK t;
    topk_init(t);
    if (b < r1) {
      for (int c = tw * 32 + lane; c < nc; c += wpr * 32) {
        const float4* p = reinterpret_cast<const float4*>(cand + ((size_t)c * a.bucket + b) * isa::TOPK * 2);
        float4 q[isa::TOPK / 2];
#pragma unroll
        for (int j = 0; j < isa::TOPK / 2; j++) q[j] = __ldcg(p + j);
#pragma unroll
        for (int j = 0; j < isa::TOPK / 2; j++) {   // (-inf, -1) past a tile's rows: skipped
          if (q[j].y >= 0.f) topk_insert(t, q[j].x, (int)q[j].y);
          if (q[j].w >= 0.f) topk_insert(t, q[j].z, (int)q[j].w);
        }
      }
    }
    float v;
    int id;
    warp_topk(t, v, id);
    if (wpr > 1) {
      if (lane < isa::TOPK) {
        lists[2 * (warp * isa::TOPK + lane)] = v;
        lists[2 * (warp * isa::TOPK + lane) + 1] = __int_as_float(id);
      }
      __syncthreads();
      if (tw == 0) {   // the row's first warp: lane l < wpr takes warp (warp + l)'s sorted list
        topk_init(t);
        if (lane < wpr) {
#pragma unroll
          for (int j = 0; j < isa::TOPK; j++) {
            t.v[j] = lists[2 * ((warp + lane) * isa::TOPK + j)];
            t.id[j] = __float_as_int(lists[2 * ((warp + lane) * isa::TOPK + j) + 1]);
          }
        }
        warp_topk(t, v, id);
      }
      __syncthreads();   // lists are rewritten by the next pass
    }
    if (tw == 0 && b < r1 && lane < isa::TOPK) {
      values[b * isa::TOPK + lane] = v;
      ids[b * isa::TOPK + lane] = id;
      if (lane == 0) out[b] = id;
    }
  }
}
