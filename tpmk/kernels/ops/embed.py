"""embed: vocab-parallel embedding lookup pushed to every peer (CUDA: csrc/ops/embed.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class Embed(Instruction):
    """Columns [row0, row0 + nrows) of the hidden size; arg0 = residual stage (0).

    The rank owning token t (rows rank*Vp .. (rank+1)*Vp of the padded vocab)
    contributes its embedding row, every other rank contributes zeros; the
    RESIDUAL op of stage 0 sums the tp slots, so x0 is exact on every rank.
    """
    opcode = Opcode.EMBED
    name = "embed"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        cols = slice(self.row0, self.row0 + self.nrows)
        vp = st.w.embed.shape[0]
        out = torch.zeros(B, self.nrows, dtype=torch.float32)
        for b in range(B):
            local = vm.tokens[b] - rank * vp
            if 0 <= local < vp:
                out[b] = st.w.embed[local, cols].float()
        for peer in vm.ranks:
            peer.slots(self.arg0)[rank, :B, cols] = out
