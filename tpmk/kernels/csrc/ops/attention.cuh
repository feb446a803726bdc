// attention: must match tpmk/kernels/ops/attention.py (Attention). One (sequence ARG0,
// kv head ROW0, split ARG1): online softmax over the split's tokens in chunks, for the
// G = Hq / Hkv query heads of the group; writes attn_part[b, h, split] = (acc[D], m, l).
// Then it takes a ticket (counter ARG2, one increment per split and step): the split that
// draws a multiple of S finished last and merges the group's S partials into
// attn_out[b, heads of g] (merge_group), once per group rather than in every o_proj tile.
//
// Decode attention is latency-bound, so each chunk costs one round trip to memory:
// thread (token slot tq, dim octet li) computes its tokens' cache offsets from the page
// table, then issues the 16-byte K AND V loads of all its tokens at once. Scores: dot
// over the octet, summed across the D/8 lanes of the token. V: per-thread partials for a
// group of up to ATTN_HG heads, summed over the tokens of a warp by shuffles and over
// warps in fixed order through shared memory (deterministic).
// Head dims: D = 8 * 2^j <= 256 (checked on the host), so D/8 lanes tile a warp.
#pragma once
#include "mk_common.cuh"
#include "mk_sync.cuh"

constexpr int ATTN_CHUNK = isa::ATTN_CHUNK;   // max tokens per pass (the scores' row stride)
constexpr int ATTN_HG = isa::ATTN_HG;         // query heads per V accumulation group (registers: 8 each)
constexpr int ATTN_NLD = 4;       // tokens per thread per pass: a pass is min(ATTN_CHUNK, 4 TPB) tokens

// 8 consecutive cache elements (16 bytes in bf16, 32 in f32), loaded through L2.
struct Oct { uint4 u[sizeof(wtype) / 2]; };
__device__ __forceinline__ Oct ld_oct(const wtype* p) {
  Oct o;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(wtype) / 2); i++) o.u[i] = __ldcg(reinterpret_cast<const uint4*>(p) + i);
  return o;
}
__device__ __forceinline__ void unpack_oct(const Oct& o, float* f) {
#pragma unroll
  for (int i = 0; i < (int)(sizeof(wtype) / 2); i++) unpack(o.u[i], f + i * VEC);
}

// attn_out[b, (g G + h) D + d] = sum_s coef[h, s] acc_s[d] with coef[h, s] = e^(m_s - M) / sum_s'
// e^(m_s' - M) l_s' (M: the max of m over the splits); part: the group's [G, S, D + 2].
// Each output float4 is summed over the splits by P = NTHREADS / (G D / 4) threads (each
// split's loads issued together: one round trip at batch 1), then in fixed order.
constexpr int MERGE_UNROLL = 16;
// bf (or null): also out in bf16, for o_proj's tensor cores.
__device__ void merge_group(const KernelArgs& a, const float* part, float* out, __nv_bfloat16* bf, float* smem) {
  auto put = [&](int o, float4 r) {
    reinterpret_cast<float4*>(out)[o] = r;
    if (bf) store_bf16x4(bf, 4 * o, r);
  };
  const int D = a.head_dim, G = a.q_heads / a.kv_heads, S = a.num_splits, lane = threadIdx.x & 31;
  const int n4 = G * D / 4, P = max(1, NTHREADS / n4);
  float* coef = smem;                  // [G, S]
  float4* red = reinterpret_cast<float4*>(smem + ((G * S + 3) & ~3));   // [P, n4] when P > 1
  for (int h = threadIdx.x >> 5; h < G; h += NWARPS) {   // one warp per head, a lane per split
    const float* p = part + ((size_t)h * S + lane) * (D + 2) + D;
    const bool ok = lane < S;
    const float m = ok ? ld_act(p) : isa::NEG_INF, l = ok ? ld_act(p + 1) : 0.f;
    const float M = warp_max(m), e = ok ? expf(m - M) : 0.f, inv = 1.f / warp_sum(e * l);
    if (ok) coef[h * S + lane] = e * inv;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n4 * P; i += NTHREADS) {
    const int o = i % n4, q = i / n4, h = o / (D / 4), d = o % (D / 4) * 4;
    const float* p = part + (size_t)h * S * (D + 2) + d;
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll MERGE_UNROLL
    for (int s = q; s < S; s += P) {
      const float2 u = __ldcg(reinterpret_cast<const float2*>(p + s * (D + 2)));
      const float2 v = __ldcg(reinterpret_cast<const float2*>(p + s * (D + 2) + 2));
      const float w = coef[h * S + s];
      r.x += w * u.x; r.y += w * u.y; r.z += w * v.x; r.w += w * v.y;
    }
    if (P == 1) put(o, r);
    else red[q * n4 + o] = r;
  }
  if (P == 1) return;
  __syncthreads();
  for (int o = threadIdx.x; o < n4; o += NTHREADS) {
    float4 r = red[o];
    for (int q = 1; q < P; q++) {
      const float4 t = red[q * n4 + o];
      r.x += t.x; r.y += t.y; r.z += t.z; r.w += t.w;
    }
    put(o, r);
  }
}

