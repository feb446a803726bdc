"""Model and runtime configuration.

`ModelConfig` mirrors the fields of a Hugging Face `LlamaConfig` (HF names for
every model dimension) and reads both the transformers 4 keys
(`rope_theta`, `rope_scaling`, `torch_dtype`) and the transformers 5 keys
(`rope_parameters`, `dtype`). `RuntimeConfig` holds what the user picks on
the command line; CLI flags map one-to-one onto its fields.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
# transformers' LlamaConfig defaults, for config.json files that leave the keys out
HF_DEFAULT_RMS_NORM_EPS = 1e-6
HF_DEFAULT_MAX_POSITIONS = 2048
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeScaling:
    """llama3 frequency-dependent RoPE scaling (Llama-3.1 and later)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")

    # ---- derived sizes -------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ---- constructors --------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        if name not in MODEL_REGISTRY:
            raise ValueError(f"unknown model name {name!r}; known: {', '.join(MODEL_REGISTRY)}")
        return MODEL_REGISTRY[name]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "custom") -> "ModelConfig":
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if model_type != "llama" and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"config has model_type={model_type!r}, architectures={archs}; "
                f"tpmk supports only Llama-family checkpoints ({', '.join(SUPPORTED_ARCHITECTURES)})")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json is missing required key {key!r}")
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = dict(d.get("rope_parameters") or {})
        legacy_scaling = d.get("rope_scaling") or {}
        rope_theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0  # keys may be null
        scaling_src = legacy_scaling or rope
        rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default"))
        if rope_type == "llama3":
            keys = [f.name for f in dataclasses.fields(RopeScaling)]
            missing = [k for k in keys if scaling_src.get(k) is None]
            if missing:
                raise ValueError(f"config.json's llama3 rope scaling lacks {', '.join(missing)} "
                                 f"(it needs {', '.join(keys)}); fix rope_scaling / rope_parameters")
            scaling = RopeScaling(
                factor=float(scaling_src["factor"]),
                low_freq_factor=float(scaling_src["low_freq_factor"]),
                high_freq_factor=float(scaling_src["high_freq_factor"]),
                original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]))
        elif rope_type in ("default", None):
            scaling = None
        else:
            raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default' and 'llama3')")
        # What tpmk does not compute: refused, not silently run as Llama's default.
        for key, ok in (("hidden_act", ("silu",)), ("attention_bias", (False,)), ("mlp_bias", (False,))):
            if d.get(key) is not None and d[key] not in ok:
                raise ValueError(f"config.json has {key}={d[key]!r}; tpmk implements only "
                                 f"{key}={ok[0]!r} (Llama's)")
        dtype = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
        return cls(
            name=name,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0,
            rms_norm_eps=d.get("rms_norm_eps") or HF_DEFAULT_RMS_NORM_EPS,
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings") or HF_DEFAULT_MAX_POSITIONS,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=str(dtype).replace("torch.", ""),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """A checkpoint directory (reads config.json) or a registry name."""
        p = Path(path)
        if not p.exists():
            if str(path) in MODEL_REGISTRY:
                return MODEL_REGISTRY[str(path)]
            raise FileNotFoundError(
                f"{path!s} is neither a checkpoint directory nor a known model name "
                f"({', '.join(MODEL_REGISTRY)})")
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.exists():
            raise FileNotFoundError(f"no config.json in {p}")
        d = json.loads(cfg_file.read_text())
        if not (d.get("dtype") or d.get("torch_dtype")) and p.is_dir():
            d["dtype"] = _tensor_dtype(p)   # as transformers does: the weights' own dtype
        return cls.from_hf_dict(d, name=p.name)

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers-5 style config.json contents for LlamaForCausalLM."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta,
                    **dataclasses.asdict(self.rope_scaling)}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


_LLAMA3_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)

MODEL_REGISTRY: dict[str, ModelConfig] = {
    "llama-3.2-1b": ModelConfig(
        name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": ModelConfig(
        name="llama-3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=128001),
    "llama-3-70b": ModelConfig(
        name="llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        rope_theta=500000.0, max_position_embeddings=8192,
        bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-405b": ModelConfig(
        name="llama-3.1-405b", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
        num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
        rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=128001),
    # Tiny test sizes: MHA (heads == kv heads) and GQA 4:1 with llama3 scaling.
    # vocab 512 matches the byte-level tokenizer that make-checkpoint writes.
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, hidden_size=128, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
        rope_theta=10000.0, max_position_embeddings=1024, dtype="float32",
        bos_token_id=1, eos_token_id=2),
    "tiny-gqa": ModelConfig(
        name="tiny-gqa", vocab_size=500, hidden_size=128, intermediate_size=256,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
        rope_theta=10000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
        max_position_embeddings=1024, tie_word_embeddings=True, dtype="float32",
        bos_token_id=1, eos_token_id=2),
}


def _tensor_dtype(model_dir: Path) -> str:
    """The dtype of the first-named tensor in a checkpoint's first file, read as the loader
    reads it (safe_open: the header only); bfloat16 when there is none to read (the loader
    then says what is missing)."""
    from safetensors import safe_open
    from tpmk.partition.loader import ST_DTYPES, checkpoint_files
    try:
        first = checkpoint_files(model_dir)[0]
    except FileNotFoundError:
        return "bfloat16"
    with safe_open(str(first), framework="pt", device="cpu") as h:
        names = list(h.keys())
        tag = h.get_slice(names[0]).get_dtype() if names else "BF16"
    return ST_DTYPES.get(tag, "bfloat16")


REDUCE_MODES = ("oneshot", "rsag")   # how o_proj / down partial sums meet (kernels/schedule.py)
REDUCE_CHOICES = ("auto", *REDUCE_MODES)   # auto: per batch bucket (schedule.choose_reduce)


@dataclass
class RuntimeConfig:
    """What the user chooses at run time (one CLI flag per field)."""

    tp: int = 1
    device: str = "auto"          # auto | cpu | cuda
    dtype: str = "auto"           # auto: float32 on cpu, bfloat16 on cuda
    engine: str = "reference"     # reference | interpreter | megakernel
    page_size: int = 16
    max_batch: int = 8
    max_seq_len: int = 1024
    num_pages: int = 0            # 0: enough for max_batch sequences of max_seq_len
    cuda_graphs: bool = True
    seed: int = 0
    profile: str = ""             # megakernel: Chrome-trace JSON of the latest decode step
    reduce: str = "auto"          # instruction-stream engines: auto | oneshot | rsag (kernels/schedule.py)
    # Instruction-stream engines: steps of more sequences decode through the reference engine
    # (torch; CUDA graphs on a GPU) on the same KV cache. 0: every step in the stream. 32: on an
    # H100 the megakernel step of the 70B tp=8 rank is 1.07-1.18x the CUDA-graph step at batch
    # 32 and 0.57-0.62x at batch 128 (README, Results).
    megakernel_max_batch: int = 32

    def __post_init__(self):
        if self.tp not in (1, 2, 4, 8):
            raise ValueError(f"tp={self.tp} is not supported; use 1, 2, 4 or 8")
        if self.reduce not in REDUCE_CHOICES:
            raise ValueError(f"reduce={self.reduce!r} is not supported; use one of {REDUCE_CHOICES}")
        for name in ("max_batch", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 "
                                 f"(--{name.replace('_', '-')})")
        if self.num_pages < 0:
            raise ValueError(f"num_pages={self.num_pages} must be >= 0 (--num-pages; 0: enough "
                             f"for max_batch sequences of max_seq_len)")
        if self.megakernel_max_batch < 0:
            raise ValueError(f"megakernel_max_batch={self.megakernel_max_batch} must be >= 0 "
                             f"(0: every step in the instruction stream)")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.num_pages == 0:
            self.num_pages = self.max_batch * math.ceil(self.max_seq_len / self.page_size)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"

    @property
    def stream_max_batch(self) -> int:
        """The most sequences an instruction-stream engine runs in one step of the stream
        (its largest bucket); larger steps go to the reference engine when
        megakernel_max_batch cut it below max_batch."""
        m = self.megakernel_max_batch
        return m if 0 < m < self.max_batch else self.max_batch


__all__ = ["ModelConfig", "RopeScaling", "RuntimeConfig", "MODEL_REGISTRY", "REDUCE_MODES", "REDUCE_CHOICES"]
