// Top-TOPK selection in registers, shared by lm_head (a tile's candidates) and argmax
// (the row's global top-TOPK). Order: value descending, then id ascending. Ids are
// distinct, so the order is total and the result does not depend on how the candidates
// were split between lanes, warps or ranks (every rank computes the same bits).
// Must match best_k in tpmk/kernels/ops/lm_head.py.
#pragma once
#include "mk_common.cuh"

static_assert(isa::TOPK >= 1 && isa::TOPK <= 32 && isa::TOPK % 2 == 0,
              "TOPK: one lane per output, float4 candidate loads");
constexpr int TOPK_NO_ID = 0x7fffffff;   // empty slot, after every real (value, id)

// One thread's best TOPK so far, sorted; fully unrolled so it stays in registers.
struct TopK {
  float v[isa::TOPK];
  int id[isa::TOPK];
};

__device__ __forceinline__ bool topk_before(float v, int id, float w, int jd) {
  return v > w || (v == w && id < jd);   // NaN is never before anything: never selected
}

__device__ __forceinline__ void topk_init(TopK& t) {
#pragma unroll
  for (int j = 0; j < isa::TOPK; j++) { t.v[j] = __int_as_float(0xff800000); t.id[j] = TOPK_NO_ID; }
}

// Bubble (v, id) down the sorted list; the worst entry falls off the end.
__device__ __forceinline__ void topk_insert(TopK& t, float v, int id) {
  if (!topk_before(v, id, t.v[isa::TOPK - 1], t.id[isa::TOPK - 1])) return;
#pragma unroll
  for (int j = 0; j < isa::TOPK; j++) {
    if (topk_before(v, id, t.v[j], t.id[j])) {
      const float tv = t.v[j]; const int ti = t.id[j];
      t.v[j] = v; t.id[j] = id;
      v = tv; id = ti;
    }
  }
}

// Every lane of the warp: merge the 32 lanes' lists (TOPK rounds: butterfly-reduce the
// heads, the owner of the winner pops it). Lane j < TOPK gets the j-th best in (v, id).
__device__ __forceinline__ void warp_topk(TopK& t, float& v, int& id) {
  const int lane = threadIdx.x & 31;
  v = __int_as_float(0xff800000);
  id = TOPK_NO_ID;
#pragma unroll
  for (int j = 0; j < isa::TOPK; j++) {
    float bv = t.v[0];
    int bi = t.id[0];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (topk_before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (t.id[0] == bi) {   // this lane held the winner (or only empty slots: popping keeps them)
#pragma unroll
      for (int e = 0; e + 1 < isa::TOPK; e++) { t.v[e] = t.v[e + 1]; t.id[e] = t.id[e + 1]; }
      t.v[isa::TOPK - 1] = __int_as_float(0xff800000);
      t.id[isa::TOPK - 1] = TOPK_NO_ID;
    }
    if (lane == j) { v = bv; id = bi; }
  }
}
