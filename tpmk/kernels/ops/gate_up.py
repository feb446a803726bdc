"""gate_up: RMSNorm + gate/up matvec + SiLU(gate) * up (CUDA: csrc/ops/gate_up.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class GateUp(Instruction):
    """Intermediate columns [row0, row0 + nrows): gate rows c and up rows I + c.
    arg1 > 1 slices K (the hidden size) into arg1 equal parts of arg2 columns: this tile takes
    slice arg0 and writes its partial sums (RMSNorm of the whole row) to gu_part[arg0]; ACT sums
    the slices."""
    opcode = Opcode.GATE_UP
    name = "gate_up"

    def execute(self, vm, rank: int) -> None:
        st, B, inter = vm.ranks[rank], vm.batch, vm.inter
        c0, n = self.row0, self.nrows
        x, nw, w = st.x[:B], st.w.post_norm[self.layer], st.w.gate_up[self.layer]
        k = vm.k_slice(self.arg0, self.arg1)
        gate = vm.norm_matvec(x, nw, w[c0:c0 + n], k)
        up = vm.norm_matvec(x, nw, w[inter + c0:inter + c0 + n], k)
        if self.arg1 > 1:
            st.gu_part[self.arg0, :B, c0:c0 + n] = gate
            st.gu_part[self.arg0, :B, inter + c0:inter + c0 + n] = up
        else:
            st.act[:B, c0:c0 + n] = torch.nn.functional.silu(gate) * up
