"""MegakernelEngine: decode by the CUDA megakernel, virtual TP on one GPU.

All tp shards live in this process and run in one cooperative launch (grid
split into tp rank groups). Prefill runs the reference engine (batched, on the
GPU) into the same paged KV caches [L, pages + 1, Hkv_local, page_size, D] the
decode steps read; prefill="stream" feeds prompts through the megakernel one
position at a time instead.
"""
from __future__ import annotations

import torch

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.interpreter_engine import InterpreterEngine
from tpmk.engine.kv_cache import KVCache
from tpmk.kernels.megakernel import Megakernel
from tpmk.kernels.schedule import build_schedule
from tpmk.partition.weights import RankWeights


class MegakernelEngine(InterpreterEngine):
    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig, shards: list[RankWeights],
                 group=None, prefill: str = "reference"):
        self._init_prefill(prefill)
        if group is not None or len(shards) != runtime.tp:
            raise ValueError(
                f"the megakernel engine runs virtual TP: all tp={runtime.tp} shards in one process "
                f"(got {len(shards)}) and group=None; multi-process megakernel TP is not wired yet")
        if runtime.resolved_device() != "cuda":
            raise ValueError("engine='megakernel' needs a CUDA GPU; use engine='interpreter' on CPU")
        dtype = getattr(torch, runtime.resolved_dtype())
        self.cfg, self.runtime = cfg, runtime
        self.shards = [s.to(device="cuda", dtype=dtype) for s in shards]
        # the shared paged layout (tpmk.engine.kv_cache), one KVCache per local rank
        self.caches = [KVCache.allocate(cfg, runtime, "cuda", dtype) for _ in shards]
        self.k_caches = [c.k for c in self.caches]
        self.v_caches = [c.v for c in self.caches]
        sms = torch.cuda.get_device_properties(0).multi_processor_count // runtime.tp
        self.schedule = build_schedule(cfg, runtime.tp, runtime.max_batch, sms)
        max_pages = -(-runtime.max_seq_len // runtime.page_size)
        self.vm = Megakernel(cfg, self.schedule, self.shards, self.k_caches, self.v_caches,
                             max_pages_per_seq=max_pages)
