"""Shared fixtures for the interpreter / megakernel tests: a random HF model and its shards.

`shard_hf` is a small independent sharder used until (and alongside)
tpmk.partition.plan.shard_state_dict; it follows the RankWeights docstring.
"""
from __future__ import annotations

import torch

from tpmk.config import ModelConfig
from tpmk.partition.weights import RankWeights, local_heads, padded_vocab


def hf_model(cfg: ModelConfig, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict())).float().eval()
    with torch.no_grad():  # random norms so a wrong norm weight cannot pass
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def shard_hf(sd: dict, cfg: ModelConfig, tp: int, rank: int, dtype=torch.float32) -> RankWeights:
    hq, hkv = local_heads(cfg, tp)
    D, L, kv = cfg.head_dim, cfg.num_hidden_layers, cfg.num_key_value_heads
    kv0 = rank * hkv if kv >= tp else rank * kv // tp
    inter = cfg.intermediate_size // tp
    vp = padded_vocab(cfg, tp) // tp

    def vocab_rows(w):
        full = torch.zeros(padded_vocab(cfg, tp), cfg.hidden_size)
        full[:cfg.vocab_size] = w
        return full[rank * vp:(rank + 1) * vp].to(dtype).contiguous()

    def lay(name):
        return [sd[f"model.layers.{i}.{name}"] for i in range(L)]

    qkv = torch.stack([torch.cat([q[rank * hq * D:(rank + 1) * hq * D], k[kv0 * D:(kv0 + hkv) * D],
                                  v[kv0 * D:(kv0 + hkv) * D]])
                       for q, k, v in zip(lay("self_attn.q_proj.weight"), lay("self_attn.k_proj.weight"),
                                          lay("self_attn.v_proj.weight"))])
    gu = torch.stack([torch.cat([g[rank * inter:(rank + 1) * inter], u[rank * inter:(rank + 1) * inter]])
                      for g, u in zip(lay("mlp.gate_proj.weight"), lay("mlp.up_proj.weight"))])
    embed = vocab_rows(sd["model.embed_tokens.weight"])
    lm = embed if cfg.tie_word_embeddings else vocab_rows(sd["lm_head.weight"])
    c = lambda t: t.to(dtype).contiguous()
    return RankWeights(
        rank=rank, tp=tp, embed=embed, lm_head=lm, final_norm=c(sd["model.norm.weight"]),
        input_norm=c(torch.stack(lay("input_layernorm.weight"))), qkv=c(qkv),
        o_proj=c(torch.stack([o[:, rank * hq * D:(rank + 1) * hq * D] for o in lay("self_attn.o_proj.weight")])),
        post_norm=c(torch.stack(lay("post_attention_layernorm.weight"))), gate_up=c(gu),
        down=c(torch.stack([d[:, rank * inter:(rank + 1) * inter] for d in lay("mlp.down_proj.weight")])))


def shards_for(cfg: ModelConfig, tp: int, seed: int = 0, dtype=torch.float32):
    model = hf_model(cfg, seed)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return model, [shard_hf(sd, cfg, tp, r, dtype) for r in range(tp)]


def empty_caches(cfg: ModelConfig, tp: int, num_pages: int, page_size: int, dtype=torch.float32):
    _, hkv = local_heads(cfg, tp)
    shape = (cfg.num_hidden_layers, num_pages, hkv, page_size, cfg.head_dim)
    return ([torch.zeros(shape, dtype=dtype) for _ in range(tp)],
            [torch.zeros(shape, dtype=dtype) for _ in range(tp)])


def random_shards(cfg: ModelConfig, tp: int, seed: int = 0, dtype=torch.bfloat16, device="cpu"):
    """Random RankWeights without building an HF model (large shapes, e.g. Llama-3.2-1B)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = local_heads(cfg, tp)
    D, H, L = cfg.head_dim, cfg.hidden_size, cfg.num_hidden_layers
    inter, vp = cfg.intermediate_size // tp, padded_vocab(cfg, tp) // tp
    out = []
    for r in range(tp):
        def rnd(*shape, scale=0.02):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

        def norm(*shape):
            return (torch.rand(*shape, generator=g) + 0.5).to(dtype).to(device)
        embed = rnd(vp, H, scale=1.0)
        out.append(RankWeights(
            rank=r, tp=tp, embed=embed, lm_head=embed if cfg.tie_word_embeddings else rnd(vp, H),
            final_norm=norm(H), input_norm=norm(L, H), qkv=rnd(L, (hq + 2 * hkv) * D, H),
            o_proj=rnd(L, H, hq * D), post_norm=norm(L, H), gate_up=rnd(L, 2 * inter, H),
            down=rnd(L, H, inter)))
    return out
