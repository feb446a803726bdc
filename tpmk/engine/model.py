"""The Llama math of one rank, as plain torch functions over a `RankWeights`.

Numerics follow Hugging Face LlamaForCausalLM: RMSNorm in float32 then cast
back before the weight multiply; RoPE tables in float32 cast to the model
dtype; attention scores scaled after the QK^T matmul, softmax in float32.
Row-parallel outputs (o_proj, down) and the vocab-parallel embedding are
*partial* sums: the engine adds the ranks' partials and all-reduces them.

Shapes: N tokens, B sequences, H hidden, D head_dim, Hq/Hkv local heads,
I local intermediate, Vl local (padded) vocab rows.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from tpmk.config import ModelConfig
from tpmk.engine.kv_cache import KVCache
from tpmk.partition.weights import RankWeights
from tpmk.rope import rope_inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(cfg: ModelConfig, max_positions: int, device, dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin: [max_positions, D] in `dtype` (rotate-half layout: the half table twice)."""
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def embed_partial(w: RankWeights, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [N] (global ids) -> [N, H]: this rank's rows, zeros for ids outside its slice."""
    vl = w.embed.shape[0]
    local = tokens - w.rank * vl
    mine = (local >= 0) & (local < vl)
    rows = w.embed[torch.where(mine, local, torch.zeros_like(local))]
    return rows * mine[:, None].to(rows.dtype)


def qkv_rope(w: RankWeights, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, H] (normed) -> q [N, Hq, D], k [N, Hkv, D] (both rotated), v [N, Hkv, D]."""
    D = head_dim
    hq = w.o_proj.shape[2] // D
    hkv = (w.qkv.shape[1] // D - hq) // 2
    qkv = h @ w.qkv[layer].T  # [N, (Hq + 2 Hkv) D]
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    q = apply_rope(q.view(-1, hq, D), cos, sin)
    k = apply_rope(k.view(-1, hkv, D), cos, sin)
    return q, k, v.reshape(-1, hkv, D)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seq_lens: list[int]) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch.

    q [N, Hq, D], k/v [N, Hkv, D] with N = sum(seq_lens) -> [N, Hq * D].
    """
    outs, start = [], 0
    for n in seq_lens:
        qs = q[start:start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
        ks = k[start:start + n].transpose(0, 1)[None]  # [1, Hkv, n, D]
        vs = v[start:start + n].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        outs.append(o[0].transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)


def paged_decode_attention(q: torch.Tensor, cache: KVCache, layer: int, page_table: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """One query token per sequence over its paged context.

    q [B, Hq, D]; page_table [B, P] int64; positions [B] (the query's own index, its KV already
    written) -> [B, Hq * D]. Keys at index > position are masked out.
    """
    B, hq, D = q.shape
    k, v = cache.gather(layer, page_table)  # [B, Hkv, S, D]
    hkv, S = k.shape[1], k.shape[2]
    qg = q.view(B, hkv, hq // hkv, D)  # query heads of one KV head are contiguous
    scores = (qg @ k.transpose(-1, -2)).float() * (D ** -0.5)  # [B, Hkv, G, S]
    keep = torch.arange(S, device=q.device)[None, :] <= positions[:, None]  # [B, S]
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return (probs @ v).reshape(B, hq * D)  # [B, Hkv, G, D] -> [B, Hq * D]


def mlp_partial(w: RankWeights, layer: int, h: torch.Tensor) -> torch.Tensor:
    """h [N, H] (normed) -> this rank's partial of down(silu(gate) * up): [N, H]."""
    gate, up = (h @ w.gate_up[layer].T).chunk(2, dim=-1)  # [N, I] each
    return (F.silu(gate) * up) @ w.down[layer].T


def lm_head_local(w: RankWeights, h: torch.Tensor) -> torch.Tensor:
    """h [N, H] (final-normed) -> this rank's logits slice [N, Vl] (padded rows included)."""
    return h @ w.lm_head.T


__all__ = ["apply_rope", "embed_partial", "lm_head_local", "mlp_partial", "paged_decode_attention",
           "prefill_attention", "qkv_rope", "rms_norm", "rope_inv_freq", "rope_tables"]
