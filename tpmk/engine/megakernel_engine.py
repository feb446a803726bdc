"""MegakernelEngine: decode by the CUDA megakernel.

Virtual TP (launched inline, the default): all tp shards live in this process and
run in one cooperative launch on one GPU (grid split into tp rank groups).
One rank per process (`--launcher local | ray | mpi`): this process holds its own
shard and GPU, and peers' buffers are mapped through CUDA IPC (Megakernel(group=)).
Prefill runs the reference engine (batched, on the GPU; over the process group in
per-process mode) into the same paged KV caches [L, pages + 1, Hkv_local, page_size,
D] the decode steps read; prefill="stream" feeds prompts through the megakernel one
position at a time instead.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Decode, StepResult
from tpmk.engine.interpreter_engine import InterpreterEngine
from tpmk.kernels.megakernel import Megakernel
from tpmk.kernels.schedule import build_schedule


class MegakernelEngine(InterpreterEngine):
    name = "megakernel"
    per_process = True   # also one rank per process when a launcher starts tp processes

    def check_ranks(self, runtime: RuntimeConfig, shards, group) -> None:
        if group is None:
            return super().check_ranks(runtime, shards, group)
        if len(shards) != 1 or dist.get_world_size(group) != runtime.tp:
            raise ValueError(f"the megakernel engine with a process group runs one rank per "
                             f"process: tp={runtime.tp} processes with one shard each (got "
                             f"{dist.get_world_size(group)} processes, {len(shards)} shards here)")

    def device(self, runtime: RuntimeConfig) -> str:
        if runtime.resolved_device() != "cuda":
            raise ValueError("engine='megakernel' needs a CUDA GPU; use engine='interpreter' on CPU")
        return "cuda"

    def build_vm(self, bucket: int):
        """One Megakernel per bucket (per-process mode: collective, every rank builds the same
        buckets in the same order); they share the weights, the KV caches and the compiled
        module's cubin, each with its own activations, counters and peer buffers."""
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if self.group is None:   # virtual TP: the ranks share this GPU's SMs
            sms //= self.runtime.tp
        schedule = build_schedule(self.cfg, self.runtime.tp, bucket, sms, reduce=self.runtime.reduce)
        max_pages = -(-self.runtime.max_seq_len // self.runtime.page_size)
        return Megakernel(self.cfg, schedule, self.shards, self.k_caches, self.v_caches,
                          max_pages_per_seq=max_pages, profile=bool(self.runtime.profile),
                          group=self.group)

    def decode(self, cmd: Decode) -> StepResult:
        result = super().decode(cmd)
        first = self.group is None or dist.get_rank(self.group) == 0
        if self.runtime.profile and first and "decoded_by" not in result.extra:
            # overwritten each step: the file holds the latest megakernel step
            Path(self.runtime.profile).write_text(json.dumps({"traceEvents": self.vm.profile_trace()}))
        return result

    def close(self) -> None:
        """Per-process mode: collective, every rank unmaps its peers' buffers together."""
        for vm in getattr(self, "vms", {}).values():
            vm.close()
