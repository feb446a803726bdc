// MK_WGMMA (an experiment, compiled out by default): every linear op at a tensor-core batch
// runs here, the one place the tensor-core matvec is inlined into the kernel's entry function
// (ptxas pipelines wgmmas only there: mk_mma.cuh). Per pass: the inlined matvec_mma, then the
// op's epilogue (linear_out, a call).
#pragma once
#include "qkv.cuh"
#include "o_proj.cuh"
#include "gate_up.cuh"
#include "down.cuh"
#include "lm_head.cuh"

#ifdef MK_WGMMA
// Whether linear_wg runs this instruction (the ops' own functions run the other batches).
__device__ __forceinline__ bool linear_wg_runs(const int* ins, int batch) {
  const int op = ins[isa::F_OP];
  return mma_batch(batch) && (op == isa::OP_QKV || op == isa::OP_O_PROJ || op == isa::OP_GATE_UP ||
                              op == isa::OP_DOWN || op == isa::OP_LM_HEAD);
}

// The op's input rows.
__device__ __noinline__ XSrc linear_src(const KernelArgs& a, const int* ins) {
  switch (ins[isa::F_OP]) {
    case isa::OP_QKV: return qkv_src(a, ins);
    case isa::OP_GATE_UP: return gate_up_src(a, ins);
    case isa::OP_O_PROJ: return o_proj_src(a);
    case isa::OP_DOWN: return down_src(a);
    default: return lm_head_src(a);
  }
}

// A pass's outputs [nb, nrows] (in shared memory) -> the op's destination; ends with
// __syncthreads() (the next pass refills shared memory).
__device__ __noinline__ void linear_out(const KernelArgs& a, const int* ins, const int* hdr, int batch, int b0,
                                        int nb, float* outs) {
  switch (ins[isa::F_OP]) {
    case isa::OP_QKV: qkv_out(a, qkv_dest(a, ins, hdr), b0, nb, outs); break;
    case isa::OP_GATE_UP: gate_up_out(gate_up_dest(a, ins, batch), b0, nb, outs); break;
    case isa::OP_O_PROJ:
    case isa::OP_DOWN: {
      const int2 peers = push_peers(a, ins);
      push_out(a, ins[isa::F_ROW0], ins[isa::F_NROWS], peers.x, peers.y, b0, nb,
               ins[isa::F_OP] == isa::OP_O_PROJ ? a.peer_attn_slots : a.peer_mlp_slots, outs);
      break;
    }
    default: lm_head_out(a, lm_head_dest(a, ins), b0, nb, outs);
  }
}

__device__ __forceinline__ void linear_wg(const KernelArgs& a, const int* ins, const int* hdr, int batch, float* smem) {
  prof_mark(a, 7);   // the op's entry
  Tile tile;
  linear_tile(a, ins, ins[isa::F_OP], tile);
  const XSrc src = linear_src(a, ins);
  float* base = smem + NWARPS * BATCH_CHUNK;   // linear()'s layout
  float* outs = base + MMA_OUT_AT;
  const int chunk = mma_pass_rows(tile.nrows);
  for (int b0 = 0; b0 < batch; b0 += chunk) {
    const int nb = min(chunk, batch - b0);
    matvec_mma(a, tile.K, b0, nb, tile.nrows, src, tile.rows, outs, base);
    linear_out(a, ins, hdr, batch, b0, nb, outs);
  }
}
#endif  // MK_WGMMA
