"""Lazy per-rank loading of a Hugging Face safetensors checkpoint.

Rank r opens every file with safetensors `safe_open` and reads only its slices through
`get_slice` (memory-mapped: the bytes of other ranks' rows/columns are never copied),
straight into its preallocated RankWeights buffers on the target device.
"""
from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from tpmk.config import ModelConfig
from tpmk.partition.plan import ShardPlan, build_shard_plan
from tpmk.partition.weights import RankWeights

# safetensors dtype tags -> torch dtype names as config.json spells them
ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
              "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass
class LoadStats:
    """Bytes of tensor data one rank read, vs the size of the tensors it read from."""
    bytes_read: int = 0         # sum of the slices returned by get_slice
    bytes_total: int = 0        # sum of the full tensors those slices come from
    tensors: int = 0


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files: those the index names when there is one, else *.safetensors."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (d / n).exists()]
        if missing:
            raise FileNotFoundError(f"{index.name} names {missing[0]!r}, which is not in {d}")
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}; tpmk reads Hugging Face "
                                f"safetensors checkpoints (convert .bin/.pth first)")
    return files


def load_shard(model_dir: str | Path, cfg: ModelConfig | None = None, *, tp: int = 1,
               rank: int = 0, dtype: torch.dtype | None = None, device="cpu",
               progress: bool = True, stats: LoadStats | None = None) -> RankWeights:
    """Rank `rank` of `tp`'s RankWeights from a checkpoint directory.

    cfg: None reads model_dir/config.json (raises for a non-Llama config).
    dtype: of the result; None keeps the checkpoint's (config.json dtype).
    progress: a tqdm bar on rank 0 when stderr is a terminal.
    stats: filled with the bytes this rank read (see LoadStats).
    """
    from safetensors import safe_open
    from tqdm import tqdm
    cfg = cfg or ModelConfig.from_pretrained(model_dir)
    plan: ShardPlan = build_shard_plan(cfg, tp, rank)
    stats = stats if stats is not None else LoadStats()
    files = checkpoint_files(model_dir)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                   for f in files]
        where, shapes, dtypes = {}, {}, {}
        for h, f in zip(handles, files):
            for name in h.keys():
                if name in where:
                    raise ValueError(f"tensor {name!r} is in two files: "
                                     f"{where[name][1].name} and {f.name}")
                sl = h.get_slice(name)
                where[name] = (h, f)
                shapes[name] = tuple(sl.get_shape())
                dtypes[name] = ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())
        plan.check_tensors(shapes)
        for t in plan.tensors:
            if dtypes[t.name] != cfg.dtype:
                raise ValueError(f"tensor {t.name!r} has dtype {dtypes[t.name]}, expected "
                                 f"{cfg.dtype} (config.json dtype); fix the config or the file")
        w = plan.empty_weights(dtype or getattr(torch, cfg.dtype), device=device)
        bar = tqdm(plan.tensors, desc=f"loading rank {rank}/{tp}", unit="tensor",
                   disable=not (progress and rank == 0 and sys.stderr.isatty()))
        with torch.no_grad():
            for t in bar:
                piece = t.take(where[t.name][0].get_slice(t.name))
                plan.place(w, t, piece)
                size = piece.element_size()
                stats.bytes_read += piece.numel() * size
                stats.bytes_total += torch.Size(t.shape).numel() * size
                stats.tensors += 1
    return w


__all__ = ["LoadStats", "load_shard", "checkpoint_files"]
