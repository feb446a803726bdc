"""lm_head: final RMSNorm + vocab-parallel LM head rows + per-tile argmax (CUDA: csrc/ops/lm_head.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import NEG_INF, Opcode
from tpmk.kernels.ops.base import Instruction


class LmHead(Instruction):
    """Local vocab rows [row0, row0 + nrows); tile = candidate slot.

    Padded vocab rows (global id >= vocab_size) get NEG_INF. The tile's best
    (value, global id), first id on ties, is pushed to cand[rank, tile] of
    every peer.
    """
    opcode = Opcode.LM_HEAD
    name = "lm_head"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        rows = slice(self.row0, self.row0 + self.nrows)
        xn = vm.rmsnorm(st.x[:B], st.w.final_norm)
        lg = xn @ st.w.lm_head[rows].float().T                                # [B, n]
        gid = rank * st.w.lm_head.shape[0] + torch.arange(self.row0, self.row0 + self.nrows)
        lg[:, gid >= vm.vocab_size] = NEG_INF
        st.logits[:B, rows] = lg
        val, arg = lg.max(dim=1)
        for peer in vm.ranks:
            peer.cand[rank, self.tile, :B, 0] = val
            peer.cand[rank, self.tile, :B, 1] = gid[arg].float()
