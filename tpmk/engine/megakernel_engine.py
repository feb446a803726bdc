"""MegakernelEngine: decode by the CUDA megakernel, virtual TP on one GPU.

All tp shards live in this process and run in one cooperative launch (grid
split into tp rank groups). Prefill runs the reference engine (batched, on the
GPU) into the same paged KV caches [L, pages + 1, Hkv_local, page_size, D] the
decode steps read; prefill="stream" feeds prompts through the megakernel one
position at a time instead.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Decode, StepResult
from tpmk.engine.interpreter_engine import InterpreterEngine
from tpmk.kernels.megakernel import Megakernel
from tpmk.kernels.schedule import build_schedule


class MegakernelEngine(InterpreterEngine):
    name = "megakernel"

    def device(self, runtime: RuntimeConfig) -> str:
        if runtime.resolved_device() != "cuda":
            raise ValueError("engine='megakernel' needs a CUDA GPU; use engine='interpreter' on CPU")
        return "cuda"

    def build_vm(self):
        sms = torch.cuda.get_device_properties(0).multi_processor_count // self.runtime.tp
        schedule = build_schedule(self.cfg, self.runtime.tp, self.runtime.max_batch, sms,
                                  reduce=self.runtime.reduce)
        max_pages = -(-self.runtime.max_seq_len // self.runtime.page_size)
        return Megakernel(self.cfg, schedule, self.shards, self.k_caches, self.v_caches,
                          max_pages_per_seq=max_pages, profile=bool(self.runtime.profile))

    def decode(self, cmd: Decode) -> StepResult:
        result = super().decode(cmd)
        if self.runtime.profile:  # overwritten each step: the file holds the latest one
            Path(self.runtime.profile).write_text(json.dumps({"traceEvents": self.vm.profile_trace()}))
        return result
