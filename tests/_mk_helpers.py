"""Shared fixtures for the interpreter / megakernel tests: a random HF model and its shards.

`shard_hf` is a small independent sharder used until (and alongside)
tpmk.partition.plan.shard_state_dict; it follows the RankWeights docstring.
"""
from __future__ import annotations

import dataclasses

import pytest
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


def stable_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle: the k largest logits of each row [B, vocab], equal values in increasing vocab
    id (a stable descending sort; torch.topk leaves the order of equal values unspecified)."""
    v, i = torch.sort(logits, dim=-1, descending=True, stable=True)
    return v[:, :k], i[:, :k]


def topk_near_ties(values: torch.Tensor, ids: torch.Tensor, ref_logits: torch.Tensor,
                   atol: float) -> list[str]:
    """Check a top-k (values, ids [B, k]) against the stable top-k of independent logits
    [B, vocab]: values within atol; ids equal except where the two ids' reference logits lie
    within atol of each other (a near-tie). Returns those near-tie cases, described."""
    want_v, want_i = stable_topk(ref_logits, values.shape[1])
    torch.testing.assert_close(values, want_v, atol=atol, rtol=0)
    notes = []
    for b, j in (ids != want_i).nonzero().tolist():
        got, want = int(ids[b, j]), int(want_i[b, j])
        gap = abs(float(ref_logits[b, got] - ref_logits[b, want]))
        assert gap <= atol, (f"row {b} place {j}: id {got} != {want}, whose reference logits "
                             f"differ by {gap:.3e} > {atol}")
        notes.append(f"row {b} place {j}: id {got} vs {want} (reference gap {gap:.1e})")
    return notes


# Crafted LM head for exact ties: row id = s * e_0, every other row zero, so logit(id) =
# s * xn[0] exactly (one nonzero product: no rounding, whatever the summation order) and
# equal s tie bit for bit. Groups span ranks and tiles for every tp <= 8 (vocab >= 500).
TIE_GROUPS = {3.0: [11, 200, 499], 2.0: [5, 260, 498], 1.0: [17, 70, 140, 333, 497],
              -3.0: [12, 201, 496], -2.0: [6, 261, 495], -1.0: [18, 71, 141, 334, 494]}


def tie_lm_head(cfg: ModelConfig) -> torch.Tensor:
    """[vocab, H] float32 head with TIE_GROUPS."""
    w = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    for s, ids in TIE_GROUPS.items():
        w[ids, 0] = s
    return w


def tie_topk_ids(x0: float, k: int) -> list[int]:
    """Expected top-k ids of the tie head given the sign of xn[0]: groups by |s| descending,
    then ids ascending inside a group (the boundary cuts the |s| = 1 group)."""
    groups = sorted((s for s in TIE_GROUPS if (s > 0) == (x0 > 0)), key=abs, reverse=True)
    return [i for s in groups for i in sorted(TIE_GROUPS[s])][:k]


def with_lm_head(shards: list[RankWeights], cfg: ModelConfig, w: torch.Tensor) -> list[RankWeights]:
    """Copies of shards whose lm_head is w [vocab, H] (vocab-sliced, pad rows zero)."""
    tp = len(shards)
    vp = padded_vocab(cfg, tp) // tp
    full = torch.zeros(padded_vocab(cfg, tp), cfg.hidden_size)
    full[:cfg.vocab_size] = w
    return [dataclasses.replace(s, lm_head=full[s.rank * vp:(s.rank + 1) * vp].to(s.lm_head.dtype)
                                .contiguous()) for s in shards]


def compile_or_skip(dtype: str, cache_dir, defines: tuple[str, ...] = ()) -> bytes:
    """The megakernel's sm_90a cubin of `dtype` ("bfloat16" | "float32") with kernel macros
    `defines`, compiled on this machine by NVRTC (no GPU needed) into cache_dir; skips where
    NVRTC is not installed."""
    from tpmk.kernels.megakernel import compile_megakernel
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPMK_CACHE", str(cache_dir))
        return nvrtc_or_skip(compile_megakernel, getattr(torch, dtype), defines=defines)


def nvrtc_or_skip(fn, *args, **kwargs):
    """fn(*args, **kwargs), an NVRTC compile; skips where NVRTC is not installed."""
    pytest.importorskip("cuda.bindings.nvrtc")
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - no libnvrtc on this machine
        if "libnvrtc" in str(e) or "DynamicLibNotFound" in type(e).__name__:
            pytest.skip(f"NVRTC library not installed: {e}")
        raise
