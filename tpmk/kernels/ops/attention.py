"""attention: decode attention of one (sequence, kv head, split) (CUDA: csrc/ops/attention.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import NEG_INF, NO_COUNTER, Opcode
from tpmk.kernels.ops.base import Instruction


def merge_splits(part: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, Hq, S, D + 2] split partials -> [B, Hq * D] attention output."""
    acc, m, l = part[..., :head_dim], part[..., head_dim], part[..., head_dim + 1]
    w = torch.exp(m - m.max(dim=2, keepdim=True).values)                      # [B, Hq, S]
    out = (w[..., None] * acc).sum(dim=2) / (w * l).sum(dim=2)[..., None]
    return out.reshape(part.shape[0], -1)


def split_range(ctx: int, split: int, num_splits: int) -> tuple[int, int]:
    """Token range [t0, t1) of one split: ctx tokens cut into num_splits equal chunks."""
    per = (ctx + num_splits - 1) // num_splits
    t0 = min(ctx, split * per)
    return t0, min(ctx, t0 + per)


class Attention(Instruction):
    """row0 = local kv head g, arg0 = sequence b, arg1 = split, arg2 = the (b, g) merge ticket
    counter (NO_COUNTER with one split).

    Writes for each query head h of group g the unnormalised partial
    attn_part[b, h, split] = (acc[D], m, l) with m the max score and
    l = sum exp(score - m), then takes a ticket: the split that draws a multiple of
    num_splits finished last and merges the group's splits into attn_out[b, heads of g]
    (once per group, not in every O_PROJ tile). Sequences b >= batch are no-ops (they
    still signal, so counts do not depend on the batch).
    """
    opcode = Opcode.ATTENTION
    name = "attention"

    def execute(self, vm, rank: int) -> None:
        b, g, split = self.arg0, self.row0, self.arg1
        if b >= vm.batch:
            return
        st, D = vm.ranks[rank], vm.head_dim
        G = vm.q_heads // vm.kv_heads
        t0, t1 = split_range(vm.positions[b] + 1, split, vm.num_splits)
        part = st.attn_part[b, g * G:(g + 1) * G, split]                      # [G, D + 2]
        if t1 <= t0:
            part[:, :D], part[:, D], part[:, D + 1] = 0.0, NEG_INF, 0.0
        else:
            self._partial(vm, st, b, g, G, t0, t1, part)
        if self.arg2 != NO_COUNTER:   # the ticket (a counter nothing waits on)
            vm.counters[rank][self.arg2] += 1
            if vm.counters[rank][self.arg2] % vm.num_splits:
                return
        heads = slice(g * G, (g + 1) * G)
        st.attn_out[b].view(-1, D)[heads] = merge_splits(st.attn_part[b:b + 1, heads], D).view(G, D)

    @staticmethod
    def tensor_cores(vm, G: int) -> bool:
        """Whether the CUDA op runs scores and P.V on tensor cores (attention.cuh attn_tc): a
        tensor-core step (bf16, batch >= MMA_MIN_BATCH), at most 16 heads per kv head (one m16
        tile), head_dim >= 16 (whole k16 steps)."""
        return vm.tensor_cores and G <= 16 and vm.head_dim >= 16

    def _partial(self, vm, st, b: int, g: int, G: int, t0: int, t1: int, part: torch.Tensor) -> None:
        D, ps = vm.head_dim, vm.page_size
        t = torch.arange(t0, t1)
        pages = vm.pages[b, t // ps].long()
        k = st.k_cache[self.layer, pages, g, t % ps].float()                   # [T, D]
        v = st.v_cache[self.layer, pages, g, t % ps].float()
        q = st.q[b].view(-1, D)[g * G:(g + 1) * G]                             # [G, D]
        tc = self.tensor_cores(vm, G)
        if tc:   # the tensor cores take q in bf16
            q = q.to(torch.bfloat16).float()
        s = (q @ k.T) * vm.attn_scale                                          # [G, T]
        m = s.max(dim=1).values
        p = torch.exp(s - m[:, None])
        # tensor cores: P.V takes the probabilities in bf16; l sums them in f32
        part[:, :D] = (p.to(torch.bfloat16).float() if tc else p) @ v
        part[:, D] = m
        part[:, D + 1] = p.sum(dim=1)
