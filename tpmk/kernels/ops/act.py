"""act: the SiLU(gate) * up of a gate_up split over K (CUDA: csrc/ops/act.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class Act(Instruction):
    """Intermediate columns [row0, row0 + nrows): gate and up summed over the arg0 K slices'
    partials in slice order, then silu(gate) * up -> act."""
    opcode = Opcode.ACT
    name = "act"

    def execute(self, vm, rank: int) -> None:
        st, B, inter = vm.ranks[rank], vm.batch, vm.inter
        c0, n = self.row0, self.nrows
        part = st.gu_part[:self.arg0, :B]
        gate, up = part[0, :, c0:c0 + n].clone(), part[0, :, inter + c0:inter + c0 + n].clone()
        for j in range(1, self.arg0):   # fixed order, as the kernel sums them
            gate += part[j, :, c0:c0 + n]
            up += part[j, :, inter + c0:inter + c0 + n]
        st.act[:B, c0:c0 + n] = torch.nn.functional.silu(gate) * up
