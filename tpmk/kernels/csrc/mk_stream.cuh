// EXPERIMENTAL, off by default (KernelArgs.stream_weights; Megakernel(stream_weights=True)).
// Weight streaming for the CUDA-core matvec (batches below MMA_MIN_BATCH): a linear
// instruction's weight tile flows, a few whole rows at a time, through a ring of
// shared-memory stages filled with cp.async (16 bytes per thread per copy, all threads
// issue). The first stages are issued BEFORE the instruction waits on its counters
// (weights never depend on the step's activations, so they stream while the SM waits for
// its inputs); a stage's slot is refilled as soon as the block has consumed it, so up to
// nstages - 1 stages stay in flight while the block computes.
// Measured on an H200 (2026-12-03, one Llama-3-70B tp=8 rank, batch 1, ctx 1024): 22.6 ms
// per step against 11.8 ms with plain loads; a TMA version (cp.async.bulk + mbarrier) gave
// 18.4 ms, 14.8 ms with 32 KB stages. Per stage ~1.2 us fixed + 16 KB at ~20 GB/s per SM:
// every stage pays about one memory round trip although ~10 are in flight, so the whole
// chip sees ~1.2 TB/s. Open question (needs ncu): why whole-row streams get so much less
// DRAM throughput than the plain matvec's 56 concurrent 2 KB row pieces per SM.
//
// Shared memory of a streamed linear() (f32 words from the dynamic base; nb = rows per pass):
//   red [NWARPS * BATCH_CHUNK] | xs [nb * kmax] | outs [nb * out_max] | partials [2 * PBUF_WORDS] | ring
// The layout depends only on the launch's batch, so it is fixed for the whole launch.
//
// Copy groups: every thread commits exactly one cp.async group per issued stage (possibly
// empty), so all threads count groups alike. Stage j of an instruction is waited for with
// "at most issued - j - 1 groups pending", then one __syncthreads publishes every thread's
// part; the same barrier proves stage j - 1 consumed, so its slot is refilled right there.
#pragma once
#include "mk_common.cuh"
#include "mk_mma.cuh"

#ifndef MK_STAGE_BYTES
#define MK_STAGE_BYTES (16 * 1024)
#endif
#ifndef MK_RING_MAX
#define MK_RING_MAX 12
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
  unsigned base;   // running stage count at this instruction's first stage (slot of its stage 0)
  int total;       // this instruction's stages (0: not streamed)
  int nstages;     // ring slots in this launch (0: streaming off)
  int outs, pbuf, off;   // outputs, partials and ring offsets (f32 words)
  Tile tile;
  int rps, spp;    // rows per stage, stages per pass
  int rot;         // stage s of a pass holds the rows of tile stage (s + rot) % spp
};

__device__ __forceinline__ Ring& ring() {
  __shared__ Ring r;
  return r;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Wait until at most n of this thread's cp.async groups are pending (n < RING_MAX).
__device__ __forceinline__ void cp_async_wait(int n) {
  switch (n) {
#define MK_WAIT_CASE(k) case k: asm volatile("cp.async.wait_group " #k ";" ::: "memory"); break;
    MK_WAIT_CASE(0) MK_WAIT_CASE(1) MK_WAIT_CASE(2) MK_WAIT_CASE(3) MK_WAIT_CASE(4) MK_WAIT_CASE(5)
    MK_WAIT_CASE(6) MK_WAIT_CASE(7) MK_WAIT_CASE(8) MK_WAIT_CASE(9) MK_WAIT_CASE(10)
#undef MK_WAIT_CASE
    default: asm volatile("cp.async.wait_group 11;" ::: "memory"); break;
  }
}
static_assert(RING_MAX <= 12, "cp_async_wait covers up to 11 pending groups");

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
#ifdef MK_DEBUG_RING
  if (blockIdx.x == 0) printf("ring: dyn %u B, off %d words, %d stages of %d B\n", dyn, r.off, r.nstages, STAGE_BYTES);
#endif
}

