"""residual: sum the tp partial slots in fixed rank order into x (CUDA: csrc/ops/residual.cuh)."""
from __future__ import annotations

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class Residual(Instruction):
    """Columns [row0, row0 + nrows); arg0 = stage (0 embed, 2l+1 attention, 2l+2 MLP);
    arg1 = 1: x = sum (stage 0), 0: x += sum. Rank order 0..tp-1 makes every rank
    compute bit-identical x. All-gather form (owner + signal_peers): only the columns'
    owner runs it and writes its x columns into every peer's x too."""
    opcode = Opcode.RESIDUAL
    name = "residual"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        cols = slice(self.row0, self.row0 + self.nrows)
        slots = st.slots(self.arg0)  # [tp, bucket, H]
        acc = slots[0, :B, cols].clone()
        for r in range(1, vm.tp):
            acc += slots[r, :B, cols]
        if self.arg1:
            st.x[:B, cols] = acc
        else:
            st.x[:B, cols] += acc
        if self.owner:
            for peer in vm.ranks:
                peer.x[:B, cols] = st.x[:B, cols]
