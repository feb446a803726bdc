"""Per-rank weight buffers: the layout every engine consumes.

The reference engine, the CPU interpreter and the CUDA megakernel all read
one `RankWeights`. Layers are stacked so a kernel indexes `w.qkv[layer]`.
Shapes below use: H = hidden_size, D = head_dim, L = num_hidden_layers,
Hq = num_attention_heads // tp (local query heads),
Hkv = max(1, num_key_value_heads // tp) (local KV heads; when
tp > num_key_value_heads, rank r holds KV head r * num_key_value_heads // tp),
I = intermediate_size // tp, Vp = padded_vocab // tp.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from tpmk.config import ModelConfig


def local_heads(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) held by one rank."""
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={cfg.num_attention_heads}")
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tp={tp} and num_key_value_heads={kv}: one must divide the other")
    return cfg.num_attention_heads // tp, max(1, kv // tp)


def padded_vocab(cfg: ModelConfig, tp: int, multiple: int = 8) -> int:
    """Vocab padded so each rank's slice is equal and a multiple of `multiple` rows."""
    step = tp * multiple
    return (cfg.vocab_size + step - 1) // step * step


@dataclass
class RankWeights:
    rank: int
    tp: int
    embed: torch.Tensor       # [Vp, H]   rows rank*Vp .. (rank+1)*Vp of the padded vocab (pad rows zero)
    lm_head: torch.Tensor     # [Vp, H]   same slicing; the same tensor as embed when tied
    final_norm: torch.Tensor  # [H]
    input_norm: torch.Tensor  # [L, H]
    qkv: torch.Tensor         # [L, (Hq + 2*Hkv) * D, H]  rows: q heads, then k heads, then v heads
    o_proj: torch.Tensor      # [L, H, Hq * D]            row-parallel: output is a partial sum
    post_norm: torch.Tensor   # [L, H]
    gate_up: torch.Tensor     # [L, 2 * I, H]             rows: gate (I), then up (I)
    down: torch.Tensor        # [L, H, I]                 row-parallel: output is a partial sum

    def to(self, device=None, dtype=None) -> "RankWeights":
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) else v
        if self.embed is self.lm_head:
            moved["lm_head"] = moved["embed"]
        return RankWeights(**moved)

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                total += v.numel() * v.element_size()
        return total