// Every thread: its 16-byte copies of local stage j of the current instruction (pass
// j / spp, rows of stage j % spp) into the stage's slot, as one cp.async group.
__device__ void stream_issue(float* smem, int j) {
  const Ring& r = ring();
  const int slot = (r.base + j) % r.nstages;
  const int s = (j % r.spp + r.rot) % r.spp, row0 = s * r.rps, n = min(r.rps, r.tile.nrows - row0);
  const int rv = r.tile.K / VEC;   // 16-byte chunks per row
  const unsigned dst = smem_addr(smem + r.off) + slot * STAGE_BYTES;
  for (int c = threadIdx.x; c < n * rv; c += NTHREADS) {
    const int row = c / rv, k = c - row * rv;
    const wtype* src = r.tile.rows(row0 + row) + k * VEC;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 16 * c), "l"(src) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Thread 0, before the instruction's plan barrier: this instruction's stream, or none.
__device__ void stream_plan(const KernelArgs& a, const int* ins, int batch) {
  Ring& r = ring();
  r.base += r.total;
  r.total = 0;
  if (ins == nullptr || r.nstages == 0 || batch <= 0) return;
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
#ifdef MK_STREAM_ROTATE   // tuning: CTAs start their tiles at different rows
  r.rot = (int)(blockIdx.x * 7u % (unsigned)r.spp);
#else
  r.rot = 0;
#endif
  r.total = (batch + BATCH_CHUNK - 1) / BATCH_CHUNK * r.spp;
}

// Every thread, after the plan barrier and before the dependency wait: the first stages.
__device__ __forceinline__ void stream_start(float* smem) {
  const Ring& r = ring();
  for (int j = 0; j < min(r.nstages, r.total); j++) stream_issue(smem, j);
}

// The consumer: outs[b * nrows + r] = W[row r] . xs[b], b < NB, for pass `pass` of the
// current instruction's stream. A group of tpr threads (whole warps) takes a row: each
// thread holds the inputs of its <= 2 sixteen-byte columns in registers, so a row costs it
// one or two conflict-free 16-byte shared loads; warp sums go to the partials, which are
// summed in fixed order (deterministic) one stage later, after that stage's barrier.
template <int NB>
__device__ void matvec_stream_nb(int K, const float* xs, int nrows, float* outs, float* smem, int pass) {
  const Ring& r = ring();
  const int kv = K / VEC, tpr = min(NTHREADS, (kv + 31) / 32 * 32), G = NTHREADS / tpr, wpr = tpr / 32;
  const int t = threadIdx.x, grp = t / tpr, c = t % tpr, lane = t & 31, w = c >> 5;
  const int nst = r.nstages, total = r.total, spp = r.spp, rps = r.rps;
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
  // Partials of stage s of this pass -> outs (after a barrier that follows their writes).
  auto reduce = [&](int s) {
    const float* pb = pbuf + (s & 1) * PBUF_WORDS;
    const int row0 = (s + r.rot) % spp * rps, n = min(rps, nrows - row0);
    for (int i = t; i < n * NB; i += NTHREADS) {
      const int jr = i / NB, b = i % NB;
      float v = 0.f;
      for (int q = 0; q < wpr; q++) v += pb[(jr * wpr + q) * NB + b];
      outs[b * nrows + row0 + jr] = v;
    }
  };
  for (int s = 0; s < spp; s++) {
    const int j = pass * spp + s;
    const int issued = min(total, max(j - 1, 0) + nst);   // groups committed so far
    cp_async_wait(issued - j - 1);
    __syncthreads();   // stage j landed (every thread's part); stage j - 1 consumed by all
    if (j >= 1 && issued < total) stream_issue(smem, issued);   // = stage j - 1 + nst: j - 1's slot
    const uint4* st = reinterpret_cast<const uint4*>(slots + ((r.base + j) % nst) * STAGE_BYTES);
    const int row0 = (s + r.rot) % spp * rps, n = min(rps, nrows - row0);
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
    if (s >= 1) reduce(s - 1);   // its partials were complete at this stage's barrier
  }
  __syncthreads();
  reduce(spp - 1);
  __syncthreads();   // outs complete; partials free for the next pass
}

__device__ void matvec_stream(int K, const float* xs, int nb, int nrows, float* outs, float* smem, int pass) {
  if (nb == 1) matvec_stream_nb<1>(K, xs, nrows, outs, smem, pass);
  else if (nb == 2) matvec_stream_nb<2>(K, xs, nrows, outs, smem, pass);
  else if (nb == 3) matvec_stream_nb<3>(K, xs, nrows, outs, smem, pass);
  else matvec_stream_nb<4>(K, xs, nrows, outs, smem, pass);
}
