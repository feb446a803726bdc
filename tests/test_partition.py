"""tpmk.partition: every sharded tensor reassembles to the original Hugging Face tensor;
the lazy loader reads ~1/tp of the big tensors per rank; bad checkpoints raise named errors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpmk.config import ModelConfig
from tpmk.partition import load_shard, local_heads, padded_vocab, shard_state_dict

TPS = [1, 2, 4, 8]


def hf_state_dict(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Names and shapes from transformers' own LlamaForCausalLM, values random (incl. norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = ModelConfig.from_name(name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict()))
    return {k: torch.randn_like(v) for k, v in model.state_dict().items()
            if not (cfg.tie_word_embeddings and k == "lm_head.weight")}


@pytest.fixture(scope="module", params=["tiny", "tiny-gqa"])
def model(request):
    return ModelConfig.from_name(request.param), hf_state_dict(request.param)


@pytest.mark.parametrize("tp", TPS)
def test_reassemble(model, tp):
    cfg, sd = model
    shards = [shard_state_dict(sd, cfg, tp, r) for r in range(tp)]
    hq, hkv = local_heads(cfg, tp)
    D, L, V, kv = cfg.head_dim, cfg.num_hidden_layers, cfg.vocab_size, cfg.num_key_value_heads
    inter = cfg.intermediate_size // tp
    for w in shards:
        assert w.rank in range(tp) and w.tp == tp
        assert w.qkv.shape == (L, (hq + 2 * hkv) * D, cfg.hidden_size)
        assert (w.lm_head is w.embed) == cfg.tie_word_embeddings
    for i in range(L):
        p = f"model.layers.{i}."
        q = torch.cat([w.qkv[i, :hq * D] for w in shards])
        k = [w.qkv[i, hq * D:(hq + hkv) * D] for w in shards]
        v = [w.qkv[i, (hq + hkv) * D:] for w in shards]
        torch.testing.assert_close(q, sd[p + "self_attn.q_proj.weight"], rtol=0, atol=0)
        for name, parts in (("k_proj", k), ("v_proj", v)):
            full = sd[p + f"self_attn.{name}.weight"].view(kv, D, -1)
            if tp <= kv:
                torch.testing.assert_close(torch.cat(parts), full.flatten(0, 1), rtol=0, atol=0)
            else:  # replicated: rank r holds KV head r * kv // tp (the head its q heads use)
                for r, part in enumerate(parts):
                    torch.testing.assert_close(part, full[r * kv // tp], rtol=0, atol=0)
                    assert (r * hq) // (cfg.num_attention_heads // kv) == r * kv // tp
        torch.testing.assert_close(torch.cat([w.o_proj[i] for w in shards], dim=1),
                                   sd[p + "self_attn.o_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([w.gate_up[i, :inter] for w in shards]),
                                   sd[p + "mlp.gate_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([w.gate_up[i, inter:] for w in shards]),
                                   sd[p + "mlp.up_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([w.down[i] for w in shards], dim=1),
                                   sd[p + "mlp.down_proj.weight"], rtol=0, atol=0)
        for w in shards:
            torch.testing.assert_close(w.input_norm[i], sd[p + "input_layernorm.weight"])
            torch.testing.assert_close(w.post_norm[i], sd[p + "post_attention_layernorm.weight"])
    heads = [("embed", "model.embed_tokens.weight")]
    if not cfg.tie_word_embeddings:
        heads.append(("lm_head", "lm_head.weight"))
    for field, name in heads:
        full = torch.cat([getattr(w, field) for w in shards])
        assert full.shape[0] == padded_vocab(cfg, tp)
        torch.testing.assert_close(full[:V], sd[name], rtol=0, atol=0)
        assert not full[V:].any(), "vocab padding rows must be zero"
    for w in shards:
        torch.testing.assert_close(w.final_norm, sd["model.norm.weight"])


def test_tp_must_divide(model):
    cfg, sd = model
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=8"):
        shard_state_dict(sd, cfg, 3, 0)
    odd = cfg.replace(intermediate_size=cfg.intermediate_size + 2)
    with pytest.raises(ValueError, match=f"tp=4 does not divide intermediate_size="
                                         f"{odd.intermediate_size}"):
        shard_state_dict(sd, odd, 4, 0)


# ---- the lazy loader ---------------------------------------------------------------------

@pytest.fixture(scope="module", params=["tiny", "tiny-gqa"])
def ckpt(request, tmp_path_factory):
    from tpmk.checkpoint import make_checkpoint
    out = tmp_path_factory.mktemp("ckpt") / request.param
    make_checkpoint(ModelConfig.from_name(request.param), out, seed=0, num_shards=3)
    return out


@pytest.mark.parametrize("tp", TPS)
def test_load_shard_matches_transformers(ckpt, tp):
    """Read by transformers (an independent reader), sharded in memory, equals the lazy load."""
    from transformers import LlamaForCausalLM
    sd = LlamaForCausalLM.from_pretrained(ckpt).state_dict()
    cfg = ModelConfig.from_pretrained(ckpt)
    for r in range(tp):
        got = load_shard(ckpt, tp=tp, rank=r, progress=False)
        want = shard_state_dict(sd, cfg, tp, r)
        for f in dataclasses.fields(got):
            a, b = getattr(got, f.name), getattr(want, f.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (tp, r, f.name)
        assert (got.lm_head is got.embed) == cfg.tie_word_embeddings
    half = load_shard(ckpt, cfg, tp=tp, rank=0, dtype=torch.bfloat16, progress=False)
    assert half.qkv.dtype == torch.bfloat16


class CountingSafeOpen:
    """Wraps safetensors.safe_open and counts the bytes every get_slice()[...] returns;
    it has no get_tensor, so a full read of a tensor would fail."""

    def __init__(self, counts):
        import safetensors
        self.real, self.counts = safetensors.safe_open, counts

    def __call__(self, *a, **kw):
        outer = self

        class Handle:
            def __enter__(self):
                self.h = outer.real(*a, **kw).__enter__()
                return self

            def __exit__(self, *exc):
                return self.h.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_slice(self, name):
                sl = self.h.get_slice(name)

                class Slice:
                    get_shape, get_dtype = sl.get_shape, sl.get_dtype

                    def __getitem__(self, idx):
                        t = sl[idx]
                        outer.counts[name] = outer.counts.get(name, 0) + t.numel() * t.element_size()
                        return t
                return Slice()
        return Handle()


def test_bytes_read_per_rank(tmp_path, monkeypatch):
    """Each rank reads 1/tp of every big tensor (tp <= num_key_value_heads, vocab divides)."""
    import safetensors
    from tpmk.checkpoint import make_checkpoint
    from tpmk.partition import LoadStats
    cfg = ModelConfig.from_name("tiny")
    make_checkpoint(cfg, tmp_path, num_shards=2)
    full = {}
    for f in tmp_path.glob("*.safetensors"):
        full.update({k: v.numel() * v.element_size() for k, v in load_file(f).items()})
    big = sum(v for k, v in full.items() if not k.endswith("norm.weight"))
    for tp in TPS:
        for r in range(tp):
            counts, stats = {}, LoadStats()
            monkeypatch.setattr(safetensors, "safe_open", CountingSafeOpen(counts))
            load_shard(tmp_path, tp=tp, rank=r, progress=False, stats=stats)
            monkeypatch.undo()
            read_big = sum(v for k, v in counts.items() if not k.endswith("norm.weight"))
            assert read_big == pytest.approx(big / tp, rel=0.02), (tp, r)
            assert stats.bytes_read == sum(counts.values())
            assert all(counts[k] == v for k, v in full.items() if k.endswith("norm.weight"))


def test_bytes_read_gqa_tp2(ckpt):
    """tiny-gqa (vocab 500 padded, tied embeddings) still reads ~1/2 per rank at tp=2."""
    from tpmk.partition import LoadStats
    stats = [LoadStats() for _ in range(2)]
    for r in range(2):
        load_shard(ckpt, tp=2, rank=r, progress=False, stats=stats[r])
    for s in stats:
        assert s.bytes_read == pytest.approx(s.bytes_total / 2, rel=0.03)


# ---- errors that name the tensor or value ------------------------------------------------

@pytest.fixture
def one_file(tmp_path):
    from tpmk.checkpoint import make_checkpoint
    make_checkpoint(ModelConfig.from_name("tiny"), tmp_path, num_shards=1)
    return tmp_path


def rewrite(ckpt_dir, fn):
    f = ckpt_dir / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f, metadata={"format": "pt"})


def test_tp_errors(one_file, tmp_path_factory):
    from tpmk.checkpoint import make_checkpoint
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=8"):
        load_shard(one_file, tp=3, rank=0)
    odd = tmp_path_factory.mktemp("odd")
    make_checkpoint(ModelConfig.from_name("tiny").replace(intermediate_size=386), odd)
    with pytest.raises(ValueError, match="tp=4 does not divide intermediate_size=386"):
        load_shard(odd, tp=4, rank=0)
    with pytest.raises(ValueError, match="rank=2 is out of range for tp=2"):
        load_shard(one_file, tp=2, rank=2)


@pytest.mark.parametrize("case,mutate,message", [
    ("missing", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("extra", lambda sd: sd.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
     "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"),
    ("shape", lambda sd: sd.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(64, 128)}),
     r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape \(64, 128\), expected \(128, 128\)"),
    ("dtype", lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"].half()}),
     "tensor 'model.norm.weight' has dtype float16, expected float32"),
])
def test_bad_checkpoint(one_file, case, mutate, message):
    rewrite(one_file, mutate)
    with pytest.raises(ValueError, match=message):
        load_shard(one_file, tp=2, rank=1, progress=False)


def test_bad_config_and_files(one_file):
    cfg_file = one_file / "config.json"
    d = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**d, "model_type": "mistral",
                                    "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="model_type='mistral'.*only Llama"):
        load_shard(one_file, tp=1, rank=0)
    cfg_file.write_text(json.dumps(d))
    (one_file / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        load_shard(one_file, tp=1, rank=0)


def test_rotary_inv_freq_buffers_are_ignored(one_file):
    """Older checkpoints carry each layer's rotary_emb.inv_freq: loaded past, not refused."""
    before = load_shard(one_file, tp=2, rank=1, progress=False)
    rewrite(one_file, lambda sd: sd.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    after = load_shard(one_file, tp=2, rank=1, progress=False)
    assert torch.equal(before.qkv, after.qkv) and torch.equal(before.embed, after.embed)
