// Standalone bf16 all-reduce over peer memory (tpmk/comm/allreduce.py is the host side).
//
// Grid: local_ranks groups of blocks_per_rank blocks; group g is global rank rank0 + g.
// Virtual TP: every rank in one cooperative launch (local_ranks = world_size).
// One process per GPU: local_ranks = 1, rank0 = this rank.
// blocks_per_rank is fixed per communicator: every block runs every call, so each
// block's epoch counter equals the call count on every rank, and data buffers
// alternate by epoch parity. Writing call e+1 into parity (e+1)&1 is safe: the reader
// finished parity (e-1)&1 in call e-1, which completed before its call e launch, whose
// data this writer already received before its own call e completed.
//
// Arena of one rank (offsets from arena.py ArenaLayout, passed in AllReduceParams):
//   flags  [kind][block][src] u64 each on its own 128-byte line
//   epochs [block]            u64, touched only by that block of that rank
//   data   [parity][slot 0..W-1 | gather] each slot_bytes
// Elements are handled as 16-byte vectors of 8 bf16; the last vector may be partial
// (inputs read with a bounds check and zero-filled, outputs written with one).
// Sums are fp32 in fixed rank order 0..W-1, rounded once to bf16: bit-identical on all
// ranks and for both algorithms.
//
// nvrtc-variants: <default> ; -DTPMK_COMM_GPU_SCOPE
#include <cuda_bf16.h>
#include "comm.cuh"

using tpmk_comm::u64;

#define TPMK_MAX_RANKS 8
#define TPMK_THREADS 512
#define TPMK_FLAG_WORDS 16  // 128-byte line of u64

// Must match tpmk/comm/allreduce.py _Params (field order; size checked below and in tests).
struct AllReduceParams {
  u64 peers[TPMK_MAX_RANKS];    // arena base of every global rank, as mapped in this process
  u64 inputs[TPMK_MAX_RANKS];   // per local rank: bf16 [n]
  u64 outputs[TPMK_MAX_RANKS];  // per local rank: bf16 [n] (may equal inputs)
  u64 err;                      // ErrorRecord* in device memory
  u64 alarm;                    // int* (mapped pinned host) or 0
  u64 n;                        // elements
  u64 slot_bytes;
  u64 flags_offset, epochs_offset, data_offset;
  u64 timeout_ns;
  int world_size, local_ranks, rank0, blocks_per_rank;
  int max_blocks, algo, absent_rank, pad;
};
static_assert(sizeof(AllReduceParams) == 288, "must match tpmk/comm/allreduce.py _Params");

enum { ALGO_ONE_SHOT = 0, ALGO_TWO_SHOT = 1 };
enum { FLAG_DATA = 0, FLAG_GATHER = 1 };  // must match arena.py FLAG_KINDS

struct Ctx {
  const AllReduceParams& p;
  int rank, block, tid;
  u64 epoch, parity;
  __device__ char* arena(int r) const { return reinterpret_cast<char*>(p.peers[r]); }
  __device__ u64* flag(int owner, int kind, int src) const {
    const size_t line = ((size_t)kind * p.max_blocks + block) * p.world_size + src;
    return reinterpret_cast<u64*>(arena(owner) + p.flags_offset) + line * TPMK_FLAG_WORDS;
  }
  __device__ char* slot(int owner, int src) const {  // src = world_size: the gather buffer
    return arena(owner) + p.data_offset + (parity * (p.world_size + 1) + src) * p.slot_bytes;
  }
};

__device__ __forceinline__ uint4 load_input(const __nv_bfloat16* in, u64 v, u64 n) {
  if ((v + 1) * 8 <= n) return *reinterpret_cast<const uint4*>(in + v * 8);
  uint4 r = make_uint4(0, 0, 0, 0);
  __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&r);
  for (u64 i = v * 8; i < n; i++) e[i - v * 8] = in[i];
  return r;
}

