// Shared device helpers of the megakernel: types, vector loads, reductions,
// the fused-RMSNorm input loader and the matvec core used by every linear op.
#pragma once
#include <cuda_bf16.h>
#include "isa_generated.cuh"

#ifndef MK_FLOAT32
typedef __nv_bfloat16 wtype;            // model dtype: weights and KV cache
#else
typedef float wtype;
#endif

// Geometry from isa.py (the host sizes shared memory with the same values).
constexpr int NTHREADS = isa::NTHREADS;
constexpr int NWARPS = NTHREADS / 32;

// The linear ops' entry functions (qkv, o_proj, gate_up, down) are inlined into the
// instruction loop: one ABI call level fewer before linear() (MK_OPS_CALL: calls, for A/Bs).
#ifdef MK_OPS_CALL
#define LINEAR_OP __noinline__
#else
#define LINEAR_OP __forceinline__
#endif
constexpr int VEC = 16 / sizeof(wtype);   // elements per 16-byte load
constexpr int BATCH_CHUNK = isa::BATCH_CHUNK;   // batch rows per matvec pass (inputs in smem)

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ wtype from_f(float v) { return (wtype)v; }

// 16 bytes of weights -> VEC floats.
__device__ __forceinline__ void unpack(const uint4& u, float* f) {
  if constexpr (sizeof(wtype) == 2) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  } else {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of v over the block for each of n values; red: NWARPS * n floats of smem.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], int n, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < N; i++) {   // unrolled over N: v stays in registers
    if (i >= n) break;
    const float s = warp_sum(v[i]);
    if (lane == 0) red[warp * n + i] = s;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; i++) {
    if (i >= n) break;
    float s = 0.f;
    for (int w = 0; w < NWARPS; w++) s += red[w * n + i];
    v[i] = s;
  }
  __syncthreads();
}

// Activations written by other CTAs in this launch are read with ld.global.cg
// (L2, never a stale L1 line); the acquire in wait_counter orders them.
__device__ __forceinline__ float ld_act(const float* p) { return __ldcg(p); }

// Nanoseconds, the same clock on every SM (profile stamps, bounded waits).
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Tuning probe, compiled out by default: with -DMK_PROF_MARK=N the profile's start stamp of
// the running instruction moves to point N: 6 after the barrier that follows the dependency
// wait, 7 a linear op's entry; in the CUDA-core linear(): 5 its
// entry, 3 the inputs loaded, 4 their sums of squares reduced, 1 the normed inputs in shared
// memory, 2 the matvec done; in the tensor-core one (mk_mma.cuh): 8 the first chunk's
// activations landed, 9 the K loop done; 10 a row-parallel op's outputs staged, before the
// push to peers; in attention (ops/attention.cuh): 11 the queries loaded, 12 the first K/V chunk
// landed, 13 the last chunk's P.V done, 14 the ticket drawn, 15 the merge's coefficients.
// Traces of one build per point split a tile's time (bench/tune_sweep.sh).
// The step's batch size (header word H_BATCH): thread 0 reads it once at kernel start (the
// host writes the header before the launch), so an op takes it from shared memory instead
// of a global round trip on its critical path.
__device__ __forceinline__ int& step_batch() {
  __shared__ int b;
  return b;
}

__device__ __forceinline__ int& prof_instr() {
  __shared__ int i;
  return i;
}
__device__ __forceinline__ void prof_mark(const KernelArgs& a, int where) {
#ifdef MK_PROF_MARK
  if (where == MK_PROF_MARK && threadIdx.x == 0 && a.profile)
    reinterpret_cast<unsigned long long*>(a.profile)[2 * prof_instr()] = globaltimer();
#endif
}

// Rows of a linear op's weight tile: r < n0 -> w0 + r * ld, else w1 + (r - n0) * ld.
struct RowMap {
  const wtype* w0;
  const wtype* w1;
  int n0, ld;
  __device__ __forceinline__ const wtype* operator()(int r) const {
    return r < n0 ? w0 + (size_t)r * ld : w1 + (size_t)(r - n0) * ld;
  }
};

// A linear instruction's weight tile: rows (RowMap), their length K and count.
struct Tile {
  RowMap rows;
  int K, nrows;
};

