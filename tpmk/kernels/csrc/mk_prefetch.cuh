// Before an instruction waits on its counters, thread 0 asks the
// TMA unit to pull the start of the instruction's weight tile (and, for
// attention, its KV pages) into L2 (cp.async.bulk.prefetch.L2, sm_90). Weights
// never depend on the step's activations, so the bytes stream while the SM
// would otherwise idle at the dependency; the matvec then reads them from L2.
#pragma once
#include "mk_common.cuh"

// Bytes per instruction. More was slower: batch 1 / 32 / 128 at ctx 1024 took 11.46 / 16.41 /
// 34.86 ms with 96 KB, 11.69 / 16.73 / 35.97 with 128 KB, and 12.08 / 17.56 / 36.54 with
// 192 KB plus the next instruction's 192 KB (the previous default); 64 KB: 11.28 / 16.46 /
// 35.16, but batch 128 at ctx 4096 49.60 vs 46.63 (H200, 2026-12-04, bench/tune_sweep.sh).
#ifndef PREFETCH_CAP
#define PREFETCH_CAP (96 * 1024)
#endif
constexpr unsigned long long prefetch_cap = PREFETCH_CAP;

// addr and bytes multiples of 16 (rows of bf16/f32 with H, K % 8 == 0 are).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned long long bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  bytes &= ~15ull;
  while (bytes > 0) {
    const unsigned n = bytes > (1ull << 20) ? (1u << 20) : (unsigned)bytes;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c), "r"(n) : "memory");
    c += n;
    bytes -= n;
  }
}

__device__ void prefetch_instruction(const KernelArgs& a, const int* ins, const int* hdr) {
  const size_t D = a.head_dim, es = sizeof(wtype), hkv = a.kv_heads;
  Tile t;
  if (linear_tile(a, ins, t)) {   // the start of each of the tile's (at most two) row blocks
    const int n0 = min(t.rows.n0, t.nrows);
    const unsigned long long row = (unsigned long long)t.K * es, cap = n0 < t.nrows ? prefetch_cap / 2 : prefetch_cap;
    prefetch_l2(t.rows(0), min(n0 * row, cap));
    if (n0 < t.nrows) prefetch_l2(t.rows(n0), min((t.nrows - n0) * row, cap));
    return;
  }
  if (ins[isa::F_OP] != isa::OP_ATTENTION) return;
  // KV pages of this (sequence, kv head, split); the newest token is still to be written
  // by a qkv tile, but its page is among these (prefetch is only a hint).
  const int l = ins[isa::F_LAYER], r0 = ins[isa::F_ROW0], b = ins[isa::F_ARG0], split = ins[isa::F_ARG1];
  if (b >= hdr[isa::H_BATCH]) return;
  const int* pos = hdr + isa::HDR_TOKENS + a.bucket;
  const int* pages = pos + a.bucket + b * a.max_pages;
  const int ctx = pos[b] + 1, S = a.num_splits, per = (ctx + S - 1) / S, ps = a.page_size;
  const int t0 = min(ctx, split * per), t1 = min(ctx, t0 + per);
  const unsigned long long blk = (unsigned long long)ps * D * es;
  unsigned long long budget = prefetch_cap;
  for (int pg = t0 / ps; pg * ps < t1 && budget >= 2 * blk; pg++, budget -= 2 * blk) {
    const size_t off = (((size_t)l * a.num_pages + pages[pg]) * hkv + r0) * ps * D;
    prefetch_l2(reinterpret_cast<const wtype*>(a.k_cache) + off, blk);
    prefetch_l2(reinterpret_cast<const wtype*>(a.v_cache) + off, blk);
  }
}
