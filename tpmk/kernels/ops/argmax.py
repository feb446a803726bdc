"""argmax: merge all ranks' LM-head candidates into the row top-TOPK and tokens (CUDA: csrc/ops/argmax.cuh)."""
from __future__ import annotations

from tpmk.kernels.isa import TOPK, Opcode
from tpmk.kernels.ops.base import Instruction
from tpmk.kernels.ops.lm_head import best_k

NO_ID = 2 ** 31 - 1   # (-inf, -1) entries past a tile's rows sort last (CUDA skips them)


class Argmax(Instruction):
    """Row b's global top-TOPK: the `best_k` (value desc, id asc) of every rank's tile
    candidates -> topk_values/topk_ids[b]; tokens_out[b] = its first id, the lowest id of
    the maximum, as torch.argmax. Every rank computes the same result from its copy."""
    opcode = Opcode.ARGMAX
    name = "argmax"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        cand = st.cand[:, :, :B].permute(2, 0, 1, 3, 4).reshape(B, -1, 2)    # [B, tp*tiles*TOPK, 2]
        ids = cand[..., 1].long()
        vals, ids = best_k(cand[..., 0], ids.masked_fill(ids < 0, NO_ID), TOPK)
        st.topk_values[:B], st.topk_ids[:B] = vals, ids
        st.tokens_out[:B] = ids[:, 0]
