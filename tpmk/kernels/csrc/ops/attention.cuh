// attention: must match tpmk/kernels/ops/attention.py (Attention). One (sequence ARG0,
// kv head ROW0, split ARG1): online softmax over the split's tokens in chunks, for the
// G = Hq / Hkv query heads of the group; writes attn_part[b, h, split] = (acc[D], m, l).
#pragma once
#include "mk_common.cuh"

constexpr int ATTN_CHUNK = 64;   // tokens scored per pass
constexpr int MAX_HEAD_DIM = 256;
constexpr int ATTN_MAX_GROUP = 16;  // query heads per kv head on the fast path

__device__ __forceinline__ float ld_kv(const wtype* p) {
#ifndef MK_FLOAT32
  return __bfloat162float(__ldcg(p));
#else
  return __ldcg(p);
#endif
}

__device__ void op_attention(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = hdr[isa::H_BATCH], b = ins[isa::F_ARG0];
  if (b >= batch) return;
  const int l = ins[isa::F_LAYER], g = ins[isa::F_ROW0], split = ins[isa::F_ARG1];
  const int D = a.head_dim, G = a.q_heads / a.kv_heads, ps = a.page_size, S = a.num_splits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int* pos = hdr + isa::HDR_TOKENS + a.bucket;
  const int* pages = pos + a.bucket + b * a.max_pages;
  const int ctx = pos[b] + 1, per = (ctx + S - 1) / S;
  const int t0 = min(ctx, split * per), t1 = min(ctx, t0 + per);
  float* qs = smem + NWARPS * BATCH_CHUNK;   // [G, D] scaled queries
  float* acc = qs + G * D;                   // [G, D]
  float* sc = acc + G * D;                   // [G, ATTN_CHUNK] scores, then probabilities
  float* st = sc + G * ATTN_CHUNK;           // m[G], l[G], alpha[G]
  const float* q = reinterpret_cast<const float*>(a.q) + ((size_t)b * a.q_heads + g * G) * D;
  for (int i = threadIdx.x; i < G * D; i += NTHREADS) {
    qs[i] = ld_act(q + i) * a.attn_scale;
    acc[i] = 0.f;
  }
  for (int h = threadIdx.x; h < G; h += NTHREADS) { st[h] = isa::NEG_INF; st[G + h] = 0.f; }
  __syncthreads();
  auto row = [&](unsigned long long cache, int t) {
    const int page = pages[t / ps];
    return reinterpret_cast<const wtype*>(cache) +
           ((((size_t)l * a.num_pages + page) * a.kv_heads + g) * ps + t % ps) * D;
  };
  // Fast path: row offsets of the chunk's tokens in smem (no page-table load on the hot path);
  // V: thread (d, token group) keeps G accumulators, reduced over groups in fixed order.
  // Other shapes (NTHREADS % D != 0 or G > ATTN_MAX_GROUP) take the plain loops.
  long long* off = reinterpret_cast<long long*>(st + ((3 * G + 1) & ~1));
  float* vpart = reinterpret_cast<float*>(off + ATTN_CHUNK);          // [NTHREADS / D, G, D]
  const bool fast = (NTHREADS % D == 0) && G <= ATTN_MAX_GROUP;
  for (int c0 = t0; c0 < t1; c0 += ATTN_CHUNK) {
    const int cn = min(ATTN_CHUNK, t1 - c0);
    if (fast) {
      for (int t = threadIdx.x; t < cn; t += NTHREADS) {
        const int tok = c0 + t;
        off[t] = ((((long long)l * a.num_pages + pages[tok / ps]) * a.kv_heads + g) * ps + tok % ps) * D;
      }
      __syncthreads();
    }
    for (int t = warp; t < cn; t += NWARPS) {
      const wtype* k = fast ? reinterpret_cast<const wtype*>(a.k_cache) + off[t] : row(a.k_cache, c0 + t);
      float kr[MAX_HEAD_DIM / 32];
#pragma unroll
      for (int j = 0; j < MAX_HEAD_DIM / 32; j++) kr[j] = (lane + 32 * j < D) ? ld_kv(k + lane + 32 * j) : 0.f;
      for (int h = 0; h < G; h++) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < MAX_HEAD_DIM / 32; j++)
          if (lane + 32 * j < D) s += qs[h * D + lane + 32 * j] * kr[j];
        s = warp_sum(s);
        if (lane == 0) sc[h * ATTN_CHUNK + t] = s;
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
    if (fast) {
      const int nt = NTHREADS / D, d = threadIdx.x % D, tg = threadIdx.x / D;
      const wtype* vb = reinterpret_cast<const wtype*>(a.v_cache) + d;
      float av[ATTN_MAX_GROUP];
#pragma unroll
      for (int h = 0; h < ATTN_MAX_GROUP; h++) av[h] = 0.f;
#pragma unroll 4
      for (int t = tg; t < cn; t += nt) {
        const float v = ld_kv(vb + off[t]);
#pragma unroll
        for (int h = 0; h < ATTN_MAX_GROUP; h++)
          if (h < G) av[h] += sc[h * ATTN_CHUNK + t] * v;
      }
#pragma unroll
      for (int h = 0; h < ATTN_MAX_GROUP; h++)
        if (h < G) vpart[(tg * G + h) * D + d] = av[h];
      __syncthreads();
      for (int i = threadIdx.x; i < G * D; i += NTHREADS) {
        const int h = i / D, dd = i % D;
        float s = acc[i] * st[2 * G + h];
        for (int q2 = 0; q2 < nt; q2++) s += vpart[(q2 * G + h) * D + dd];
        acc[i] = s;
      }
      __syncthreads();
      continue;
    }
    for (int i = threadIdx.x; i < G * D; i += NTHREADS) {
      const int h = i / D, d = i % D;
      float s = acc[i] * st[2 * G + h];
      for (int t = 0; t < cn; t++) s += sc[h * ATTN_CHUNK + t] * ld_kv(row(a.v_cache, c0 + t) + d);
      acc[i] = s;
    }
    __syncthreads();
  }
  float* part = reinterpret_cast<float*>(a.attn_part);
  for (int i = threadIdx.x; i < G * (D + 2); i += NTHREADS) {
    const int h = i / (D + 2), d = i % (D + 2);
    const float v = d < D ? acc[h * D + d] : st[(d - D) * G + h];
    part[(((size_t)b * a.q_heads + g * G + h) * S + split) * (D + 2) + d] = v;
  }
}
