"""o_proj: merge attention splits, O projection rows, push partial to peers (CUDA: csrc/ops/o_proj.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


def merge_splits(part: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, Hq, S, D + 2] split partials -> [B, Hq * D] attention output."""
    acc, m, l = part[..., :head_dim], part[..., head_dim], part[..., head_dim + 1]
    w = torch.exp(m - m.max(dim=2, keepdim=True).values)                      # [B, Hq, S]
    out = (w[..., None] * acc).sum(dim=2) / (w * l).sum(dim=2)[..., None]
    return out.reshape(part.shape[0], -1)


class OProj(Instruction):
    """Output columns [row0, row0 + nrows) of the hidden size (row-parallel partial sum)."""
    opcode = Opcode.O_PROJ
    name = "o_proj"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        cols = slice(self.row0, self.row0 + self.nrows)
        attn = merge_splits(st.attn_part[:B], vm.head_dim)                   # [B, Hq*D]
        out = attn @ st.w.o_proj[self.layer, cols].float().T                  # [B, n]
        for p in self.push_ranks(vm.tp):   # every rank, or the columns' owner (reduce-scatter)
            vm.ranks[p].attn_slots[rank, :B, cols] = out
