"""o_proj: O projection rows of the merged attention, push partial to peers (CUDA: csrc/ops/o_proj.cuh)."""
from __future__ import annotations

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class OProj(Instruction):
    """Output columns [row0, row0 + nrows) of the hidden size (row-parallel partial sum) of
    attn_out, which the attention groups' last splits merged."""
    opcode = Opcode.O_PROJ
    name = "o_proj"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        cols = slice(self.row0, self.row0 + self.nrows)
        out = vm.matvec(st.attn_out[:B], st.w.o_proj[self.layer, cols])      # [B, n]
        for p in self.push_ranks(vm.tp):   # every rank, or the columns' owner (reduce-scatter)
            vm.ranks[p].attn_slots[rank, :B, cols] = out
