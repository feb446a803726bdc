// Device primitives for peer-memory communication (tpmk.comm). Plain peer stores
// and flags only: NEVER NVLink multicast (no multimem, no cuMulticastCreate).
//
// Flags are monotonic u64 epoch counters, one per 128-byte line, each written by
// exactly ONE producer (one block of one rank). A producer stores its epoch; a
// consumer waits for flag >= epoch. Nothing is ever reset, so back-to-back calls
// need no host work, and a stale flag (older epoch) can never satisfy a wait.
//
// Ordering (who publishes what to whom):
//   producer block: all threads store data (local or peer memory) -> __syncthreads()
//     -> one thread per target: fence.acq_rel.<scope> then st.release.<scope> of the flag.
//     The barrier orders the block's stores before that thread's fence; the release
//     store publishes them (cumulativity) to whoever acquires the flag.
//   consumer block: one thread per source spins with ld.acquire.<scope> on its flag
//     -> __syncthreads() -> all threads read the data (ld.global.cg: L2, never a stale L1).
// Scope: .sys by default (peers on other GPUs over NVLink, or other processes);
// -DTPMK_COMM_GPU_SCOPE when every rank of the launch is on this GPU (virtual TP).
//
// Every wait is bounded: past timeout_ns (%globaltimer) the waiter records
// (rank, peer, flag, block, expected, seen) in the ErrorRecord (first writer wins),
// raises the host alarm word, and the kernel returns; Python raises CommError.
#pragma once

#ifdef TPMK_COMM_GPU_SCOPE
#define TPMK_COMM_SCOPE "gpu"
#else
#define TPMK_COMM_SCOPE "sys"
#endif

namespace tpmk_comm {

typedef unsigned long long u64;

// Must match tpmk/comm/arena.py ERROR_RECORD (field order and the 40-byte size).
struct ErrorRecord {
  int status;   // 0 ok, 1 timeout; -1 while the first writer fills the record
  int rank;     // rank that waited
  int peer;     // rank it waited for
  int flag;     // flag kind (arena.py FLAG_KINDS)
  int block;    // block index within the rank group
  int pad;
  u64 expected; // epoch waited for
  u64 seen;     // last value read
};
static_assert(sizeof(ErrorRecord) == 40, "must match tpmk/comm/arena.py ERROR_RECORD");

__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire." TPMK_COMM_SCOPE ".global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release(u64* p, u64 v) {
  asm volatile("st.release." TPMK_COMM_SCOPE ".global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel() {
  asm volatile("fence.acq_rel." TPMK_COMM_SCOPE ";" ::: "memory");
}

__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// 16-byte store into (possibly peer) memory; ordered later by signal().
__device__ __forceinline__ void store16(void* dst, uint4 v) {
  *reinterpret_cast<uint4*>(dst) = v;
}

// 16-byte load of data a peer published; .cg reads L2 (the coherence point), never L1.
__device__ __forceinline__ uint4 load16_cg(const void* src) {
  return __ldcg(reinterpret_cast<const uint4*>(src));
}

// One thread: publish everything the block stored before the preceding __syncthreads().
__device__ __forceinline__ void signal(u64* flag, u64 epoch) {
  fence_acq_rel();
  st_release(flag, epoch);
}

__device__ __forceinline__ bool aborted(const ErrorRecord* err) {
  return *reinterpret_cast<const volatile int*>(&err->status) != 0;
}

// One thread: wait until *flag >= expected. False on timeout (recorded here) or when
// another waiter already recorded an error (abort). `alarm` (mapped pinned host int, may
// be null) lets the host see the failure without synchronizing.
__device__ bool wait_geq(const u64* flag, u64 expected, u64 timeout_ns, ErrorRecord* err,
                         int* alarm, int rank, int peer, int kind, int block) {
  u64 v = ld_acquire(flag);
  if (v >= expected) return true;
  const u64 t0 = globaltimer_ns();
  for (unsigned spins = 1;; spins++) {
    v = ld_acquire(flag);
    if (v >= expected) return true;
    if ((spins & 31) == 0) {
      if (aborted(err)) return false;
      if (globaltimer_ns() - t0 > timeout_ns) break;
    }
  }
  if (atomicCAS(&err->status, 0, -1) == 0) {  // first writer fills the record
    err->rank = rank; err->peer = peer; err->flag = kind; err->block = block;
    err->expected = expected; err->seen = v;
    __threadfence_system();
    atomicExch(&err->status, 1);
    if (alarm) { *reinterpret_cast<volatile int*>(alarm) = 1; __threadfence_system(); }
  }
  return false;
}

}  // namespace tpmk_comm
