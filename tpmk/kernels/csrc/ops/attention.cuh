// attention: must match tpmk/kernels/ops/attention.py (Attention). One (sequence ARG0,
// kv head ROW0, split ARG1): online softmax over the split's tokens in chunks of CH =
// a.attn_chunk tokens, for the G = Hq / Hkv query heads of the group; writes
// attn_part[b, h, split] = (acc[D], m, l). Then it takes a ticket (counter ARG2, one increment
// per split and step): the split that draws a multiple of S finished last and merges the
// group's S partials into attn_out[b, heads of g] (merge_group), once per group rather than
// in every o_proj tile.
//
// A chunk's K and V rows go to shared memory by cp.async (16 bytes each, through L2, no
// registers: a load held in a spilled register made every token wait for its own round
// trip), double-buffered: chunk c + 1 is in flight while chunk c is computed. Rows are padded
// by 16 bytes, so 16-byte reads of 8 consecutive rows hit distinct banks.
// Tensor-core steps (attn_tc: bf16, batch >= MMA_MIN_BATCH, G <= 16, D >= 16) run both
// products as mma.sync m16n8k16 with the G heads as the 16 rows (rows >= G zero): scores =
// q (bf16) . K^T, warp j taking tokens 8j..8j+7; P.V = P (bf16 rows in shared memory) . V
// (ldmatrix.trans), warp w taking dims 8j..8j+7 for j = w, w + NWARPS, ..., its C fragments held
// across chunks. At batch 128, ctx 4096 on an H200 this took attention from 371 to 122 us
// per layer (the CUDA-core scores alone were 205 us).
// Otherwise, on CUDA cores: scores: thread (token t, head phase hp) computes q_h . K_t over
// the whole row for heads h = hp, hp + P, ... (P = NTHREADS / CH): no shuffles.
// P.V: thread (token phase qt, head h, dim octet) accumulates its octet over tokens qt,
// qt + Q, ... in registers across chunks (rescaled by each chunk's alpha); the Q partials are
// summed once at the end, in fixed order (deterministic).
// Head dims: D = 8 * 2^j <= 256, G * D / 8 <= NTHREADS (host-checked).
#pragma once
#include "mk_common.cuh"
#include "mk_sync.cuh"
#include "mk_mma.cuh"

constexpr int ATTN_CHUNK = isa::ATTN_CHUNK;   // most tokens per chunk (the scores' row stride)
constexpr int ATTN_PAGES = isa::ATTN_PAGES;   // page numbers one chunk can touch, padded
constexpr int PV_S = (256 / 8 + NWARPS - 1) / NWARPS;   // tensor-core P.V: dim octets per warp (D <= 256)

