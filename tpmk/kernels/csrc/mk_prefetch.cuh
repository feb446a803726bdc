// Before an instruction waits on its counters, thread 0 asks the
// TMA unit to pull the start of the instruction's weight tile into L2
// (cp.async.bulk.prefetch.L2, sm_90). Weights never depend on the step's
// activations, so the bytes stream while the SM would otherwise idle at the
// dependency; the matvec then reads them from L2. Attention's KV pages are not
// asked for: that was slower (ctx 4096, batch 1 / 32 / 128: 12.05 / 19.07 / 45.12 ms
// with, 11.68 / 18.51 / 43.93 without; H200, 2026-12-04), nor the op's RMSNorm weights, which
// every SM of a stage reads (batch 1 / 8 / 32 at ctx 1024: 9.04 / 10.36 / 14.66 ms with, 9.00 /
// 10.20 / 14.55 without; H100, 2026-12-07).
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

__device__ void prefetch_instruction(const KernelArgs& a, const int* ins) {
  Tile t;
  if (!linear_tile(a, ins, ins[isa::F_OP], t)) return;
  // The start of each of the tile's (at most two) row blocks.
  const int n0 = min(t.rows.n0, t.nrows);
  const unsigned long long row = (unsigned long long)t.K * sizeof(wtype);
  const unsigned long long cap = n0 < t.nrows ? prefetch_cap / 2 : prefetch_cap;
  prefetch_l2(t.rows(0), min(n0 * row, cap));
  if (n0 < t.nrows) prefetch_l2(t.rows(n0), min((t.nrows - n0) * row, cap));
}