__device__ __forceinline__ void store_output(__nv_bfloat16* out, u64 v, u64 n, uint4 x) {
  if ((v + 1) * 8 <= n) { *reinterpret_cast<uint4*>(out + v * 8) = x; return; }
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&x);
  for (u64 i = v * 8; i < n; i++) out[i] = e[i - v * 8];
}

__device__ __forceinline__ void accumulate(float acc[8], uint4 x) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

__device__ __forceinline__ uint4 to_bf16(const float acc[8]) {
  uint4 r;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
  for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return r;
}

// Threads 0..W-1 (except `self`) wait on flag[kind][block][src=tid] of `owner`; then a barrier.
// `need(src)` says whether src has anything to publish for this block (else no wait).
template <class Need>
__device__ bool wait_all(const Ctx& c, int kind, Need need, int* s_ok) {
  const AllReduceParams& p = c.p;
  if (c.tid < p.world_size && c.tid != c.rank && need(c.tid)) {
    if (!tpmk_comm::wait_geq(c.flag(c.rank, kind, c.tid), c.epoch, p.timeout_ns,
                             reinterpret_cast<tpmk_comm::ErrorRecord*>(p.err),
                             reinterpret_cast<int*>(p.alarm), c.rank, c.tid, kind, c.block))
      *s_ok = 0;
  }
  __syncthreads();
  return *(volatile int*)s_ok != 0;
}

// Threads 0..W-1 (except `self`) publish this block's prior stores to peer `tid`.
template <class Has>
__device__ void signal_all(const Ctx& c, int kind, Has has) {
  __syncthreads();  // every thread's stores precede the signalling threads' fence
  if (c.tid < c.p.world_size && c.tid != c.rank && has(c.tid))
    tpmk_comm::signal(c.flag(c.tid, kind, c.rank), c.epoch);
}

// Vectors [lo, hi) of piece `i` when `len` vectors are cut into `parts` equal pieces.
__device__ __forceinline__ void piece(u64 len, int parts, int i, u64& lo, u64& hi) {
  const u64 per = (len + parts - 1) / parts;
  lo = min(len, per * i);
  hi = min(len, lo + per);
}

__device__ void one_shot(const Ctx& c, int* s_ok) {
  const AllReduceParams& p = c.p;
  const int W = p.world_size, local = c.rank - p.rank0;
  const __nv_bfloat16* in = reinterpret_cast<const __nv_bfloat16*>(p.inputs[local]);
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.outputs[local]);
  const u64 nv = (p.n + 7) / 8;
  u64 lo, hi;
  piece(nv, p.blocks_per_rank, c.block, lo, hi);
  if (lo == hi) return;  // same partition on every rank: nobody signals this block either
  // push my vectors into slot[rank] of every peer
  for (u64 v = lo + c.tid; v < hi; v += blockDim.x) {
    const uint4 x = load_input(in, v, p.n);
    for (int q = 0; q < W; q++)
      if (q != c.rank) tpmk_comm::store16(c.slot(q, c.rank) + v * 16, x);
  }
  signal_all(c, FLAG_DATA, [](int) { return true; });
  if (!wait_all(c, FLAG_DATA, [](int) { return true; }, s_ok)) return;
  for (u64 v = lo + c.tid; v < hi; v += blockDim.x) {
    uint4 x[TPMK_MAX_RANKS];
#pragma unroll
    for (int q = 0; q < TPMK_MAX_RANKS; q++)
      if (q < W) x[q] = q == c.rank ? load_input(in, v, p.n) : tpmk_comm::load16_cg(c.slot(c.rank, q) + v * 16);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < TPMK_MAX_RANKS; q++)
      if (q < W) accumulate(acc, x[q]);
    store_output(out, v, p.n, to_bf16(acc));
  }
}

