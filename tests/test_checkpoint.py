"""tpmk.checkpoint: random checkpoints that Hugging Face transformers loads; the tokenizer
round-trips text; the cached default; the make-checkpoint subcommand."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tpmk.checkpoint import add_make_checkpoint_parser, default_model_dir, make_checkpoint
from tpmk.config import ModelConfig

TEXTS = ["Hello world!", "The capital of France is Paris.", "héllo wörld 世界 🙂\n\ttabs  and  spaces",
         "def f(x):\n    return x * 2\n", " leading space", ""]


@pytest.fixture(scope="module", params=["tiny", "tiny-gqa"])
def ckpt(request, tmp_path_factory):
    cfg = ModelConfig.from_name(request.param)
    out = tmp_path_factory.mktemp("ckpt") / request.param
    make_checkpoint(cfg, out, seed=0, num_shards=3)
    return cfg, out


def test_transformers_loads_it(ckpt):
    from transformers import LlamaForCausalLM
    cfg, out = ckpt
    model = LlamaForCausalLM.from_pretrained(out).eval()
    assert model.config.vocab_size == cfg.vocab_size
    assert model.config.num_key_value_heads == cfg.num_key_value_heads
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    on_disk = {}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) == 3
    for f in files:
        on_disk.update(load_file(out / f))
    assert set(index["weight_map"]) == set(on_disk)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                   for t in on_disk.values())
    params = dict(model.named_parameters())
    for name, t in on_disk.items():  # every tensor on disk is the one transformers loaded
        assert torch.equal(params[name].detach(), t), name
    assert len(on_disk) == len(params)
    q = on_disk["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == getattr(torch, cfg.dtype) and 0.018 < q.std() < 0.022
    norm = on_disk["model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.05  # ~1, but not trivially 1
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == cfg.vocab_size


def test_tokenizer_round_trips(ckpt):
    from transformers import AutoTokenizer
    cfg, out = ckpt
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) <= cfg.vocab_size and tok.bos_token_id == 1 and tok.eos_token_id == 2
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1 and max(ids) < cfg.vocab_size
        assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(tok.encode("the capital of France")) < len("the capital of France")  # BPE merges
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat.startswith("<s>") and "hi</s>" in chat and chat.endswith("assistant<|end_header_id|>\n\n")
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (1, 2)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_seed_and_shards(tmp_path):
    cfg = ModelConfig.from_name("tiny-gqa")
    make_checkpoint(cfg, tmp_path / "a", seed=1, num_shards=1)
    make_checkpoint(cfg, tmp_path / "b", seed=1, num_shards=4)
    make_checkpoint(cfg, tmp_path / "c", seed=2, num_shards=1)
    a = load_file(tmp_path / "a" / "model.safetensors")
    b = {}
    for f in sorted((tmp_path / "b").glob("*.safetensors")):
        b.update(load_file(f))
    c = load_file(tmp_path / "c" / "model.safetensors")
    assert not (tmp_path / "a" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "b").glob("*.safetensors"))) == 4
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_bf16_checkpoint(tmp_path):
    from transformers import LlamaForCausalLM
    cfg = ModelConfig.from_name("tiny").replace(dtype="bfloat16")
    make_checkpoint(cfg, tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert model.dtype == torch.bfloat16


def test_default_model_dir_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TPMK_CACHE", str(tmp_path))
    d = default_model_dir()
    assert d == tmp_path / "tiny" and (d / "config.json").exists()
    assert ModelConfig.from_pretrained(d).replace(name="tiny") == \
        ModelConfig.from_name("tiny").replace(bos_token_id=1, eos_token_id=2)
    stamp = (d / "config.json").stat().st_mtime_ns
    assert default_model_dir() == d and (d / "config.json").stat().st_mtime_ns == stamp
    (d / "tpmk_checkpoint.json").write_text("{}")  # an older format is rebuilt
    assert default_model_dir() == d and json.loads((d / "tpmk_checkpoint.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temp dirs left behind


def test_make_checkpoint_subcommand(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tpmk")
    add_make_checkpoint_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "m"
    args = parser.parse_args(["make-checkpoint", "--config", "tiny-gqa", "--num-shards", "2",
                              str(out)])
    assert args.func(args) == 0
    assert "tiny-gqa" in capsys.readouterr().out
    assert len(list(Path(out).glob("*.safetensors"))) == 2
    with pytest.raises(ValueError, match="already holds a checkpoint.*--overwrite"):
        args.func(args)
    with pytest.raises(ValueError, match="unknown model name 'nope'"):
        args = parser.parse_args(["make-checkpoint", "--config", "nope", str(tmp_path / "n")])
        args.func(args)


def test_overwrite_replaces_the_weights(tmp_path, capsys):
    """--overwrite with fewer shards: the old shards and index go, so the new weights (not
    the old index's) are what transformers and tpmk load."""
    parser = argparse.ArgumentParser(prog="tpmk")
    add_make_checkpoint_parser(parser.add_subparsers(dest="command"))
    out, fresh = tmp_path / "ow", tmp_path / "fresh"
    for argv in (["--seed", "0", str(out)], ["--seed", "1", "--num-shards", "1", "--overwrite", str(out)],
                 ["--seed", "1", "--num-shards", "1", str(fresh)]):
        args = parser.parse_args(["make-checkpoint", "--config", "tiny", *argv])
        assert args.func(args) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    from transformers import LlamaForCausalLM
    a = LlamaForCausalLM.from_pretrained(out).state_dict()
    b = LlamaForCausalLM.from_pretrained(fresh).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_too_small_a_vocab_writes_nothing(tmp_path):
    cfg = ModelConfig.from_name("tiny").replace(vocab_size=37)
    with pytest.raises(ValueError, match="vocab_size=37 is too small"):
        make_checkpoint(cfg, tmp_path / "small")
    assert not (tmp_path / "small").exists()
