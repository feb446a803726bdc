"""Random Hugging Face-compatible Llama checkpoints (`tpmk make-checkpoint`), and the
embedded default tiny checkpoint that `--model tiny` (or no --model) uses.

A checkpoint directory holds what transformers' LlamaForCausalLM.from_pretrained and
AutoTokenizer.from_pretrained read: config.json, generation_config.json, several
safetensors shards + model.safetensors.index.json, tokenizer.json, tokenizer_config.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tpmk.config import ModelConfig

# Bump when the files make_checkpoint writes change, so cached defaults are rebuilt.
FORMAT_VERSION = 1
_MARKER = "tpmk_checkpoint.json"


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF LlamaForCausalLM tensor names -> shapes, in the order they are written."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (cfg.q_size, H),
            p + "self_attn.k_proj.weight": (cfg.kv_size, H),
            p + "self_attn.v_proj.weight": (cfg.kv_size, H),
            p + "self_attn.o_proj.weight": (H, cfg.q_size),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int, index: int) -> torch.Tensor:
    """float32 like a fresh HF init (std 0.02), norms ~1 with noise so a wrong norm shows.

    Seeded per tensor, so the values do not depend on the number of shards."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g)


def make_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int = 0,
                    num_shards: int = 3) -> Path:
    """Write a random checkpoint of `cfg` (weights in cfg.dtype) into `out_dir`.

    bos/eos become 1/2, the ids of the written tokenizer (registry shapes name Llama-3's)."""
    from safetensors.torch import save_file
    from tpmk.tokenizer import check_vocab_size, save_tokenizer
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    check_vocab_size(cfg.vocab_size)   # before any file is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # An earlier checkpoint's weights would be loaded beside (or, through its index, instead
    # of) the new ones: they go first.
    for old in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    cfg = cfg.replace(bos_token_id=1, eos_token_id=2)
    dtype = getattr(torch, cfg.dtype)
    shapes = tensor_shapes(cfg)
    numel = {n: torch.Size(s).numel() for n, s in shapes.items()}
    # Split the names, in order, into num_shards groups of about equal bytes.
    budget = sum(numel.values()) / num_shards
    groups: list[list[str]] = [[]]
    acc = 0
    for n in shapes:
        if acc >= budget * len(groups) and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(n)
        acc += numel[n]
    weight_map, total = {}, 0
    index = {n: i for i, n in enumerate(shapes)}
    for k, names in enumerate(groups):
        fname = (f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1
                 else "model.safetensors")
        tensors = {n: random_tensor(n, shapes[n], seed, index[n]).to(dtype) for n in names}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: fname for n in names})
        del tensors
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
         "do_sample": False}, indent=2) + "\n")
    save_tokenizer(out, cfg.vocab_size, cfg.max_position_embeddings)
    (out / _MARKER).write_text(json.dumps(
        {"format_version": FORMAT_VERSION, "config": cfg.name, "seed": seed}) + "\n")
    return out


def cache_dir() -> Path:
    root = os.environ.get("TPMK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tpmk")
    return Path(root)


def _is_current(d: Path, name: str) -> bool:
    try:
        m = json.loads((d / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return m.get("format_version") == FORMAT_VERSION and m.get("config") == name


def default_model_dir(name: str = "tiny") -> Path:
    """The embedded default checkpoint (random `tiny` weights, seed 0), made once and cached
    under $TPMK_CACHE or ~/.cache/tpmk/<name>. Safe when several processes race to make it:
    each writes a private temp dir and renames it into place."""
    target = cache_dir() / name
    if _is_current(target, name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        make_checkpoint(ModelConfig.from_name(name), tmp, seed=0)
        if target.exists() and not _is_current(target, name):
            shutil.rmtree(target, ignore_errors=True)  # an older format: rebuild
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current(target, name):  # lost the race to a broken dir, not a good one
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def add_make_checkpoint_parser(sub) -> argparse.ArgumentParser:
    from tpmk.config import MODEL_REGISTRY
    p = sub.add_parser(
        "make-checkpoint", help="write a random Hugging Face-compatible Llama checkpoint",
        description="Write a random Llama checkpoint (config.json, safetensors shards + index, "
                    "tokenizer) that transformers' LlamaForCausalLM.from_pretrained loads. "
                    "Weights are random: useful for tests and benchmarks, not for text.")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created)")
    p.add_argument("--config", default="tiny", metavar="NAME",
                   help=f"model shape: {', '.join(MODEL_REGISTRY)} (default %(default)s), "
                        "or a path to a config.json")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default %(default)s)")
    p.add_argument("--num-shards", type=int, default=3, metavar="N",
                   help="number of safetensors files (default %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight dtype (default: the config's)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into OUT_DIR even if it already holds a config.json")
    p.set_defaults(func=run_make_checkpoint)
    return p


def run_make_checkpoint(args: argparse.Namespace) -> int:
    cfg = (ModelConfig.from_pretrained(args.config) if args.config.endswith(".json")
           else ModelConfig.from_name(args.config))
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    out = Path(args.out_dir)
    if (out / "config.json").exists() and not args.overwrite:
        raise ValueError(f"{out} already holds a checkpoint (config.json); "
                              f"pass --overwrite or choose another OUT_DIR")
    size_gb = cfg.num_parameters * torch.tensor([], dtype=getattr(torch, cfg.dtype)).element_size() / 1e9
    make_checkpoint(cfg, out, seed=args.seed, num_shards=args.num_shards)
    print(f"tpmk: wrote random {cfg.name} checkpoint ({cfg.num_parameters / 1e6:.2f} M "
          f"parameters, {size_gb:.3f} GB {cfg.dtype}) to {out}")
    return 0