// The tile of a linear op (qkv, gate_up, o_proj, down, lm_head); false for other ops.
// The ops and the L2 prefetch take their tile from here; an op passes its own opcode (a
// constant: the switch folds away), the prefetch the instruction's.
__device__ __forceinline__ bool linear_tile(const KernelArgs& a, const int* ins, int op, Tile& t) {
  const int l = ins[isa::F_LAYER], r0 = ins[isa::F_ROW0], n = ins[isa::F_NROWS];
  const size_t H = a.hidden, D = a.head_dim, I = a.inter, hq = a.q_heads, hkv = a.kv_heads;
  switch (op) {
    case isa::OP_QKV: {   // one head's rotary pairs [p0, p0 + n): rows p0 + i and D/2 + p0 + i
      const wtype* W = reinterpret_cast<const wtype*>(a.qkv) + (size_t)l * (hq + 2 * hkv) * D * H;
      const size_t p0 = ins[isa::F_ARG0];
      t = Tile{RowMap{W + (r0 * D + p0) * H, W + (r0 * D + D / 2 + p0) * H, n, (int)H}, (int)H, 2 * n};
      return true;
    }
    case isa::OP_GATE_UP: {   // gate rows [r0, r0 + n), then the same up rows
#ifdef MK_GU_SPLIT   // split over K (ARG2 = K > 0 columns per slice): columns [j K, (j + 1) K)
      // of them (j = ARG0). No division here: a 64-bit one (H / S) grew the kernel's stack
      // frame from 216 to 288 bytes per thread.
      const int K = ins[isa::F_ARG2] > 0 ? ins[isa::F_ARG2] : (int)H;
      const wtype* W = reinterpret_cast<const wtype*>(a.gate_up) + (size_t)l * 2 * I * H +
                       (size_t)ins[isa::F_ARG0] * K;
      t = Tile{RowMap{W + r0 * H, W + (I + r0) * H, n, (int)H}, K, 2 * n};
#else
      const wtype* W = reinterpret_cast<const wtype*>(a.gate_up) + (size_t)l * 2 * I * H;
      t = Tile{RowMap{W + r0 * H, W + (I + r0) * H, n, (int)H}, (int)H, 2 * n};
#endif
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

// The rank that owns an instruction's tile (reduce-scatter target, all-gather source).
__device__ __forceinline__ int owner_rank(const KernelArgs& a, const int* ins) { return ins[isa::F_TILE] % a.tp; }

// A linear op's input rows: x[b * ldx + k], with RMSNorm (weight nw) fused when nw != null.
// The tensor cores read the same rows rounded to bf16 (bf: [bucket, ldx], already times nw)
// that the producer wrote, and with nw the sums of squares of x as nss partials per row
// (ssq[b * nss + j], one per residual tile).
struct XSrc {
  const float* x;
  int ldx;
  const wtype* nw;
  const __nv_bfloat16* bf;
  const float* ssq;
  int nss;
#ifdef MK_GU_SPLIT
  // A K slice (gate_up split over K): x, bf and nw point at column k0 of the rows. The RMSNorm
  // is over the whole row, its ldx columns. (k0 sits in the struct's tail padding: a larger
  // XSrc, which the ops keep on the stack for linear(), grew the kernel's stack frame.)
  int k0 = 0;
  __device__ __forceinline__ XSrc slice(int k) const {
    return XSrc{x + k, ldx, nw ? nw + k : nw, bf + k, ssq, nss, k0 + k};
  }
#endif
};

// The residual stream x as the input of the RMSNorm with weight nw that the last residual
// stage prepared for (x times nw in bf16 and the sums of squares).
__device__ __forceinline__ XSrc normed_x(const KernelArgs& a, const wtype* nw) {
  return XSrc{reinterpret_cast<const float*>(a.x), a.hidden, nw,
              reinterpret_cast<const __nv_bfloat16*>(a.peer_xn[a.rank]),
              reinterpret_cast<const float*>(a.peer_xn_ssq[a.rank]), a.n_h_tiles};
}

#ifndef MK_FLOAT32   // bf16 weights only
#define MK_HAS_MMA 1
#endif

// Whether this step's matvecs run on the tensor cores, so producers also write their outputs
// in bf16 (isa.MMA_MIN_BATCH: smaller batches stay on the CUDA-core matvec, f32 inputs).
__device__ __forceinline__ bool mma_batch(int batch) {
#ifdef MK_HAS_MMA
  return batch >= isa::MMA_MIN_BATCH;
#else
  return false;
#endif
}

__device__ __forceinline__ unsigned bf2_bits(__nv_bfloat162 h) { return *reinterpret_cast<unsigned*>(&h); }

// 16 bytes global -> shared by cp.async (through L2, no registers): src_bytes of them from
// src, the rest zero-filled (src must still be a valid address). Completes at
// cp_async_wait_all / cp_async_wait<N> after cp_async_commit(); a barrier then publishes it.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes = 16) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// This thread's committed groups: all complete, or all but the newest N.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// bf[off..off + 4) = v rounded to bf16 (nearest even): the tensor cores' inputs.
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* bf, size_t off, float4 v) {
  *reinterpret_cast<uint2*>(bf + off) = make_uint2(bf2_bits(__floats2bfloat162_rn(v.x, v.y)),
                                                   bf2_bits(__floats2bfloat162_rn(v.z, v.w)));
}

// xs[b][k] = rmsnorm(x[b0 + b]) * w (w may be null: plain copy), b < nb, k < K. A K slice
// (K < ldx): x and w point at column k0 of the rows, and the norm is the whole row's.
// Latency-bound at batch 1: every load is a 16-byte vector and all of a thread's
// loads of a pass are issued before any is used (K, ldx multiples of 8: host-checked).
// At 256 threads K = 8192 takes two passes of x and two of norm weights. Tried and not kept:
// one pass of x (NORM_VPT 8) with the weights' loads issued beside it, x * w stored and a
// shared-memory pass scaling by the rsqrt: batch 1 / 2 at ctx 1024 in 9.07 / 9.08 and 9.996 /
// 9.82 ms against 9.10 / 8.86 and 9.72 / 9.63 (H100, 2026-12-06, one call), and the normed
// inputs landed later (probe 1: 5.6 vs 5.0 us after the previous stage): with every SM reading
// the same 32 KB of x (and 16 KB of weights) at once, L2 bandwidth, not round trips, sets it.
constexpr int NORM_VPT = 4;   // float4 of x per thread per pass
__device__ void load_normed(const KernelArgs& a, const float* x, int ldx, int b0, int nb, int K,
                            const wtype* w, float* xs, float* red, int k0 = 0) {
  (void)k0;   // a K slice's offset (MK_GU_SPLIT)
  // Per-row arrays (ss, r) are indexed by loops unrolled over BATCH_CHUNK only, so they stay
  // in registers (a runtime index put them in local memory: a reload per use).
  float ss[BATCH_CHUNK] = {0.f, 0.f, 0.f, 0.f};
  const int K4 = K / 4;
#pragma unroll
  for (int b = 0; b < BATCH_CHUNK; b++) {
    if (b >= nb) break;
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)(b0 + b) * ldx);
    float4* xo = reinterpret_cast<float4*>(xs + b * K);
    for (int k0 = threadIdx.x; k0 < K4; k0 += NORM_VPT * NTHREADS) {
      float4 v[NORM_VPT];
#pragma unroll
      for (int j = 0; j < NORM_VPT; j++)
        v[j] = k0 + j * NTHREADS < K4 ? __ldcg(xr + k0 + j * NTHREADS) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < NORM_VPT; j++) {
        if (k0 + j * NTHREADS < K4) xo[k0 + j * NTHREADS] = v[j];
        ss[b] += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
      }
    }
  }
