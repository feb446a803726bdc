"""The worker: one process's share of the tensor-parallel ranks, whoever launched it.

A `WorkerSpec` is plain data (picklable, printable); the local, Ray and MPI
launchers each build one per process and differ only in where the process runs
and how `init_method` is agreed on. The worker then:

  1. joins the torch.distributed process group (gloo on CPU or when several
     ranks share one GPU; NCCL when each rank has its own GPU; never NVLS),
  2. loads the tp shards this process holds (tp // world_size of them: one for
     classic multi-process TP, all tp for virtual-TP engines),
  3. builds the engine, and executes commands (`Prefill`, `Decode`, `Shutdown`).

Every failure is re-raised as `WorkerError` naming the rank.
"""
from __future__ import annotations

import datetime
import importlib
import os
import traceback
from dataclasses import dataclass, field

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.api import Command, Decode, Prefill, Shutdown, StepResult, WorkerError

# Never NVLink multicast (cluster/README.md): set before NCCL or symmetric memory initialise.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}

ENGINES = {
    "reference": "tpmk.engine.reference:ReferenceEngine",
    "interpreter": "tpmk.engine.interpreter_engine:InterpreterEngine",
    "megakernel": "tpmk.engine.megakernel_engine:MegakernelEngine",
}


def engine_class(name: str) -> type:
    """A registered engine name, or "package.module:ClassName" for a custom engine."""
    spec = ENGINES.get(name, name)
    if ":" not in spec:
        raise ValueError(f"unknown engine {name!r}; use one of {', '.join(ENGINES)} "
                         f"(or 'package.module:ClassName' for a custom engine)")
    module, cls = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"engine {name!r}: cannot import {spec} ({e})") from e


def is_virtual_tp(name: str) -> bool:
    """True when the engine class declares `virtual_tp = True`: it holds all tp ranks in one
    process, so launchers start a single process (engine modules import CUDA lazily)."""
    return bool(getattr(engine_class(name), "virtual_tp", False))


def supports_per_process(name: str) -> bool:
    """True when a virtual-TP engine can also run one rank per process (`per_process = True`)."""
    return bool(getattr(engine_class(name), "per_process", False))


@dataclass
class WorkerSpec:
    model_dir: str                 # checkpoint directory (config.json, *.safetensors)
    runtime: RuntimeConfig
    rank: int = 0                  # process rank in [0, world_size)
    world_size: int = 1            # processes; each holds tp // world_size shards
    init_method: str | None = None  # torch.distributed rendezvous, e.g. tcp://10.0.0.1:29500
    device_index: int = 0          # CUDA device of this process (among the visible ones)
    shared_gpu: bool = False       # several processes on one GPU: NCCL refuses it, use gloo
    env: dict = field(default_factory=dict)  # extra environment set before anything starts

    @property
    def shard_ranks(self) -> list[int]:
        per = self.runtime.tp // self.world_size
        return list(range(self.rank * per, (self.rank + 1) * per))


# Start-up failures of these classes are bad input (a wrong flag or checkpoint): WorkerError.input_error
INPUT_ERRORS = (ValueError, FileNotFoundError)


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.rank = spec.rank
        try:
            self._start()
        except WorkerError:
            raise
        except Exception as e:
            raise WorkerError(spec.rank, f"start-up failed: {type(e).__name__}: {e}",
                              traceback.format_exc(), isinstance(e, INPUT_ERRORS)) from e

    def _start(self) -> None:
        spec, rt = self.spec, self.spec.runtime
        os.environ.update(spec.env)
        os.environ.update(NO_MULTICAST_ENV)  # last: nothing turns multicast back on
        if rt.tp % spec.world_size:
            raise ValueError(f"world_size={spec.world_size} processes cannot split tp={rt.tp} "
                             f"ranks evenly; launch tp or 1 processes")
        import torch
        import torch.distributed as dist

        device = rt.resolved_device()
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device=cuda but no CUDA device is visible; use --device cpu")
            torch.cuda.set_device(spec.device_index)
        self.group = None
        if spec.world_size > 1:
            backend = "nccl" if device == "cuda" and not spec.shared_gpu else "gloo"
            kw = {"device_id": torch.device("cuda", spec.device_index)} if backend == "nccl" else {}
            dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                                    world_size=spec.world_size,
                                    timeout=datetime.timedelta(minutes=10), **kw)
            self.group = dist.group.WORLD
        from tpmk.partition.loader import load_shard
        cfg = ModelConfig.from_pretrained(spec.model_dir)
        dtype = getattr(torch, rt.resolved_dtype())
        shards = [load_shard(spec.model_dir, cfg, tp=rt.tp, rank=r, device=device, dtype=dtype)
                  for r in spec.shard_ranks]
        self.cfg = cfg
        self.engine = engine_class(rt.engine)(cfg, rt, shards, group=self.group)

    def execute(self, cmd: Command) -> StepResult | None:
        try:
            if isinstance(cmd, Prefill):
                return self.engine.prefill(cmd)
            if isinstance(cmd, Decode):
                return self.engine.decode(cmd)
            if isinstance(cmd, Shutdown):
                self.close()
                return None
            raise TypeError(f"unknown command {type(cmd).__name__}; expected Prefill, Decode "
                            f"or Shutdown")
        except Exception as e:
            raise WorkerError(self.rank, f"{type(cmd).__name__} failed: {type(e).__name__}: {e}",
                              traceback.format_exc()) from e

    def close(self) -> None:
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()
        if getattr(self, "group", None) is not None:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            self.group = None


def error_record(e: BaseException, rank: int) -> dict:
    """What crosses a pipe or Ray when a rank fails: plain data, never a pickled exception."""
    if isinstance(e, WorkerError):
        return {"rank": e.rank, "message": e.message, "traceback": e.traceback_text,
                "input_error": e.input_error}
    return {"rank": rank, "message": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(), "input_error": False}


def raise_error_record(rec: dict) -> None:
    raise WorkerError(rec["rank"], rec["message"], rec["traceback"], rec["input_error"])
