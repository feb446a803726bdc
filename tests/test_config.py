"""tpmk.config.ModelConfig vs Hugging Face transformers' LlamaConfig / LlamaForCausalLM."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tpmk.config import MODEL_REGISTRY, ModelConfig, RopeScaling

LLAMA31_8B_V4 = {  # config.json as transformers 4 wrote it (meta-llama/Llama-3.1-8B)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def v5_keys(d: dict) -> dict:
    """The same config with transformers 5 keys: rope_parameters and dtype."""
    d = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    return {**d, "dtype": "bfloat16",
            "rope_parameters": {**LLAMA31_8B_V4["rope_scaling"], "rope_theta": 500000.0}}


def test_v4_and_v5_keys_agree():
    a = ModelConfig.from_hf_dict(LLAMA31_8B_V4)
    b = ModelConfig.from_hf_dict(v5_keys(LLAMA31_8B_V4))
    assert a == b
    assert a.rope_theta == 500000.0 and a.dtype == "bfloat16" and a.head_dim == 128
    assert a.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert dataclasses.replace(a, name="llama-3.1-8b") == MODEL_REGISTRY["llama-3.1-8b"]
    # both key sets present, the unused ones null (as some config.json files have them)
    both = {**v5_keys(LLAMA31_8B_V4), "rope_theta": None, "rope_scaling": None, "torch_dtype": None}
    assert ModelConfig.from_hf_dict(both) == a
    assert ModelConfig.from_hf_dict({**LLAMA31_8B_V4, "dtype": None}) == a


def test_legacy_rope_type_key_and_torch_dtype_prefix():
    d = dict(LLAMA31_8B_V4, torch_dtype="torch.float16",
             rope_scaling={**LLAMA31_8B_V4["rope_scaling"], "type": "llama3"})
    del d["rope_scaling"]["rope_type"]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.dtype == "float16" and cfg.rope_scaling.factor == 8.0


@pytest.mark.parametrize("name,expected", [("llama-3.2-1b", 1.236e9), ("llama-3.1-8b", 8.030e9),
                                           ("llama-3-70b", 70.554e9), ("llama-3.1-405b", 405.853e9)])
def test_registry_parameter_counts(name, expected):
    """Counted by transformers' own model on the meta device (no memory), and published sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = ModelConfig.from_name(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict()))
    assert cfg.num_parameters == sum(p.numel() for p in model.parameters())
    assert cfg.num_parameters == pytest.approx(expected, rel=1e-3)
    assert cfg.tie_word_embeddings == (name == "llama-3.2-1b")


@pytest.mark.parametrize("name", list(MODEL_REGISTRY))
def test_hf_round_trip(name, tmp_path):
    """ModelConfig -> HF LlamaConfig -> config.json -> ModelConfig is the identity."""
    from transformers import LlamaConfig
    cfg = ModelConfig.from_name(name)
    hf = LlamaConfig(**cfg.to_hf_dict())
    assert (hf.hidden_size, hf.num_key_value_heads, hf.head_dim, hf.tie_word_embeddings) == \
        (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings)
    assert ModelConfig.from_hf_dict(hf.to_dict(), name=name) == cfg
    hf.save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(tmp_path).replace(name=name) == cfg


def test_registry_tiny_sizes():
    gqa = ModelConfig.from_name("tiny-gqa")
    assert gqa.num_attention_heads // gqa.num_key_value_heads == 4
    assert gqa.rope_scaling is not None and gqa.tie_word_embeddings
    for name in ("tiny", "tiny-gqa"):
        assert ModelConfig.from_name(name).num_parameters < 2e6


def test_non_llama_config_raises():
    with pytest.raises(ValueError, match="model_type='mistral'.*only Llama"):
        ModelConfig.from_hf_dict({**LLAMA31_8B_V4, "model_type": "mistral",
                                  "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        ModelConfig.from_hf_dict({**LLAMA31_8B_V4, "rope_scaling": {"rope_type": "yarn"}})
    d = dict(LLAMA31_8B_V4)
    del d["hidden_size"]
    with pytest.raises(ValueError, match="missing required key 'hidden_size'"):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="unknown model name 'llama-9'"):
        ModelConfig.from_name("llama-9")


def test_missing_keys_take_transformers_defaults():
    """A config.json without rms_norm_eps / max_position_embeddings means what LlamaConfig's
    defaults say (a 1e-5 eps gave logits 3e-3 off HF's)."""
    from transformers import LlamaConfig
    d = {k: v for k, v in LLAMA31_8B_V4.items() if k not in ("rms_norm_eps", "max_position_embeddings")}
    cfg, hf = ModelConfig.from_hf_dict(d), LlamaConfig()
    assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.max_position_embeddings == hf.max_position_embeddings


@pytest.mark.parametrize("key,value", [("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True)])
def test_what_tpmk_does_not_compute_is_refused(key, value):
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        ModelConfig.from_hf_dict({**LLAMA31_8B_V4, key: value})
    ModelConfig.from_hf_dict({**LLAMA31_8B_V4, key: {"hidden_act": "silu"}.get(key, False)})


def test_partial_llama3_rope_scaling_names_the_missing_keys():
    with pytest.raises(ValueError, match="lacks low_freq_factor, high_freq_factor, "
                                         "original_max_position_embeddings"):
        ModelConfig.from_hf_dict({**LLAMA31_8B_V4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_a_config_without_dtype_takes_the_weights_dtype(tmp_path):
    """As transformers loads it: the tensors' dtype, not a bfloat16 guess the loader then
    refuses."""
    import json
    from tpmk.checkpoint import make_checkpoint
    from tpmk.partition.loader import load_shard
    make_checkpoint(ModelConfig.from_name("tiny-gqa"), tmp_path)   # float32 weights
    d = json.loads((tmp_path / "config.json").read_text())
    d.pop("dtype", None), d.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.dtype == "float32"
    assert load_shard(tmp_path, cfg, tp=2, rank=1).embed.dtype == torch.float32


@pytest.mark.parametrize("kw,needle", [(dict(max_batch=0), "max_batch=0 must be >= 1 (--max-batch)"),
                                       (dict(max_batch=-2), "max_batch=-2"),
                                       (dict(max_seq_len=0), "--max-seq-len"),
                                       (dict(num_pages=-1), "--num-pages")])
def test_runtime_sizes_are_validated(kw, needle):
    from tpmk.config import RuntimeConfig
    with pytest.raises(ValueError, match=re.escape(needle)):
        RuntimeConfig(**kw)
