// lm_head: must match tpmk/kernels/ops/lm_head.py (LmHead). Final RMSNorm(x) @ local
// vocab rows [ROW0, ROW0+NROWS); padded ids -> NEG_INF; logits stored locally; the
// tile's TOPK best (value desc, global id asc; (-inf, -1) past the tile's rows) ->
// cand[rank, TILE, b] of every peer (layout: isa.cand_shape in isa.py).
#pragma once
#include "mk_linear.cuh"
#include "mk_topk.cuh"

// lm_head's input rows: x through the final RMSNorm.
__device__ __forceinline__ XSrc lm_head_src(const KernelArgs& a) {
  return normed_x(a, reinterpret_cast<const wtype*>(a.final_norm));
}

// Where an lm_head tile's logits go: vocab rows r0 .. r0 + n (global ids gid0..) of tile `tile`.
struct LmHeadOut {
  float* logits;
  int tile, r0, n, gid0;
};
__device__ __forceinline__ LmHeadOut lm_head_dest(const KernelArgs& a, const int* ins) {
  const int r0 = ins[isa::F_ROW0];
  return LmHeadOut{reinterpret_cast<float*>(a.logits), ins[isa::F_TILE], r0, ins[isa::F_NROWS],
                   a.rank * a.vocab_local + r0};
}

// One pass's logits [nb, n] -> stored for sequences b0.., and each sequence's TOPK best of the
// tile -> every peer's candidates.
__device__ __forceinline__ void lm_head_out(const KernelArgs& a, const LmHeadOut& o, int b0, int nb, float* outs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* logits = o.logits;
  const int gid0 = o.gid0, r0 = o.r0, n = o.n, tile = o.tile;
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

__device__ __noinline__ void op_lm_head(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), n = ins[isa::F_NROWS], H = a.hidden;
  Tile wt;
  linear_tile(a, ins, isa::OP_LM_HEAD, wt);
  const XSrc src = lm_head_src(a);
  const LmHeadOut dest = lm_head_dest(a, ins);
  const int chunk = linear_chunk(batch, n);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    float* outs = linear(a, batch, H, b0, nb, n, src, wt.rows, smem);   // [nb, n]
    lm_head_out(a, dest, b0, nb, outs);
  }
}
