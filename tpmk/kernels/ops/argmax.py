"""argmax: reduce all ranks' LM-head candidates into tokens (CUDA: csrc/ops/argmax.cuh)."""
from __future__ import annotations

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class Argmax(Instruction):
    """Candidates in (rank, tile) order are in increasing vocab id, so a strict '>'
    keeps the first maximum, as torch.argmax does."""
    opcode = Opcode.ARGMAX
    name = "argmax"

    def execute(self, vm, rank: int) -> None:
        st = vm.ranks[rank]
        cand = st.cand[:, :, :vm.batch].reshape(-1, vm.batch, 2)              # [tp*tiles, B, 2]
        for b in range(vm.batch):
            best, tok = float("-inf"), -1
            for c in range(cand.shape[0]):
                v = float(cand[c, b, 0])
                if v > best:
                    best, tok = v, int(cand[c, b, 1])
            st.tokens_out[b] = tok
