"""attention: decode attention of one (sequence, kv head, split) (CUDA: csrc/ops/attention.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import NEG_INF, Opcode
from tpmk.kernels.ops.base import Instruction


def split_range(ctx: int, split: int, num_splits: int) -> tuple[int, int]:
    """Token range [t0, t1) of one split: ctx tokens cut into num_splits equal chunks."""
    per = (ctx + num_splits - 1) // num_splits
    t0 = min(ctx, split * per)
    return t0, min(ctx, t0 + per)


class Attention(Instruction):
    """row0 = local kv head g, arg0 = sequence b, arg1 = split.

    Writes for each query head h of group g the unnormalised partial
    attn_part[b, h, split] = (acc[D], m, l) with m the max score and
    l = sum exp(score - m); O_PROJ merges the splits. Sequences b >= batch
    are no-ops (they still signal, so counts do not depend on the batch).
    """
    opcode = Opcode.ATTENTION
    name = "attention"

    def execute(self, vm, rank: int) -> None:
        b, g, split = self.arg0, self.row0, self.arg1
        if b >= vm.batch:
            return
        st, D, ps = vm.ranks[rank], vm.head_dim, vm.page_size
        G = vm.q_heads // vm.kv_heads
        t0, t1 = split_range(vm.positions[b] + 1, split, vm.num_splits)
        part = st.attn_part[b, g * G:(g + 1) * G, split]                      # [G, D + 2]
        if t1 <= t0:
            part[:, :D], part[:, D], part[:, D + 1] = 0.0, NEG_INF, 0.0
            return
        t = torch.arange(t0, t1)
        pages = vm.pages[b, t // ps].long()
        k = st.k_cache[self.layer, pages, g, t % ps].float()                   # [T, D]
        v = st.v_cache[self.layer, pages, g, t % ps].float()
        q = st.q[b].view(-1, D)[g * G:(g + 1) * G]                             # [G, D]
        s = (q @ k.T) * vm.attn_scale                                          # [G, T]
        m = s.max(dim=1).values
        p = torch.exp(s - m[:, None])
        part[:, :D] = p @ v
        part[:, D] = m
        part[:, D + 1] = p.sum(dim=1)
