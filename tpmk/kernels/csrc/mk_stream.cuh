// Weight streaming for the CUDA-core matvec (batches below MMA_MIN_BATCH): the TMA unit
// copies a linear instruction's weight tile, a few whole rows at a time, into a ring of
// shared-memory stages (cp.async.bulk + one mbarrier per stage). Thread 0 fills the first
// stages BEFORE the instruction waits on its counters (weights never depend on the step's
// activations, so they stream while the SM waits for its inputs) and refills a stage as
// soon as the block has consumed it: up to nstages * STAGE_BYTES stay in flight while the
// block computes, instead of one register burst per warp at a time.
//
// Shared memory of a streamed linear() (f32 words from the dynamic base; nb = rows per pass):
//   red [NWARPS * BATCH_CHUNK] | xs [nb * kmax] | outs [nb * out_max] | partials [2 * PBUF_WORDS] | ring
// The layout depends only on the launch's batch, so it is fixed for the whole launch and
// a stage's mbarrier parity follows from a per-CTA running stage count.
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"

#ifndef MK_STAGE_BYTES
#define MK_STAGE_BYTES (16 * 1024)
#endif
#ifndef MK_RING_MAX
#define MK_RING_MAX 12
#endif
#ifndef MK_COPY_BYTES
#define MK_COPY_BYTES (1 << 30)   // one bulk copy per row block of a stage (tuning: split them)
#endif
constexpr int STAGE_BYTES = MK_STAGE_BYTES;
constexpr int RING_MAX = MK_RING_MAX;      // stages at most (12 x 16 KB at batch 1)
constexpr int RPS_MAX = 32;       // weight rows per stage at most
constexpr int PBUF_WORDS = 256;   // one stage's per-warp partial sums [rows][warps per row][nb]

// A linear instruction's weight tile: rows (RowMap), their length K and count.
struct Tile {
  RowMap rows;
  int K, nrows;
};

// The tile of a linear op (qkv, gate_up, o_proj, down, lm_head); false for other ops.
// The ops and the stream producer both take their tile from here.
__device__ __forceinline__ bool linear_tile(const KernelArgs& a, const int* ins, Tile& t) {
  const int l = ins[isa::F_LAYER], r0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS];
  const size_t H = a.hidden, D = a.head_dim, I = a.inter, hq = a.q_heads, hkv = a.kv_heads;
  switch (ins[isa::F_OP]) {
    case isa::OP_QKV: {   // one head's rotary pairs [p0, p0 + n): rows p0 + i and D/2 + p0 + i
      const wtype* W = reinterpret_cast<const wtype*>(a.qkv) + (size_t)l * (hq + 2 * hkv) * D * H;
      const size_t p0 = ins[isa::F_ARG0];
      t = Tile{RowMap{W + (r0 * D + p0) * H, W + (r0 * D + D / 2 + p0) * H, n, (int)H}, (int)H, 2 * n};
      return true;
    }
    case isa::OP_GATE_UP: {   // gate rows [r0, r0 + n), then the same up rows
      const wtype* W = reinterpret_cast<const wtype*>(a.gate_up) + (size_t)l * 2 * I * H;
      t = Tile{RowMap{W + r0 * H, W + (I + r0) * H, n, (int)H}, (int)H, 2 * n};
      return true;
    }
    case isa::OP_O_PROJ: {
      const size_t K = hq * D;
      const wtype* W = reinterpret_cast<const wtype*>(a.o_proj) + l * H * K + r0 * K;
      t = Tile{RowMap{W, W, n, (int)K}, (int)K, n};
      return true;
    }
    case isa::OP_DOWN: {
      const wtype* W = reinterpret_cast<const wtype*>(a.down) + l * H * I + r0 * I;
      t = Tile{RowMap{W, W, n, (int)I}, (int)I, n};
      return true;
    }
    case isa::OP_LM_HEAD: {
      const wtype* W = reinterpret_cast<const wtype*>(a.lm_head) + r0 * H;
      t = Tile{RowMap{W, W, n, (int)H}, (int)H, n};
      return true;
    }
    default:
      return false;
  }
}