#ifdef MK_GU_SPLIT
  if (w != nullptr && K < ldx)   // the rest of each row's sum of squares (outside the slice)
#pragma unroll
    for (int b = 0; b < BATCH_CHUNK; b++) {
      if (b >= nb) break;
      const float4* xr = reinterpret_cast<const float4*>(x - k0 + (size_t)(b0 + b) * ldx);
      for (int k = threadIdx.x; k < ldx / 4; k += NTHREADS) {
        if (k >= k0 / 4 && k < (k0 + K) / 4) continue;
        const float4 v = __ldcg(xr + k);
        ss[b] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
    }
  const int knorm = ldx;   // the row's length: K but in a K slice
#else
  const int knorm = K;
#endif
  prof_mark(a, 3);
  if (w == nullptr) { __syncthreads(); return; }
  // Norm weights (16 bytes = 8 per load): the first pass's loads overlap the block reduction.
  float f[2][8];
  auto load_w = [&](int k0) {
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const int k = k0 + j * NTHREADS;
      if constexpr (sizeof(wtype) == 2) {
        unpack(k < K / 8 ? __ldg(reinterpret_cast<const uint4*>(w) + k) : make_uint4(0, 0, 0, 0), f[j]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; e++) f[j][e] = k < K / 8 ? to_f(w[8 * k + e]) : 0.f;
      }
    }
  };
  load_w(threadIdx.x);
  block_sum(ss, nb, red);
  prof_mark(a, 4);
  float r[BATCH_CHUNK];
