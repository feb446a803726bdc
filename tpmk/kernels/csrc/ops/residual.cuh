// residual: must match tpmk/kernels/ops/residual.py (Residual).
// x[b, cols] (+)= slot[0] + slot[1] + ... + slot[tp-1], fixed rank order (bit-identical ranks).
// All-gather form (OWNER bit; runs on the owner only): the result also goes to every peer's x.
// At batch >= MMA_MIN_BATCH it also prepares the next RMSNorm's tensor-core input: x times
// that norm's weight in bf16 (xn) and the tile's sum of x^2 per row (xn_ssq).
#pragma once
#include "mk_common.cuh"

// The RMSNorm weight applied to the output of residual stage s (0: embedding, 2l + 1:
// attention of layer l, 2l + 2: its MLP): post_norm[l] before gate_up, else the next
// layer's input_norm before qkv, or final_norm before the LM head.
__device__ __forceinline__ const wtype* next_norm(const KernelArgs& a, int s) {
  const size_t H = a.hidden;
  if (s % 2) return reinterpret_cast<const wtype*>(a.post_norm) + (size_t)(s / 2) * H;
  if (s / 2 < a.num_layers) return reinterpret_cast<const wtype*>(a.input_norm) + (size_t)(s / 2) * H;
  return reinterpret_cast<const wtype*>(a.final_norm);
}

__device__ __noinline__ void op_residual(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), c0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS], tile = ins[isa::F_TILE];
  const int stage = ins[isa::F_ARG0], set = ins[isa::F_ARG1];
  const bool ag = ins[isa::F_SIGNAL_PEERS] & isa::SIG_OWNER;   // peer_x[rank] is this rank's x
  const int p0 = ag ? 0 : a.rank, p1 = ag ? a.tp : a.rank + 1;  // whose x (and xn) get the result
  const bool mma = mma_batch(batch);
  const float* slots = reinterpret_cast<const float*>(
      (stage & 1) ? a.peer_attn_slots[a.rank] : a.peer_mlp_slots[a.rank]);
  const float* x = reinterpret_cast<const float*>(a.x);
  const wtype* nw = next_norm(a, stage);
  const size_t plane = (size_t)a.bucket * a.hidden;
  const int n4 = n / 4, lane = threadIdx.x & 31;   // tiles and hidden are multiples of 8 (host-checked)
  // x's new value at element off (4 columns) from its tp partials v (and x's old value xo):
  // summed in rank order, then x added; stored into the x of ranks p0..p1-1.
  auto finish = [&](size_t off, const float4* v, int vstride, float4 xo) {
    float4 acc = v[0];
#pragma unroll
    for (int r = 1; r < isa::MAX_TP; r++)
      if (r < a.tp) {
        const float4 t = v[r * vstride];
        acc.x += t.x; acc.y += t.y; acc.z += t.z; acc.w += t.w;
      }
    if (!set) { acc.x = xo.x + acc.x; acc.y = xo.y + acc.y; acc.z = xo.z + acc.z; acc.w = xo.w + acc.w; }
    for (int p = p0; p < p1; p++) *reinterpret_cast<float4*>(reinterpret_cast<float*>(a.peer_x[p]) + off) = acc;
    return acc;
  };
  if (!mma) {   // a thread per float4, every rank's partial (+ x) in one round trip
    for (int idx = threadIdx.x; idx < batch * n4; idx += NTHREADS) {
      const size_t off = (size_t)(idx / n4) * a.hidden + c0 + 4 * (idx % n4);
      float4 v[isa::MAX_TP];   // every slot written: no value of v carried across iterations
#pragma unroll
      for (int r = 0; r < isa::MAX_TP; r++)
        v[r] = r < a.tp ? __ldcg(reinterpret_cast<const float4*>(slots + r * plane + off)) : make_float4(0.f, 0.f, 0.f, 0.f);
      finish(off, v, 1, set ? make_float4(0.f, 0.f, 0.f, 0.f) : __ldcg(reinterpret_cast<const float4*>(x + off)));
    }
    return;
  }
  if constexpr (sizeof(wtype) == 2) {   // mma_batch is false for f32 models
    // Passes of rp rows: the tile's columns of every plane (tp partials, then x unless set)
    // cp.async'd into shared memory, two passes in flight (registers held one row per 16
    // lanes: 4 serial round trips per tile at batch 128). Row stage: planes x n floats.
    int sw = 1;   // lanes per row (a power of two), 32 / sw rows per warp: the row's sum of squares
    while (sw < n4 && sw < 32) sw <<= 1;
    const int sub = lane / sw, cl = lane % sw, ri = NWARPS * (32 / sw);   // rows per block sweep
    const int planes = a.tp + !set, rw = planes * n;
    int rp = min(batch, isa::MMA_SMEM_WORDS / 2 / rw);   // host: megakernel.residual_words
    rp = max(1, rp >= ri ? rp / ri * ri : rp);   // whole sweeps where they fit
    auto stage = [&](int pass) {   // committed as one group, empty past the batch
      const int b0 = pass * rp, rows = max(0, min(rp, batch - b0));
      float* buf = smem + (pass & 1) * rp * rw;
      for (int i = threadIdx.x; i < rows * planes * n4; i += NTHREADS) {
        const int row = i / (planes * n4), r = i / n4 % planes, c = 4 * (i % n4);
        const size_t off = (size_t)(b0 + row) * a.hidden + c0 + c;
        cp_async16(buf + (row * planes + r) * n + c, r < a.tp ? slots + r * plane + off : x + off);
      }
      cp_async_commit();
    };
    stage(0);
    for (int pass = 0; pass * rp < batch; pass++) {
      stage(pass + 1);
      cp_async_wait<1>();   // this thread's copies of this pass
      __syncthreads();
      const int pb = pass * rp, pe = min(batch, pb + rp);
      const float* buf = smem + (pass & 1) * rp * rw;
      for (int bw = pb + (threadIdx.x >> 5) * (32 / sw); bw < pe; bw += ri) {
        const int b = bw + sub;
        float sq = 0.f;
        for (int c = cl; c < n4 && b < pe; c += sw) {
          const size_t off = (size_t)b * a.hidden + c0 + 4 * c;
          const float4* v = reinterpret_cast<const float4*>(buf + (b - pb) * rw + 4 * c);
          const float4 acc = finish(off, v, n4, set ? make_float4(0.f, 0.f, 0.f, 0.f) : v[a.tp * n4]);
          sq += acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
          const uint2 u = __ldg(reinterpret_cast<const uint2*>(nw + c0 + 4 * c));
          const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
          const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
          const float4 xw = make_float4(acc.x * w01.x, acc.y * w01.y, acc.z * w23.x, acc.w * w23.y);
          for (int p = p0; p < p1; p++) store_bf16x4(reinterpret_cast<__nv_bfloat16*>(a.peer_xn[p]), off, xw);
        }
        for (int o = sw / 2; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);   // fixed order
        if (cl == 0 && b < pe)
          for (int p = p0; p < p1; p++) reinterpret_cast<float*>(a.peer_xn_ssq[p])[(size_t)b * a.n_h_tiles + tile] = sq;
      }
      __syncthreads();   // this pass's buffer is read; stage(pass + 2) refills it
    }
    cp_async_wait_all();   // the last (empty) group
  }
}
