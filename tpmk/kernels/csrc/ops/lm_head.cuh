// lm_head: must match tpmk/kernels/ops/lm_head.py (LmHead). Final RMSNorm(x) @ local
// vocab rows [ROW0, ROW0+NROWS); padded ids -> NEG_INF; logits stored locally; the
// tile's TOPK best (value desc, global id asc; (-inf, -1) past the tile's rows) ->
// cand[rank, TILE, b] of every peer (layout: isa.cand_shape in isa.py).
#pragma once
#include "mk_linear.cuh"
#include "mk_topk.cuh"

__device__ __noinline__ void op_lm_head(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), r0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS];
  const int tile = ins[isa::F_TILE], H = a.hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Tile wt;
  linear_tile(a, ins, isa::OP_LM_HEAD, wt);
  const XSrc src = normed_x(a, reinterpret_cast<const wtype*>(a.final_norm));
  float* logits = reinterpret_cast<float*>(a.logits);
  const int gid0 = a.rank * a.vocab_local + r0;
  const int chunk = linear_chunk(batch, n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    float* outs = linear(a, batch, H, b0, nb, n, src, wt.rows, smem);   // [nb, n]
    for (int i = threadIdx.x; i < nb * n; i += NTHREADS) {
      const int b = i / n, r = i % n;
      const float v = gid0 + r < a.vocab_size ? outs[i] : isa::NEG_INF;
      logits[(size_t)(b0 + b) * a.vocab_local + r0 + r] = v;
      outs[i] = v;   // the candidates carry the stored logits' exact bits
    }
    __syncthreads();
    for (int b = warp; b < nb; b += NWARPS) {   // one warp per row: lane-strided lists, then merged
      TopK t;
      topk_init(t);
      for (int r = lane; r < n; r += 32) topk_insert(t, outs[b * n + r], gid0 + r);
      float v;
      int id;
      warp_topk(t, v, id);
      if (lane < isa::TOPK) {
        const float2 c = id == TOPK_NO_ID ? make_float2(__int_as_float(0xff800000), -1.f)
                                          : make_float2(v, (float)id);
        const size_t off = (((size_t)a.rank * a.n_lm_tiles + tile) * a.bucket + b0 + b) * isa::TOPK + lane;
        for (int p = 0; p < a.tp; p++) reinterpret_cast<float2*>(a.peer_cand[p])[off] = c;
      }
    }
    __syncthreads();
  }
}