__device__ __noinline__ void op_attention(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], b = ins[isa::F_ARG0];
  if (b >= batch) return;
  const int l = ins[isa::F_LAYER], g = ins[isa::F_ROW0], split = ins[isa::F_ARG1];
  const int D = a.head_dim, G = a.q_heads / a.kv_heads, ps = a.page_size, S = a.num_splits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int LT = D / 8, TPB = NTHREADS / LT;           // lanes per token row, tokens per block load
  const int li = threadIdx.x % LT, tq = threadIdx.x / LT, CH = min(ATTN_CHUNK, ATTN_NLD * TPB);
  const int* pos = hdr + isa::HDR_TOKENS + a.bucket;
  const int* pages = pos + a.bucket + b * a.max_pages;
  const int ctx = pos[b] + 1, per = (ctx + S - 1) / S;
  const int t0 = min(ctx, split * per), t1 = min(ctx, t0 + per);
  float* qs = smem + NWARPS * BATCH_CHUNK;   // [G, D] scaled queries
  float* acc = qs + G * D;                   // [G, D]
  float* sc = acc + G * D;                   // [G, ATTN_CHUNK] scores, then probabilities
  float* st = sc + G * ATTN_CHUNK;           // m[G], l[G], alpha[G]
  float* vpart = st + ((3 * G + 3) & ~3);    // [NWARPS, ATTN_HG, D] per-warp V partials
  const size_t head_stride = (size_t)ps * D, page_stride = (size_t)a.kv_heads * head_stride;
  const wtype* kbase = reinterpret_cast<const wtype*>(a.k_cache) +
                       (size_t)l * a.num_pages * page_stride + g * head_stride + 8 * li;
  const wtype* vbase = reinterpret_cast<const wtype*>(a.v_cache) +
                       (size_t)l * a.num_pages * page_stride + g * head_stride + 8 * li;
  Oct kv[ATTN_NLD], vv[ATTN_NLD];
  auto issue = [&](int c0, int cn) {   // this thread's K and V octets of chunk [c0, c0 + cn)
#pragma unroll
    for (int j = 0; j < ATTN_NLD; j++) {
      const int t = tq + j * TPB;
      if (t < cn) {
        const int tok = c0 + t;
        const size_t off = (size_t)__ldg(pages + tok / ps) * page_stride + (size_t)(tok % ps) * D;
        kv[j] = ld_oct(kbase + off);
        vv[j] = ld_oct(vbase + off);
      }
    }
  };
  if (t0 < t1) issue(t0, min(CH, t1 - t0));
  const float* q = reinterpret_cast<const float*>(a.q) + ((size_t)b * a.q_heads + g * G) * D;
  for (int i = threadIdx.x; i < G * D; i += NTHREADS) {
    qs[i] = ld_act(q + i) * a.attn_scale;
    acc[i] = 0.f;
  }
  for (int h = threadIdx.x; h < G; h += NTHREADS) { st[h] = isa::NEG_INF; st[G + h] = 0.f; }
  __syncthreads();
  for (int c0 = t0; c0 < t1; c0 += CH) {
    const int cn = min(CH, t1 - c0);
    if (c0 != t0) issue(c0, cn);
    // Scores: sum over the token's LT lanes (xor offsets < LT stay inside the token's lanes).
    for (int h = 0; h < G; h++) {
      const float4 q0 = *reinterpret_cast<const float4*>(qs + h * D + 8 * li);
      const float4 q1 = *reinterpret_cast<const float4*>(qs + h * D + 8 * li + 4);
#pragma unroll
      for (int j = 0; j < ATTN_NLD; j++) {
        if (j * TPB >= cn) break;   // block-uniform
        float f[8];
        unpack_oct(kv[j], f);
        float s = q0.x * f[0] + q0.y * f[1] + q0.z * f[2] + q0.w * f[3] +
                  q1.x * f[4] + q1.y * f[5] + q1.z * f[6] + q1.w * f[7];
        for (int o = 1; o < LT; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const int t = tq + j * TPB;
        if (li == 0 && t < cn) sc[h * ATTN_CHUNK + t] = s;
      }
    }
    __syncthreads();
    for (int h = warp; h < G; h += NWARPS) {
      float mx = isa::NEG_INF;
      for (int t = lane; t < cn; t += 32) mx = fmaxf(mx, sc[h * ATTN_CHUNK + t]);
      mx = warp_max(mx);
      const float mold = st[h], mnew = fmaxf(mold, mx);
      float sum = 0.f;
      for (int t = lane; t < cn; t += 32) {
        const float p = expf(sc[h * ATTN_CHUNK + t] - mnew);
        sc[h * ATTN_CHUNK + t] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const float alpha = expf(mold - mnew);
        st[G + h] = st[G + h] * alpha + sum;
        st[h] = mnew;
        st[2 * G + h] = alpha;
      }
    }
    __syncthreads();
    for (int h0 = 0; h0 < G; h0 += ATTN_HG) {
      const int hn = min(ATTN_HG, G - h0);
      float av[ATTN_HG][8];
#pragma unroll
      for (int h = 0; h < ATTN_HG; h++)
#pragma unroll
        for (int e = 0; e < 8; e++) av[h][e] = 0.f;
#pragma unroll
      for (int j = 0; j < ATTN_NLD; j++) {
        const int t = tq + j * TPB;
        if (j * TPB >= cn) break;
        if (t >= cn) continue;
        float f[8];
        unpack_oct(vv[j], f);
#pragma unroll
        for (int h = 0; h < ATTN_HG; h++) {
          if (h >= hn) break;
          const float p = sc[(h0 + h) * ATTN_CHUNK + t];
#pragma unroll
          for (int e = 0; e < 8; e++) av[h][e] += p * f[e];
        }
      }
      // Tokens of one warp: lanes li, li + LT, ... hold the same dims.
      for (int o = LT; o < 32; o <<= 1)
#pragma unroll
        for (int h = 0; h < ATTN_HG; h++)
#pragma unroll
          for (int e = 0; e < 8; e++) av[h][e] += __shfl_xor_sync(0xffffffffu, av[h][e], o);
      if (lane < LT)
#pragma unroll
        for (int h = 0; h < ATTN_HG; h++) {
          if (h >= hn) break;
          float4* vp = reinterpret_cast<float4*>(vpart + (warp * ATTN_HG + h) * D + 8 * li);
          vp[0] = make_float4(av[h][0], av[h][1], av[h][2], av[h][3]);
          vp[1] = make_float4(av[h][4], av[h][5], av[h][6], av[h][7]);
        }
      __syncthreads();
      for (int i = threadIdx.x; i < hn * D; i += NTHREADS) {
        const int h = i / D, d = i % D;
        float s = acc[(h0 + h) * D + d] * st[2 * G + h0 + h];
        for (int w = 0; w < NWARPS; w++) s += vpart[(w * ATTN_HG + h) * D + d];
        acc[(h0 + h) * D + d] = s;
      }
      __syncthreads();
    }
  }
  float* part = reinterpret_cast<float*>(a.attn_part) + ((size_t)b * a.q_heads + g * G) * S * (D + 2);
  for (int i = threadIdx.x; i < G * (D + 2); i += NTHREADS) {
    const int h = i / (D + 2), d = i % (D + 2);
    part[((size_t)h * S + split) * (D + 2) + d] = d < D ? acc[h * D + d] : st[(d - D) * G + h];
  }
  __syncthreads();   // the partial's stores precede thread 0's ticket (release)
  __shared__ int last;
  if (threadIdx.x == 0) {
    unsigned t = 1;
    const int cid = ins[isa::F_ARG2];
    if (cid != isa::NO_COUNTER) {   // S > 1
      fence_acq_rel_sys();
      t = atomicAdd(reinterpret_cast<unsigned*>(a.counters) + (size_t)cid * isa::COUNTER_STRIDE, 1u) + 1;
      fence_acq_rel_sys();          // acquire: the other splits' partials
    }
    last = t % (unsigned)S == 0;
  }
  __syncthreads();
  if (last) {
    const size_t off = ((size_t)b * a.q_heads + g * G) * D;
    merge_group(a, part, reinterpret_cast<float*>(a.attn_out) + off,
                mma_batch(batch) ? reinterpret_cast<__nv_bfloat16*>(a.attn_bf) + off : nullptr, smem);
  }
}