#pragma unroll
  for (int b = 0; b < BATCH_CHUNK; b++) r[b] = rsqrtf(ss[b] / knorm + a.eps);
  for (int k0 = threadIdx.x; k0 < K / 8; k0 += 2 * NTHREADS) {
    if (k0 != (int)threadIdx.x) load_w(k0);
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const int k = k0 + j * NTHREADS;
      if (k >= K / 8) continue;
#pragma unroll
      for (int b = 0; b < BATCH_CHUNK; b++) {
        if (b >= nb) break;
        float4* p = reinterpret_cast<float4*>(xs + b * K + 8 * k);
        float4 lo = p[0], hi = p[1];
        lo.x *= r[b] * f[j][0]; lo.y *= r[b] * f[j][1]; lo.z *= r[b] * f[j][2]; lo.w *= r[b] * f[j][3];
        hi.x *= r[b] * f[j][4]; hi.y *= r[b] * f[j][5]; hi.z *= r[b] * f[j][6]; hi.w *= r[b] * f[j][7];
        p[0] = lo; p[1] = hi;
      }
    }
  }
  __syncthreads();
}

// For each local row r < nrows: out(r, b, sum_k W[row(r)][k] * xs[b][k]), b < NB.
// A warp takes MV_ROWS rows at once so each shared-memory read of xs feeds
// MV_ROWS * VEC FMAs (smem bandwidth, not HBM, was the limit with one row). With few
// rows (at most NWARPS / 2 row groups) warps also split K, so every warp streams
// weights; the K-slice partials are summed in fixed order (deterministic).
// Each lane keeps MV_ROWS * U 16-byte weight loads in flight.
// Called by every thread of the block (contains __syncthreads when K is split).
constexpr int MV_ROWS = 4;

// One block-wide scratch for the split-K partials (a static __shared__ inside the
// template would be duplicated per instantiation).
__device__ __forceinline__ float* matvec_scratch() {
  __shared__ float part[NWARPS * MV_ROWS * BATCH_CHUNK];
  return part;
}

// How a block splits a matvec of nrows x K: MV_ROWS-row groups, and with few groups K
// slices too (ks * groups <= NWARPS). Warp w takes groups w / ks, w / ks + NWARPS / ks, ...
// over K columns [kbeg, kend).
struct MvSplit {
  int groups, ks, kbeg, kend;
};

__device__ __forceinline__ MvSplit mv_split(int K, int nrows) {
  constexpr int STEP = 32 * VEC;
  MvSplit m;
  m.groups = (nrows + MV_ROWS - 1) / MV_ROWS;
  m.ks = 1;
  while (m.ks * 2 * m.groups <= NWARPS) m.ks *= 2;   // ends with ks * groups <= NWARPS
  const int kslice = (K + m.ks * STEP - 1) / (m.ks * STEP) * STEP, warp = threadIdx.x >> 5;
  m.kbeg = warp % m.ks * kslice;
  m.kend = min(K, m.kbeg + kslice);
  return m;
}

// A warp's row-group sums -> out (ks == 1) or the split-K partials; every thread of the block.
template <int NB, typename OutFn>
__device__ __forceinline__ void mv_group_out(const MvSplit& m, int r0, int nrows, float (&acc)[MV_ROWS][NB], OutFn out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* part = matvec_scratch();
#pragma unroll
  for (int j = 0; j < MV_ROWS; j++)
#pragma unroll
    for (int b = 0; b < NB; b++) {
      const float t = warp_sum(acc[j][b]);
      if (lane == 0) {
        if (m.ks > 1) part[(warp * MV_ROWS + j) * BATCH_CHUNK + b] = t;
        else if (r0 + j < nrows) out(r0 + j, b, t);
      }
    }
}

// The split-K partials summed in fixed order (deterministic); block-uniform, after every group.
template <int NB, typename OutFn>
__device__ __forceinline__ void mv_combine(const MvSplit& m, int nrows, OutFn out) {
  if (m.ks == 1) return;
  const float* part = matvec_scratch();
  __syncthreads();
  for (int i = threadIdx.x; i < nrows * NB; i += NTHREADS) {
    const int r = i / NB, b = i % NB, g = r / MV_ROWS, j = r % MV_ROWS;
    float t = 0.f;
    for (int p = 0; p < m.ks; p++) t += part[((g * m.ks + p) * MV_ROWS + j) * BATCH_CHUNK + b];
    out(r, b, t);
  }
  __syncthreads();
}

