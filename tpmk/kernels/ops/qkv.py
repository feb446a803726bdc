"""qkv: RMSNorm + QKV matvec + RoPE + paged KV append (CUDA: csrc/ops/qkv.cuh)."""
from __future__ import annotations

import torch

from tpmk.kernels.isa import Opcode
from tpmk.kernels.ops.base import Instruction


class Qkv(Instruction):
    """One head's rotary pairs [arg0, arg0 + nrows) of local head row0.

    Heads 0..Hq-1 are query heads, Hq..Hq+Hkv-1 key heads, then value heads
    (RankWeights.qkv row order). A tile holds both halves of each rotary pair
    (rows i and i + D/2, HF rotate_half convention) so RoPE stays inside it.
    """
    opcode = Opcode.QKV
    name = "qkv"

    def execute(self, vm, rank: int) -> None:
        st, B, D = vm.ranks[rank], vm.batch, vm.head_dim
        head, p0, n = self.row0, self.arg0, self.nrows
        half = D // 2
        idx = torch.cat([torch.arange(p0, p0 + n), torch.arange(half + p0, half + p0 + n)])
        out = vm.norm_matvec(st.x[:B], st.w.input_norm[self.layer],
                             st.w.qkv[self.layer, head * D + idx])               # [B, 2n]
        hq, hkv = vm.q_heads, vm.kv_heads
        if head < hq + hkv:                                                # q and k: rotate
            pos = torch.tensor(vm.positions[:B], dtype=torch.float32)
            ang = pos[:, None] * vm.inv_freq[p0:p0 + n][None, :]           # [B, n]
            cos, sin = torch.cos(ang), torch.sin(ang)
            x1, x2 = out[:, :n], out[:, n:]
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=1)
        if head < hq:
            st.q[:B, head * D + idx] = out
            return
        cache = st.k_cache if head < hq + hkv else st.v_cache
        g = head - hq if head < hq + hkv else head - hq - hkv
        for b in range(B):
            t = vm.positions[b]
            page = int(vm.pages[b, t // vm.page_size])
            cache[self.layer, page, g, t % vm.page_size, idx] = out[b].to(cache.dtype)
