// The tpmk decode megakernel: one persistent CTA per SM, cooperative launch.
// The grid holds `num_local_ranks * sms_per_rank` CTAs: CTA i runs queue
// (i % sms_per_rank) of rank (i / sms_per_rank) with that rank's KernelArgs
// (virtual TP: several ranks in one launch on one GPU; one process per GPU: 1 rank).
// Per CTA: fetch instruction i + 2 into a 3-slot ring, ask L2 for the start of instruction
// i's weights (weights never depend on activations: they flow while this SM waits), wait on
// instruction i's counters, run the op, signal.
// Instruction words and KernelArgs: isa_generated.cuh (from isa.py).
#include "mk_common.cuh"
#include "mk_sync.cuh"
#include "ops/embed.cuh"
#include "ops/residual.cuh"
#include "ops/qkv.cuh"
#include "ops/attention.cuh"
#include "ops/o_proj.cuh"
#include "ops/gate_up.cuh"
#ifdef MK_GU_SPLIT
#include "ops/act.cuh"
#endif
#include "ops/down.cuh"
#include "ops/lm_head.cuh"
#include "ops/argmax.cuh"
#include "mk_prefetch.cuh"

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
megakernel(const KernelArgs* __restrict__ all_args, int sms_per_rank) {
  extern __shared__ float smem[];
  __shared__ KernelArgs sa;
  __shared__ int sins[3][isa::INSTR_WORDS];
  __shared__ int go;
  const int local_rank = blockIdx.x / sms_per_rank, sm = blockIdx.x % sms_per_rank;
  {
    const int* src = reinterpret_cast<const int*>(all_args + local_rank);
    int* dst = reinterpret_cast<int*>(&sa);
    for (int i = threadIdx.x; i < (int)(sizeof(KernelArgs) / 4); i += NTHREADS) dst[i] = src[i];
  }
  __syncthreads();
  const KernelArgs& a = sa;
  const int* hdr = reinterpret_cast<const int*>(a.header);
  const unsigned epoch = (unsigned)hdr[isa::H_EPOCH];
  if (threadIdx.x == 0) step_batch() = hdr[isa::H_BATCH];   // the loop's first barrier publishes it
  const int* instr = reinterpret_cast<const int*>(a.instructions);
  const int i0 = reinterpret_cast<const int*>(a.queue_start)[sm];
  const int i1 = reinterpret_cast<const int*>(a.queue_start)[sm + 1];
  unsigned long long* prof = reinterpret_cast<unsigned long long*>(a.profile);
  if (threadIdx.x < 2 * isa::INSTR_WORDS && i0 + threadIdx.x / isa::INSTR_WORDS < i1)
    sins[threadIdx.x / isa::INSTR_WORDS][threadIdx.x % isa::INSTR_WORDS] =
        instr[i0 * isa::INSTR_WORDS + threadIdx.x];   // instructions i0, i0 + 1
  for (int i = i0; i < i1; i++) {
    __syncthreads();  // sins[i % 3] and [(i + 1) % 3] filled; nobody reads [(i + 2) % 3]
    const int cur = (i - i0) % 3;
    const int* ins = sins[cur];
    if (threadIdx.x < isa::INSTR_WORDS && i + 2 < i1)
      sins[(cur + 2) % 3][threadIdx.x] = instr[(i + 2) * isa::INSTR_WORDS + threadIdx.x];
    if (a.stop_after >= 0 && ins[isa::F_ARG4] > a.stop_after) continue;
    if (!runs_here(a, ins)) continue;   // an all-gather tile another rank owns
    // The start of this instruction's weights into L2 while this SM waits on its counters
    // (mk_prefetch.cuh; the next instruction's too was slower).
    if (threadIdx.x == 0) {
      prefetch_instruction(a, ins);
      go = wait_counter(a, ins, 0, epoch, sm, i) && wait_counter(a, ins, 1, epoch, sm, i);
      if (prof) prof[2 * i] = globaltimer();
#ifdef MK_PROF_MARK
      prof_instr() = i;
#endif
    }
    __syncthreads();
    if (!go) return;
    prof_mark(a, 6);
    switch (ins[isa::F_OP]) {
      case isa::OP_NOP: break;
      case isa::OP_EMBED: op_embed(a, ins, hdr, smem); break;
      case isa::OP_QKV: op_qkv(a, ins, hdr, smem); break;
      case isa::OP_ATTENTION: op_attention(a, ins, hdr, smem); break;
      case isa::OP_O_PROJ: op_o_proj(a, ins, hdr, smem); break;
      case isa::OP_RESIDUAL: op_residual(a, ins, hdr, smem); break;
      case isa::OP_GATE_UP: op_gate_up(a, ins, hdr, smem); break;
#ifdef MK_GU_SPLIT   // gate_up split over K (Megakernel builds with it for such schedules only)
      case isa::OP_ACT: op_act(a, ins, hdr, smem); break;
#endif
      case isa::OP_DOWN: op_down(a, ins, hdr, smem); break;
      case isa::OP_LM_HEAD: op_lm_head(a, ins, hdr, smem); break;
      case isa::OP_ARGMAX: op_argmax(a, ins, hdr, smem); break;
      default:
        if (threadIdx.x == 0) {
          int* e = reinterpret_cast<int*>(a.error);
          if (atomicCAS(e + isa::E_FLAG, 0, -1) == 0) {
            e[isa::E_RANK] = a.rank; e[isa::E_SM] = sm; e[isa::E_OPCODE] = ins[isa::F_OP];
            e[isa::E_LAYER] = ins[isa::F_LAYER]; e[isa::E_INSTR] = i;
            __threadfence_system();
            atomicExch(e + isa::E_FLAG, 2);
          }
        }
        return;
    }
    __syncthreads();  // all of this op's stores precede thread 0's release below
    if (threadIdx.x == 0) {
      if (prof) prof[2 * i + 1] = globaltimer();
      signal_counter(a, ins);
    }
  }
}