// 8 consecutive cache elements (16 bytes in bf16, 32 in f32) from shared memory -> f.
__device__ __forceinline__ void lds_oct(const char* p, float* f) {
#pragma unroll
  for (int i = 0; i < (int)(sizeof(wtype) / 2); i++) unpack(reinterpret_cast<const uint4*>(p)[i], f + i * VEC);
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
  constexpr int SL = isa::MAX_SPLITS / 32;   // splits per lane: lane + 32 j
  for (int h = threadIdx.x >> 5; h < G; h += NWARPS) {   // one warp per head
    const float* p = part + (size_t)h * S * (D + 2) + D;
    float m[SL], l[SL], mx = isa::NEG_INF, sl = 0.f;
#pragma unroll
    for (int j = 0; j < SL; j++) {
      const int s = lane + 32 * j;
      m[j] = s < S ? ld_act(p + s * (D + 2)) : isa::NEG_INF;
      l[j] = s < S ? ld_act(p + s * (D + 2) + 1) : 0.f;
      mx = fmaxf(mx, m[j]);
    }
    const float M = warp_max(mx);
#pragma unroll
    for (int j = 0; j < SL; j++) {
      m[j] = lane + 32 * j < S ? expf(m[j] - M) : 0.f;   // e_s
      sl += m[j] * l[j];
    }
    const float inv = 1.f / warp_sum(sl);
#pragma unroll
    for (int j = 0; j < SL; j++)
      if (lane + 32 * j < S) coef[h * S + lane + 32 * j] = m[j] * inv;
  }
  __syncthreads();
  prof_mark(a, 15);   // the merge's coefficients (the splits' m, l loaded)
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

// Whether scores and P.V run on the tensor cores (q and the probabilities in bf16): bf16 steps
// of >= MMA_MIN_BATCH rows, G <= 16 (one m16 tile of heads), D >= 16 (whole k16 steps). Must
// match tpmk/kernels/ops/attention.py (Attention.tensor_cores).
__device__ __forceinline__ bool attn_tc(int batch, int G, int D) {
#ifdef MK_HAS_MMA
  return mma_batch(batch) && G <= 16 && D >= 16;
#else
  return false;
#endif
}

__device__ __noinline__ void op_attention(const KernelArgs& a, const int* ins, const int* hdr, float* smem) {
  const int batch = step_batch(), b = ins[isa::F_ARG0];
  if (b >= batch) return;
  const int l = ins[isa::F_LAYER], g = ins[isa::F_ROW0], split = ins[isa::F_ARG1];
  const int D = a.head_dim, G = a.q_heads / a.kv_heads, ps = a.page_size, S = a.num_splits;
  const int CH = a.attn_chunk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool tc = attn_tc(batch, G, D);   // scores and P.V on the tensor cores
  const int* pos = hdr + isa::HDR_TOKENS + a.bucket;
  const int* pages = pos + a.bucket + b * a.max_pages;
  const int ctx = pos[b] + 1, per = (ctx + S - 1) / S;
  const int t0 = min(ctx, split * per), t1 = min(ctx, t0 + per);
  const int nchunks = (t1 - t0 + CH - 1) / CH;
  // Shared memory (f32 words after the reduction scratch; megakernel.py smem_bytes sizes it):
  // queries, scores, bf16 probabilities, softmax state, two chunks' page numbers, then the
  // K/V chunk buffers [2 stages][K, V][CH rows of RB bytes]; after the last chunk the token
  // phases' partial sums [Q][G * D] (tensor cores: [1][G * D]) reuse the buffers.
  // Queries: on tensor cores bf16 rows [16][D + 8] (rows >= G zero), else q * scale in f32
  // [G, D]. Probabilities: on tensor cores bf16 rows [16][ATTN_CHUNK + 8] (P.V's A operand),
  // else f32 in the scores' place.
  const int RB = D * (int)sizeof(wtype) + 16;
  float* qs = smem + NWARPS * BATCH_CHUNK;   // [max(G D, 8 (D + 8))] words
  float* sc = qs + max(G * D, 8 * (D + 8));  // [G, ATTN_CHUNK] scores, then probabilities
  __nv_bfloat16* pb = reinterpret_cast<__nv_bfloat16*>(sc + G * ATTN_CHUNK);
  float* st = sc + G * ATTN_CHUNK + 8 * (ATTN_CHUNK + 8);   // m[G], l[G], alpha[G]
  int* spg = reinterpret_cast<int*>(st + ((3 * G + 3) & ~3));   // [2][ATTN_PAGES] page numbers
  char* kvs = reinterpret_cast<char*>(spg + 2 * ATTN_PAGES);
  const size_t head_stride = (size_t)ps * D, page_stride = (size_t)a.kv_heads * head_stride;
  const size_t layer_off = (size_t)l * a.num_pages * page_stride + g * head_stride;
  const wtype* kbase = reinterpret_cast<const wtype*>(a.k_cache) + layer_off;
  const wtype* vbase = reinterpret_cast<const wtype*>(a.v_cache) + layer_off;
  // Copies: thread (row phase, 16-byte column pc) takes rows tr, tr + RSTEP, ... of K and V.
  const int PR = D * (int)sizeof(wtype) / 16, pc = threadIdx.x % PR, tr = threadIdx.x / PR, RSTEP = NTHREADS / PR;
  // Chunk c's page numbers (pages c0 / ps ..) are copied to spg[c % 2] with chunk c - 1's K/V,
  // so a K/V copy never waits for its page number's round trip.
  auto copy_pages = [&](int c) {
    const int c0 = t0 + c * CH;
    if (c < nchunks && threadIdx.x <= (min(CH, t1 - c0) - 1 + c0 % ps) / ps)
      cp_async4(spg + c % 2 * ATTN_PAGES + threadIdx.x, pages + c0 / ps + threadIdx.x);
  };
  auto issue = [&](int c) {   // chunk c -> stage c % 2 and chunk c + 1's pages, one commit group
    const int c0 = t0 + c * CH, cn = min(CH, t1 - c0);
    char* kd = kvs + (size_t)(c % 2) * 2 * CH * RB + pc * 16;
    char* vd = kd + (size_t)CH * RB;
    const int* pg = spg + c % 2 * ATTN_PAGES - c0 / ps;
    for (int t = tr; t < cn; t += RSTEP) {
      const int tok = c0 + t;
      const size_t off = (size_t)pg[tok / ps] * page_stride + (size_t)(tok % ps) * D;
      cp_async16(kd + t * RB, reinterpret_cast<const char*>(kbase + off) + pc * 16);
      cp_async16(vd + t * RB, reinterpret_cast<const char*>(vbase + off) + pc * 16);
    }
    // V rows up to the next multiple of 16 are zeros: the tensor-core P.V reads whole k16 steps.
    for (int t = cn + tr; t < ((cn + 15) & ~15); t += RSTEP) cp_async16(vd + t * RB, vbase, 0);
    copy_pages(c + 1);
    cp_async_commit();
  };
  if (nchunks > 0) {   // chunk 0's page numbers, then its K/V
    copy_pages(0);
    cp_async_wait_all();
    __syncthreads();
    issue(0);
  }
  const float* q = reinterpret_cast<const float*>(a.q) + ((size_t)b * a.q_heads + g * G) * D;
  if (tc) {
    for (int i = G * (ATTN_CHUNK + 8) + threadIdx.x; i < 16 * (ATTN_CHUNK + 8); i += NTHREADS)
      pb[i] = __float2bfloat16_rn(0.f);   // heads >= G
    __nv_bfloat16* qb = reinterpret_cast<__nv_bfloat16*>(qs);
    for (int i = threadIdx.x; i < 16 * (D + 8); i += NTHREADS) {
      const int h = i / (D + 8), d = i % (D + 8);
      qb[i] = __float2bfloat16_rn(h < G && d < D ? ld_act(q + h * D + d) : 0.f);
    }
  } else {
    for (int i = threadIdx.x; i < G * D; i += NTHREADS) qs[i] = ld_act(q + i) * a.attn_scale;
  }
  for (int h = threadIdx.x; h < G; h += NTHREADS) { st[h] = isa::NEG_INF; st[G + h] = 0.f; }
  prof_mark(a, 11);   // chunk 0's page numbers landed, its K/V issued, this thread's queries loaded
  // P.V roles: NO output octets, Q token phases; threads past Q * NO only help with the rest.
  const int NO = G * D / 8, Q = NTHREADS / NO, o = threadIdx.x % NO, qt = threadIdx.x / NO;
  const int vh = o / (D / 8), vd0 = o % (D / 8) * 8;
  float av[PV_S * 4 > 8 ? PV_S * 4 : 8];   // tensor cores: PV_S C fragments; else one octet
#pragma unroll
  for (int e = 0; e < (int)(sizeof(av) / sizeof(float)); e++) av[e] = 0.f;
  for (int c = 0; c < nchunks; c++) {
    const int c0 = t0 + c * CH, cn = min(CH, t1 - c0);
    cp_async_wait_all();   // this thread's copies of chunk c
    __syncthreads();   // everyone's copies landed; chunk c - 1's buffers and probabilities are read
    if (c == 0) prof_mark(a, 12);   // chunk 0's K/V landed
    if (c + 1 < nchunks) issue(c + 1);                   // in flight during this chunk
    const char* kc = kvs + (size_t)(c % 2) * 2 * CH * RB;
    const char* vc = kc + (size_t)CH * RB;
#ifdef MK_HAS_MMA
    if (tc) {   // scores on tensor cores: warp j takes tokens 8j..8j+7 (an n-tile), all heads
      const int gr = lane >> 2, t4 = lane & 3, QW = (D + 8) / 2;
      const unsigned* qa = reinterpret_cast<const unsigned*>(qs) + gr * QW + t4;   // head gr
      const unsigned* qb = qa + 8 * QW;                                             // head gr + 8
      for (int j = warp; j * 8 < cn; j += NWARPS) {
        const unsigned* kr = reinterpret_cast<const unsigned*>(kc + (j * 8 + gr) * RB) + t4;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        for (int k = 0; k < D / 2; k += 8) mma_bf16(c, qa[k], qb[k], qa[k + 4], qb[k + 4], kr[k], kr[k + 4]);
        // c[0..1]: head gr, tokens 8j + 2 t4 + {0, 1}; c[2..3]: head gr + 8
        const int tk = j * 8 + 2 * t4;
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int h = gr + (e >> 1) * 8, tt = tk + (e & 1);
          if (h < G && tt < cn) sc[h * ATTN_CHUNK + tt] = c[e] * a.attn_scale;
        }
      }
    } else
#endif
    {   // scores
      // Thread (head phase, token t) with W >= cn tokens per phase: a short chunk (batch 1 at
      // ctx 1024: 32 tokens per split, CH 64) takes more head phases, not idle threads.
      int W = 8;
      while (W < cn) W *= 2;
      const int t = threadIdx.x % W, P = NTHREADS / W;
      if (t < cn)
        for (int h = threadIdx.x / W; h < G; h += P) {
          const float4* qh = reinterpret_cast<const float4*>(qs + h * D);
          float s0 = 0.f, s1 = 0.f;
          for (int d = 0; d < D; d += 8) {
            float f[8];
            lds_oct(kc + t * RB + d * sizeof(wtype), f);
            const float4 qa = qh[d / 4], qb = qh[d / 4 + 1];
            s0 += qa.x * f[0] + qa.y * f[1] + qa.z * f[2] + qa.w * f[3];
            s1 += qb.x * f[4] + qb.y * f[5] + qb.z * f[6] + qb.w * f[7];
          }
          sc[h * ATTN_CHUNK + t] = s0 + s1;
        }
    }
    __syncthreads();
    for (int h = warp; h < G; h += NWARPS) {   // online softmax, a warp per head
      float mx = isa::NEG_INF;
      for (int t = lane; t < cn; t += 32) mx = fmaxf(mx, sc[h * ATTN_CHUNK + t]);
      mx = warp_max(mx);
      const float mold = st[h], mnew = fmaxf(mold, mx);
      float sum = 0.f;
      if (tc) {   // bf16 for the tensor cores, zeros to the k16 step's end
        for (int t = lane; t < ((cn + 15) & ~15); t += 32) {
          const float p = t < cn ? expf(sc[h * ATTN_CHUNK + t] - mnew) : 0.f;
          pb[h * (ATTN_CHUNK + 8) + t] = __float2bfloat16_rn(p);
          sum += p;
        }
      } else {
        for (int t = lane; t < cn; t += 32) {
          const float p = expf(sc[h * ATTN_CHUNK + t] - mnew);
          sc[h * ATTN_CHUNK + t] = p;
          sum += p;
        }
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
#ifdef MK_HAS_MMA
    if (tc) {   // P.V on tensor cores: warp w takes dims 8j..8j+7 (j = w, w + NWARPS, ...)
      const int gr = lane >> 2, t4 = lane & 3, PW = (ATTN_CHUNK + 8) / 2, cn16 = (cn + 15) & ~15;
      const unsigned* pa = reinterpret_cast<const unsigned*>(pb) + gr * PW + t4;   // head gr; + 8 PW: gr + 8
      const float al0 = gr < G ? st[2 * G + gr] : 0.f, al1 = gr + 8 < G ? st[2 * G + gr + 8] : 0.f;
#pragma unroll
      for (int e = 0; e < 4 * PV_S; e++) av[e] *= (e & 2) ? al1 : al0;
      for (int kk = 0; kk < cn16; kk += 32) {
        const unsigned* p0 = pa + kk / 2;
#pragma unroll
        for (int s2 = 0; s2 < PV_S; s2++) {
          const int j = warp + s2 * NWARPS;
          if (j * 8 >= D) break;   // warp-uniform
          unsigned v0, v1, v2, v3;   // B fragments of k steps kk and kk + 16 (V rows kk + lane)
          ldsm_x4_trans(v0, v1, v2, v3, vc + (kk + lane) * RB + 16 * j);
          mma_bf16(av + 4 * s2, p0[0], p0[8 * PW], p0[4], p0[8 * PW + 4], v0, v1);
          if (kk + 16 < cn16) mma_bf16(av + 4 * s2, p0[8], p0[8 * PW + 8], p0[12], p0[8 * PW + 12], v2, v3);
        }
      }
    } else
#endif
    if (qt < Q) {   // P.V for this thread's octet and token phase
      const float alpha = st[2 * G + vh];
#pragma unroll
      for (int e = 0; e < 8; e++) av[e] *= alpha;
      for (int t = qt; t < cn; t += Q) {
        const float p = sc[vh * ATTN_CHUNK + t];
        float f[8];
        lds_oct(vc + t * RB + vd0 * sizeof(wtype), f);
#pragma unroll
        for (int e = 0; e < 8; e++) av[e] += p * f[e];
      }
    }
  }
  __syncthreads();   // the chunk buffers are no longer read: the phases' partials go there
  prof_mark(a, 13);   // the last chunk's P.V done
  float* red = reinterpret_cast<float*>(kvs);   // [Q][G * D] (tensor cores: [1][G * D])
  int nq = Q;
#ifdef MK_HAS_MMA
  if (tc) {   // C fragments: av[4 s + 0..1] head gr, dims 8j + 2 t4 + {0, 1}; [2..3] head gr + 8
    nq = 1;
    const int gr = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int s2 = 0; s2 < PV_S; s2++) {
      const int j = warp + s2 * NWARPS, d = 8 * j + 2 * t4;
      if (j * 8 >= D) break;
      if (gr < G) { red[gr * D + d] = av[4 * s2]; red[gr * D + d + 1] = av[4 * s2 + 1]; }
      if (gr + 8 < G) { red[(gr + 8) * D + d] = av[4 * s2 + 2]; red[(gr + 8) * D + d + 1] = av[4 * s2 + 3]; }
    }
  } else
#endif
  if (qt < Q) {
    float4* r = reinterpret_cast<float4*>(red + (size_t)qt * G * D + vh * D + vd0);
    r[0] = make_float4(av[0], av[1], av[2], av[3]);
    r[1] = make_float4(av[4], av[5], av[6], av[7]);
  }
  __syncthreads();
  float* part = reinterpret_cast<float*>(a.attn_part) + ((size_t)b * a.q_heads + g * G) * S * (D + 2);
  for (int i = threadIdx.x; i < G * (D + 2); i += NTHREADS) {
    const int h = i / (D + 2), d = i % (D + 2);
    float v;
    if (d < D) {
      v = 0.f;
      for (int p = 0; p < nq; p++) v += red[(size_t)p * G * D + h * D + d];
    } else {
      v = st[(d - D) * G + h];
    }
    part[((size_t)h * S + split) * (D + 2) + d] = v;
  }
  __syncthreads();   // the partial's stores precede thread 0's ticket (release)
  __shared__ int last;
  if (threadIdx.x == 0) {
    unsigned t = 1;
    const int cid = ins[isa::F_ARG2];
    if (cid != isa::NO_COUNTER) {   // S > 1; partials and ticket are this GPU's: .gpu scope
      fence_acq_rel_gpu();
      t = atomicAdd(reinterpret_cast<unsigned*>(a.counters) + (size_t)cid * isa::COUNTER_STRIDE, 1u) + 1;
      fence_acq_rel_gpu();          // acquire: the other splits' partials
    }
    last = t % (unsigned)S == 0;
  }
  __syncthreads();
  prof_mark(a, 14);   // the partial stored and the ticket drawn
  if (last) {
    const size_t off = ((size_t)b * a.q_heads + g * G) * D;
    merge_group(a, part, reinterpret_cast<float*>(a.attn_out) + off,
                mma_batch(batch) ? reinterpret_cast<__nv_bfloat16*>(a.attn_bf) + off : nullptr, smem);
  }
}
