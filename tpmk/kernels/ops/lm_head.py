"""lm_head: final RMSNorm + vocab-parallel LM head rows + per-tile top-TOPK (CUDA: csrc/ops/lm_head.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import NEG_INF, TOPK, Opcode
from tpmk.kernels.ops.base import Instruction


def best_k(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] values and ids -> the min(k, n) best along the last dim, value descending then
    id ascending (a total order: the result does not depend on how candidates were split;
    torch.topk leaves the order of equal values unspecified)."""
    by_id = ids.argsort(dim=-1, stable=True)
    vals, ids = vals.gather(-1, by_id), ids.gather(-1, by_id)
    by_val = vals.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return vals.gather(-1, by_val), ids.gather(-1, by_val)


class LmHead(Instruction):
    """Local vocab rows [row0, row0 + nrows); tile = candidate slot.

    Padded vocab rows (global id >= vocab_size) get NEG_INF. The tile's TOPK best
    (value, global id) per row, `best_k` order, go to cand[rank, tile] of every peer
    (isa.cand_shape; (-inf, -1) past the tile's rows).
    """
    opcode = Opcode.LM_HEAD
    name = "lm_head"

    def execute(self, vm, rank: int) -> None:
        st, B = vm.ranks[rank], vm.batch
        rows = slice(self.row0, self.row0 + self.nrows)
        lg = vm.norm_matvec(st.x[:B], st.w.final_norm, st.w.lm_head[rows])  # [B, n]
        gid = rank * st.w.lm_head.shape[0] + torch.arange(self.row0, self.row0 + self.nrows)
        lg[:, gid >= vm.vocab_size] = NEG_INF
        st.logits[:B, rows] = lg
        vals, ids = best_k(lg, gid.expand(B, -1), TOPK)                      # [B, min(TOPK, n)]
        cand = torch.tensor([float("-inf"), -1.0]).repeat(B, TOPK, 1)        # [B, TOPK, 2]
        cand[:, :vals.shape[1], 0], cand[:, :vals.shape[1], 1] = vals, ids.float()
        for peer in vm.ranks:
            peer.cand[rank, self.tile, :B] = cand