// Reduce-scatter then all-gather. Shard s (owned by rank s) = vectors [s*sl, (s+1)*sl);
// block b of every rank handles the same sub-range of every shard.
__device__ void two_shot(const Ctx& c, int* s_ok) {
  const AllReduceParams& p = c.p;
  const int W = p.world_size, local = c.rank - p.rank0;
  const __nv_bfloat16* in = reinterpret_cast<const __nv_bfloat16*>(p.inputs[local]);
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.outputs[local]);
  const u64 nv = (p.n + 7) / 8;
  const u64 sl = (nv + W - 1) / W;
  auto sub = [&](int s, u64& lo, u64& hi) {  // absolute vector range of shard s, this block
    u64 a, b;
    const u64 s0 = min(nv, sl * s), s1 = min(nv, s0 + sl);
    piece(s1 - s0, p.blocks_per_rank, c.block, a, b);
    lo = s0 + a; hi = s0 + b;
  };
  auto has = [&](int s) { u64 lo, hi; sub(s, lo, hi); return lo < hi; };
  // 1. reduce-scatter: my part of shard s -> slot[rank] of rank s (offsets shard-relative)
  for (int s = 0; s < W; s++) {
    if (s == c.rank) continue;
    u64 lo, hi;
    sub(s, lo, hi);
    for (u64 v = lo + c.tid; v < hi; v += blockDim.x)
      tpmk_comm::store16(c.slot(s, c.rank) + (v - sl * s) * 16, load_input(in, v, p.n));
  }
  signal_all(c, FLAG_DATA, has);
  // 2. reduce my shard in rank order; write my output and push into every peer's gather
  u64 lo, hi;
  sub(c.rank, lo, hi);
  const bool mine = lo < hi;
  if (!wait_all(c, FLAG_DATA, [&](int) { return mine; }, s_ok)) return;
  for (u64 v = lo + c.tid; v < hi; v += blockDim.x) {
    uint4 x[TPMK_MAX_RANKS];
#pragma unroll
    for (int q = 0; q < TPMK_MAX_RANKS; q++)
      if (q < W) x[q] = q == c.rank ? load_input(in, v, p.n)
                                    : tpmk_comm::load16_cg(c.slot(c.rank, q) + (v - sl * c.rank) * 16);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < TPMK_MAX_RANKS; q++)
      if (q < W) accumulate(acc, x[q]);
    const uint4 y = to_bf16(acc);
    for (int q = 0; q < W; q++)
      if (q != c.rank) tpmk_comm::store16(c.slot(q, W) + v * 16, y);
    store_output(out, v, p.n, y);
  }
  signal_all(c, FLAG_GATHER, [&](int) { return mine; });
  // 3. all-gather: copy every other owner's reduced part from my gather buffer
  if (!wait_all(c, FLAG_GATHER, has, s_ok)) return;
  for (int s = 0; s < W; s++) {
    if (s == c.rank) continue;
    sub(s, lo, hi);
    for (u64 v = lo + c.tid; v < hi; v += blockDim.x)
      store_output(out, v, p.n, tpmk_comm::load16_cg(c.slot(c.rank, W) + v * 16));
  }
}

extern "C" __global__ void __launch_bounds__(TPMK_THREADS)
tpmk_allreduce_bf16(const __grid_constant__ AllReduceParams p) {
  const int local = blockIdx.x / p.blocks_per_rank;
  const int rank = p.rank0 + local;
  if (rank == p.absent_rank) return;  // test hook: this rank never arrives
  const int block = blockIdx.x % p.blocks_per_rank;
  __shared__ u64 s_epoch;
  __shared__ int s_ok;
  u64* epoch_ptr = reinterpret_cast<u64*>(reinterpret_cast<char*>(p.peers[rank]) + p.epochs_offset) + block;
  if (threadIdx.x == 0) {
    s_epoch = *reinterpret_cast<volatile u64*>(epoch_ptr) + 1;
    s_ok = 1;
  }
  __syncthreads();
  Ctx c{p, rank, block, (int)threadIdx.x, s_epoch, s_epoch & 1};
  if (p.algo == ALGO_TWO_SHOT) two_shot(c, &s_ok);
  else one_shot(c, &s_ok);
  __syncthreads();
  // Only a successful call advances the epoch; after a timeout the communicator is dead.
  if (threadIdx.x == 0 && *(volatile int*)&s_ok) *reinterpret_cast<volatile u64*>(epoch_ptr) = c.epoch;
}
