// Dependency counters: monotonic u32 counters, one per 128-byte line.
// Producer: every thread's stores, __syncthreads(), then thread 0 does ONE
// fence.acq_rel and a relaxed red.add on each target counter: the barrier
// orders the CTA's stores before thread 0's fence, and fence + relaxed add
// form a release pattern that publishes them to whoever acquires the counter
// (the consumer CTA, on this GPU or a peer). One fence for all tp counters:
// a red.release per peer would fence tp times.
// Consumer: thread 0 spins with ld.acquire until
// counter - epoch * count >= 0 (wrap-safe), then __syncthreads().
// Every spin is bounded by a.timeout_ns (globaltimer); a timeout writes the
// error block (first writer wins) and every CTA then leaves its loop.
// Scope: .gpu when every rank of the launch lives on this GPU (virtual TP, loopback);
// -DMK_SYS_SCOPE for peers on other GPUs (NVLink), where only .sys covers both sides.
#pragma once
#include "mk_common.cuh"

#ifdef MK_SYS_SCOPE
#define MK_SCOPE "sys"
#else
#define MK_SCOPE "gpu"
#endif

// At the ranks' scope (MK_SCOPE: what covers every rank of the launch), for the dependency
// counters and the stores they publish.
__device__ __forceinline__ unsigned ld_acquire_ranks(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire." MK_SCOPE ".global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_relaxed(unsigned* p, unsigned v) {
  asm volatile("red.relaxed." MK_SCOPE ".global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_ranks() {
  asm volatile("fence.acq_rel." MK_SCOPE ";" ::: "memory");
}
// For hand-offs between CTAs of this GPU only (attention's split partials and ticket): .gpu
// even in an MK_SYS_SCOPE build.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ bool aborted(const KernelArgs& a) {
  return *reinterpret_cast<volatile int*>(a.error) != 0;
}

// Thread 0 only. Returns false (after recording the error) on timeout or abort.
__device__ bool wait_counter(const KernelArgs& a, const int* ins, int which, unsigned epoch,
                             int sm, int index) {
  const int cid = ins[which == 0 ? isa::F_WAIT0 : isa::F_WAIT1];
  if (cid == isa::NO_COUNTER) return true;
  const unsigned target = epoch * (unsigned)ins[which == 0 ? isa::F_COUNT0 : isa::F_COUNT1];
  const unsigned* c = reinterpret_cast<const unsigned*>(a.counters) + (size_t)cid * isa::COUNTER_STRIDE;
  unsigned v = ld_acquire_ranks(c);
  if ((int)(v - target) >= 0) return true;
  const unsigned long long t0 = globaltimer();
  int spins = 0;
  while ((int)((v = ld_acquire_ranks(c)) - target) < 0) {
    if ((++spins & 63) == 0) {
      if (aborted(a)) return false;
      if (globaltimer() - t0 > (unsigned long long)a.timeout_ns) {
        int* e = reinterpret_cast<int*>(a.error);
        if (atomicCAS(e + isa::E_FLAG, 0, -1) == 0) {
          e[isa::E_RANK] = a.rank; e[isa::E_SM] = sm; e[isa::E_OPCODE] = ins[isa::F_OP];
          e[isa::E_LAYER] = ins[isa::F_LAYER]; e[isa::E_TILE] = ins[isa::F_TILE];
          e[isa::E_COUNTER] = cid; e[isa::E_EXPECTED] = (int)target; e[isa::E_VALUE] = (int)v;
          e[isa::E_INSTR] = index;
          __threadfence_system();
          atomicExch(e + isa::E_FLAG, 1);
        }
        return false;
      }
    }
  }
  return true;
}

// An all-gather instruction (OWNER + PEERS bits) runs on its owner rank only; the other
// ranks skip it, waits included (its counters are only signalled on the owner).
__device__ __forceinline__ bool runs_here(const KernelArgs& a, const int* ins) {
  const int bits = ins[isa::F_SIGNAL_PEERS];
  return (bits & (isa::SIG_OWNER | isa::SIG_PEERS)) != (isa::SIG_OWNER | isa::SIG_PEERS) ||
         owner_rank(a, ins) == a.rank;
}

// Thread 0 only, after __syncthreads(): publish this CTA's stores and bump the counter on
// this rank, on every rank (PEERS) or on the tile's owner rank (OWNER alone).
__device__ void signal_counter(const KernelArgs& a, const int* ins) {
  const int cid = ins[isa::F_SIGNAL];
  if (cid == isa::NO_COUNTER) return;
  fence_acq_rel_ranks();
  const size_t off = (size_t)cid * isa::COUNTER_STRIDE;
  const int bits = ins[isa::F_SIGNAL_PEERS];
  if (bits & isa::SIG_PEERS) {
    for (int p = 0; p < a.tp; p++)
      red_relaxed(reinterpret_cast<unsigned*>(a.peer_counters[p]) + off, 1u);
  } else if (bits & isa::SIG_OWNER) {
    red_relaxed(reinterpret_cast<unsigned*>(a.peer_counters[owner_rank(a, ins)]) + off, 1u);
  } else {
    red_relaxed(reinterpret_cast<unsigned*>(a.counters) + off, 1u);
  }
}