// Per-CTA ring state; thread 0 writes it before the instruction's "go" barrier, every
// thread reads it inside linear().
struct Ring {
  unsigned long long bar[RING_MAX];
  unsigned base;   // running stage count at this instruction's first stage
  int total;       // this instruction's stages (0: not streamed)
  int nstages;     // ring slots in this launch (0: streaming off)
  int outs, pbuf, off;   // outputs, partials and ring offsets (f32 words)
  Tile tile;
  int rps, spp;    // rows per stage, stages per pass
};

__device__ __forceinline__ Ring& ring() {
  __shared__ Ring r;
  return r;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_wait(const unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra LAB_WAIT;\n}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// Thread 0, once per launch: the ring's place and size for this launch's batch.
__device__ void ring_init(const KernelArgs& a, int batch) {
  Ring& r = ring();
  unsigned dyn;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
  const int nb = min(max(batch, 1), BATCH_CHUNK);
  r.outs = NWARPS * BATCH_CHUNK + nb * a.kmax;
  r.pbuf = r.outs + nb * a.out_max;
  r.off = (r.pbuf + 2 * PBUF_WORDS + 31) & ~31;
  const long long room = (long long)dyn - 4ll * r.off;
  r.nstages = !a.stream_weights || room < 2ll * STAGE_BYTES ? 0 : (int)min((long long)RING_MAX, room / STAGE_BYTES);
  r.base = 0;
  r.total = 0;
  for (int j = 0; j < RING_MAX; j++)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&r.bar[j])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#ifdef MK_DEBUG_RING
  if (blockIdx.x == 0) printf("ring: dyn %u B, off %d words, %d stages of %d B\n", dyn, r.off, r.nstages, STAGE_BYTES);
#endif
}

// Thread 0: copy local stage j of the current instruction (pass j / spp, rows of stage
// j % spp) into its slot; the slot's mbarrier completes when all its bytes have landed.
__device__ void stream_issue(float* smem, int j) {
  Ring& r = ring();
  const unsigned g = r.base + j, slot = g % r.nstages;
  const int s = j % r.spp, row0 = s * r.rps, n = min(r.rps, r.tile.nrows - row0);
  const unsigned rb = r.tile.K * sizeof(wtype), bar = smem_addr(&r.bar[slot]);
  const unsigned dst = smem_addr(smem + r.off) + slot * STAGE_BYTES;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n * rb) : "memory");
  const int k0 = min(n, max(0, r.tile.rows.n0 - row0));   // rows from region 0, then region 1
  const wtype* src[2] = {r.tile.rows(row0), k0 < n ? r.tile.rows(row0 + k0) : nullptr};
  const unsigned bytes[2] = {k0 * rb, (n - k0) * rb}, at[2] = {dst, dst + k0 * rb};
  for (int i = 0; i < 2; i++)
    for (unsigned o = 0; o < bytes[i]; o += MK_COPY_BYTES) {
      const unsigned nb = min(bytes[i] - o, (unsigned)MK_COPY_BYTES);
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(at[i] + o), "l"(reinterpret_cast<const char*>(src[i]) + o), "r"(nb), "r"(bar) : "memory");
    }
}

// Thread 0, before the instruction waits on its counters: plan the instruction's stream
// (or none) and issue its first stages.
__device__ void stream_start(const KernelArgs& a, const int* ins, int batch, float* smem) {
  Ring& r = ring();
  r.base += r.total;
  r.total = 0;
  if (r.nstages == 0 || batch <= 0) return;
#ifdef MK_HAS_MMA
  if (batch >= MMA_MIN_BATCH) return;   // tensor-core path
#endif
  Tile t;
  if (!linear_tile(a, ins, t)) return;
  const int kv = t.K / VEC, row_bytes = t.K * (int)sizeof(wtype);
  if (t.K % VEC || kv > 2 * NTHREADS || row_bytes > STAGE_BYTES) return;
  const int rps = min(RPS_MAX, STAGE_BYTES / row_bytes), tpr = min(NTHREADS, (kv + 31) / 32 * 32);
  if (rps * (tpr / 32) * BATCH_CHUNK > PBUF_WORDS) return;
  r.tile = t;
  r.rps = rps;
  r.spp = (t.nrows + rps - 1) / rps;
  r.total = (batch + BATCH_CHUNK - 1) / BATCH_CHUNK * r.spp;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // after the last op's generic smem writes
  for (int j = 0; j < min(r.nstages, r.total); j++) stream_issue(smem, j);
}