// acc[j][b] += W[row j][k..k+VEC) . xs[b][k..k+VEC) for one lane's 16 bytes of each row.
template <int NB>
__device__ __forceinline__ void mv_fma(const float* xs, int K, int k, const uint4 (&u)[MV_ROWS], float (&acc)[MV_ROWS][NB]) {
#pragma unroll
  for (int b = 0; b < NB; b++) {
    float xv[VEC];
    const float4* xb = reinterpret_cast<const float4*>(xs + b * K + k);
#pragma unroll
    for (int v = 0; v < VEC / 4; v++) {
      const float4 t = xb[v];
      xv[4 * v] = t.x; xv[4 * v + 1] = t.y; xv[4 * v + 2] = t.z; xv[4 * v + 3] = t.w;
    }
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++) {
      float f[VEC];
      unpack(u[j], f);
#pragma unroll
      for (int e = 0; e < VEC; e++) acc[j][b] += f[e] * xv[e];
    }
  }
}

// 16 bytes of a weight row: read-only and not kept in L1 (L1::no_allocate). Streamed weights
// allocated in L1 evicted the stack frames and spilled state that every op reloads: with
// __ldg at batch 1 / 2, ctx 1024, 13.58 / 14.12 ms; without L1 allocation 11.67 / 12.09 (H100,
// 2026-12-05, same run). FETCH256: also a 256-byte L2 fetch, which the tensor-core matvec
// wants (its warps cover each 256-byte span together) and the CUDA-core one does not (12.09 /
// 12.55 ms).
template <bool FETCH256 = false>
__device__ __forceinline__ uint4 ldg_w(const wtype* p) {
  uint4 v;
  if constexpr (FETCH256)
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

#ifndef MK_MV_U1
#define MK_MV_U1 4   // 16-byte loads per row in flight per lane at batch 1. 256 threads, H100,
#endif               // 2026-12-06: 2 / 3 / 4 / 6 / 8 in 9.14 / 8.98 / 8.82-8.94 / 8.93 / 9.06 ms
                     // (asking L2 for each row 1 or 2 loop trips ahead was slower: 12.71 / 13.47
                     // vs 12.40 ms at 512 threads, H200, 2026-12-04)
#ifndef MK_MV_UN
#define MK_MV_UN 2   // ... at batch 2-4 (batch 2: 3 / 4 in 9.67 / 9.53 vs 9.63-9.68 ms,
#endif               // same call: noise)
template <int NB, typename RowFn, typename OutFn>
__device__ void matvec_nb(int K, const float* xs, int nrows, RowFn row, OutFn out) {
  constexpr int U = NB == 1 ? MK_MV_U1 : MK_MV_UN, STEP = 32 * VEC;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const MvSplit m = mv_split(K, nrows);
  for (int grp = warp / m.ks; grp < m.groups; grp += NWARPS / m.ks) {
    const int r0 = grp * MV_ROWS;
    const wtype* wr[MV_ROWS];
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++) wr[j] = row(min(r0 + j, nrows - 1));
    float acc[MV_ROWS][NB];
#pragma unroll
    for (int j = 0; j < MV_ROWS; j++)
#pragma unroll
      for (int b = 0; b < NB; b++) acc[j][b] = 0.f;
    for (int k0 = m.kbeg + lane * VEC; k0 < m.kend; k0 += STEP * U) {
      uint4 u[U][MV_ROWS];
#pragma unroll
      for (int i = 0; i < U; i++) {
        const int k = k0 + i * STEP;
#pragma unroll
        for (int j = 0; j < MV_ROWS; j++)
          u[i][j] = k < m.kend ? ldg_w(wr[j] + k) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < U; i++)
        if (k0 + i * STEP < m.kend) mv_fma<NB>(xs, K, k0 + i * STEP, u[i], acc);
    }
    mv_group_out<NB>(m, r0, nrows, acc, out);
  }
  mv_combine<NB>(m, nrows, out);
}

template <typename RowFn, typename OutFn>
__device__ void matvec(int K, const float* xs, int nb, int nrows, RowFn row, OutFn out) {
  if (nb == 1) matvec_nb<1>(K, xs, nrows, row, out);
  else if (nb == 2) matvec_nb<2>(K, xs, nrows, row, out);
  else if (nb == 3) matvec_nb<3>(K, xs, nrows, row, out);
  else matvec_nb<4>(K, xs, nrows, row, out);
}
