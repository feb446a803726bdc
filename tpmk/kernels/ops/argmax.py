"""argmax: merge all ranks' LM-head candidates into the row top-TOPK and tokens (CUDA: csrc/ops/argmax.cuh)."""
from __future__ import annotations

from tpmk.kernels.isa import TOPK, Opcode
from tpmk.kernels.ops.base import Instruction
from tpmk.kernels.ops.lm_head import best_k

NO_ID = 2 ** 31 - 1   # (-inf, -1) entries past a tile's rows sort last (CUDA skips them)


class Argmax(Instruction):
    """Rows [ROW0, ROW0 + NROWS) of the step (those below its batch): row b's global top-TOPK,
    the `best_k` (value desc, id asc) of every rank's tile candidates -> topk_values/topk_ids[b];
    tokens_out[b] = its first id, the lowest id of the maximum, as torch.argmax. Every rank
    computes the same result from its copy."""
    opcode = Opcode.ARGMAX
    name = "argmax"

    def execute(self, vm, rank: int) -> None:
        st, b0, b1 = vm.ranks[rank], self.row0, min(self.row0 + self.nrows, vm.batch)
        if b1 <= b0:
            return
        cand = st.cand[:, :, b0:b1].permute(2, 0, 1, 3, 4).reshape(b1 - b0, -1, 2)   # [rows, tp*tiles*TOPK, 2]
        ids = cand[..., 1].long()
        vals, ids = best_k(cand[..., 0], ids.masked_fill(ids < 0, NO_ID), TOPK)
        st.topk_values[b0:b1], st.topk_ids[b0:b1] = vals, ids
        st.tokens_out[b0:b1] = ids[:, 0]