// The consumer: outs[b * nrows + r] = W[row r] . xs[b], b < NB, for pass `pass` of the
// current instruction's stream. A group of tpr threads (whole warps) takes a row: each
// thread holds the inputs of its <= 2 sixteen-byte columns in registers, so a row costs it
// one or two conflict-free 16-byte shared loads; warp sums go to the partials, which are
// summed in fixed order (deterministic) after the stage's barrier.
template <int NB>
__device__ void matvec_stream_nb(int K, const float* xs, int nrows, float* outs, float* smem, int pass) {
  const Ring& r = ring();
  const int kv = K / VEC, tpr = min(NTHREADS, (kv + 31) / 32 * 32), G = NTHREADS / tpr, wpr = tpr / 32;
  const int t = threadIdx.x, grp = t / tpr, c = t % tpr, lane = t & 31, w = c >> 5;
  float xr[2][NB][VEC];
#pragma unroll
  for (int cc = 0; cc < 2; cc++) {
    const int col = c + cc * tpr;
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
      for (int v = 0; v < VEC / 4; v++) {
        const float4 x = grp < G && col < kv ? reinterpret_cast<const float4*>(xs + b * K + col * VEC)[v]
                                             : make_float4(0.f, 0.f, 0.f, 0.f);
        xr[cc][b][4 * v] = x.x; xr[cc][b][4 * v + 1] = x.y; xr[cc][b][4 * v + 2] = x.z; xr[cc][b][4 * v + 3] = x.w;
      }
  }
  float* pbuf = smem + r.pbuf;
  const char* slots = reinterpret_cast<const char*>(smem + r.off);
  for (int s = 0; s < r.spp; s++) {
    const int j = pass * r.spp + s;
    const unsigned g = r.base + j, slot = g % r.nstages;
    mbar_wait(&r.bar[slot], (g / r.nstages) & 1);
    const uint4* st = reinterpret_cast<const uint4*>(slots + slot * STAGE_BYTES);
    const int row0 = s * r.rps, n = min(r.rps, nrows - row0);
    float* pb = pbuf + (s & 1) * PBUF_WORDS;
    if (grp < G) {
      for (int jr = grp; jr < n; jr += G) {
        float acc[NB];
#pragma unroll
        for (int b = 0; b < NB; b++) acc[b] = 0.f;
#pragma unroll
        for (int cc = 0; cc < 2; cc++) {
          const int col = c + cc * tpr;
          if (col < kv) {
            float f[VEC];
            unpack(st[jr * kv + col], f);
#pragma unroll
            for (int b = 0; b < NB; b++)
#pragma unroll
              for (int e = 0; e < VEC; e++) acc[b] += f[e] * xr[cc][b][e];
          }
        }
#pragma unroll
        for (int b = 0; b < NB; b++) {
          const float v = warp_sum(acc[b]);
          if (lane == 0) pb[(jr * wpr + w) * NB + b] = v;
        }
      }
    }
    __syncthreads();   // the slot is free, the stage's partials complete
    if (t == 0 && j + r.nstages < r.total) stream_issue(smem, j + r.nstages);
    for (int i = t; i < n * NB; i += NTHREADS) {
      const int jr = i / NB, b = i % NB;
      float v = 0.f;
      for (int q = 0; q < wpr; q++) v += pb[(jr * wpr + q) * NB + b];
      outs[b * nrows + row0 + jr] = v;
    }
  }
  __syncthreads();
}

__device__ void matvec_stream(int K, const float* xs, int nb, int nrows, float* outs, float* smem, int pass) {
  if (nb == 1) matvec_stream_nb<1>(K, xs, nrows, outs, smem, pass);
  else if (nb == 2) matvec_stream_nb<2>(K, xs, nrows, outs, smem, pass);
  else if (nb == 3) matvec_stream_nb<3>(K, xs, nrows, outs, smem, pass);
  else matvec_stream_nb<4>(K, xs, nrows, outs, smem, pass);
}
