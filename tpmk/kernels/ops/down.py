"""down: down projection rows, push partial to peers (CUDA: csrc/ops/down.cuh)."""
from __future__ import annotations

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class Down(Instruction):
    """Output columns [row0, row0 + nrows) of the hidden size (row-parallel partial sum)."""
    opcode = Opcode.DOWN
    name = "down"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        cols = slice(self.row0, self.row0 + self.nrows)
        out = vm.matvec(st.act[:B], st.w.down[self.layer, cols])
        for p in self.push_ranks(vm.tp):   # every rank, or the columns' owner (reduce-scatter)
            vm.ranks[p].mlp_slots[rank, :B, cols] = out
