"""InterpreterEngine: decode by the CPU interpreter running the real instruction stream.

Virtual TP: all tp shards live in this process (the interpreter writes peer
slots directly), so `shards` must hold every rank and `group` must be None.
Prefill (`prefill="reference"`, the default) runs the reference engine's
batched prefill into the SAME paged KV caches (tpmk.engine.kv_cache.KVCache);
`prefill="stream"` instead feeds the prompt through the instruction stream one
position at a time (all sequences in lockstep), which needs nothing but the
stream itself.

Buckets: one schedule (and VM) per batch size of batch_buckets(runtime.stream_max_batch),
all on the same KV caches and weights; a step of n sequences runs the smallest bucket >= n,
whose schedule was built for n (attention splits, tile shapes, reduce mode). A single
sequence then runs bucket 1's schedule, not max_batch's. A decode step of more than
runtime.megakernel_max_batch sequences (when that is below max_batch), or than the largest
bucket whose schedule fits an SM's shared memory (build_vms), runs the reference engine's
decode on the same KV caches instead (CUDA graphs on a GPU): where cuBLAS beats the
megakernel's tensor-core path, or where the megakernel cannot run.

Sampling: greedy rows take the stream's argmax; sampled rows with
1 <= top_k <= TOPK sample from the stream's top-TOPK candidates; only the other
sampled rows (and return_logits) copy the full logits to the host.
"""
from __future__ import annotations

import sys
import time

import torch

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.kv_cache import KVCache
from tpmk.engine.api import Decode, Prefill, SamplingParams, StepResult, batch_buckets, bucket_for
from tpmk.kernels.interpreter import VM
from tpmk.kernels.megakernel import SharedMemoryError
from tpmk.kernels.isa import TOPK
from tpmk.kernels.schedule import build_schedule
from tpmk.partition.weights import RankWeights

INTERPRETER_SMS = 8  # queues per rank; any value gives the same result


def uses_candidates(s: SamplingParams) -> bool:
    """A sampled row whose top_k the stream's top-TOPK candidates cover."""
    return not s.greedy and 1 <= s.top_k <= TOPK


def needs_logits(sampling: list[SamplingParams]) -> bool:
    """Some sampled row needs the full logits (top_k unset or > TOPK)."""
    return any(not s.greedy and not uses_candidates(s) for s in sampling)


def sample_tokens(logits: torch.Tensor | None, topk: tuple[torch.Tensor, torch.Tensor] | None,
                  vocab_size: int, positions: list[int], sampling: list[SamplingParams],
                  greedy_tokens: torch.Tensor) -> list[int]:
    """Greedy rows keep the stream's argmax; sampled rows use tpmk.engine.sampling.sample on
    logits [B, vocab] (None when no row needs them), except `uses_candidates` rows, whose
    row is -inf but at the stream's candidates topk = (values, ids) [B, TOPK]. The sampler
    keeps the top_k by (logit desc, id asc), the candidates' order, and draws the noise per
    (seed, position, id): the same token as from the full logits row, ties included."""
    out = [int(t) for t in greedy_tokens]
    if all(s.greedy for s in sampling):
        return out
    from tpmk.engine.sampling import sample  # the reference engine's sampler (same noise)
    rows = [b for b, s in enumerate(sampling) if uses_candidates(s)]
    if logits is None:
        logits = torch.full((len(sampling), vocab_size), float("-inf"))
    elif rows:
        logits = logits.clone()
    if rows:
        values, ids = topk
        idx = torch.tensor(rows)
        logits[idx] = float("-inf")
        logits[idx[:, None], ids[idx]] = values[idx]
    sampled = sample(logits, positions, sampling)
    return [out[b] if s.greedy else int(sampled[b]) for b, s in enumerate(sampling)]


class InterpreterEngine:
    virtual_tp = True  # all tp ranks in this process (the launcher starts one process)
    name = "interpreter"

    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig, shards: list[RankWeights],
                 group=None, prefill: str = "reference"):
        if prefill not in ("reference", "stream"):
            raise ValueError(f"prefill={prefill!r}; use 'reference' or 'stream'")
        self.prefill_mode, self._reference, self.group = prefill, None, group
        self.check_ranks(runtime, shards, group)
        device = self.device(runtime)
        dtype = getattr(torch, runtime.resolved_dtype())
        self.cfg, self.runtime = cfg, runtime
        self.shards = [s.to(device=device, dtype=dtype) for s in shards]
        # the shared paged layout (tpmk.engine.kv_cache), one KVCache per local rank
        self.caches = [KVCache.allocate(cfg, runtime, device, dtype) for _ in shards]
        self.k_caches = [c.k for c in self.caches]
        self.v_caches = [c.v for c in self.caches]
        self.vms = self.build_vms(batch_buckets(runtime.stream_max_batch))
        self.buckets = list(self.vms)
        self.vm = self.vms[self.buckets[-1]]   # the latest step's (logits, top-k, profile)

    def check_ranks(self, runtime: RuntimeConfig, shards: list[RankWeights], group) -> None:
        if group is not None or len(shards) != runtime.tp:
            raise ValueError(
                f"the {self.name} engine runs virtual TP: all tp={runtime.tp} ranks in one "
                f"process; pass all {runtime.tp} shards (got {len(shards)}) and group=None")

    def device(self, runtime: RuntimeConfig) -> str:
        return "cpu"

    def build_vms(self, buckets: list[int]) -> dict:
        """A VM per bucket, smallest first. A bucket whose schedule needs more shared memory
        than an SM has (the megakernel at large buckets of wide models: Llama-3.1-8B at tp 1
        from bucket 4) ends the list there, with a note: larger steps then decode through
        the reference engine, as above megakernel_max_batch. Bucket 1 must fit."""
        vms = {}
        for b in buckets:
            try:
                vms[b] = self.build_vm(b)
            except SharedMemoryError as e:
                if not vms:
                    raise
                print(f"tpmk: {self.name}: {e}; steps of more than {max(vms)} sequences decode "
                      f"through the reference engine", file=sys.stderr, flush=True)
                break
        return vms

    def build_vm(self, bucket: int):
        schedule = build_schedule(self.cfg, self.runtime.tp, bucket, INTERPRETER_SMS,
                                  reduce=self.runtime.reduce)
        return VM(self.cfg, schedule, self.shards, self.k_caches, self.v_caches)

    def _reference_engine(self):
        """The reference engine on this engine's weights and KV caches (same layout): the
        prefill, and decode steps of more than megakernel_max_batch sequences."""
        if self._reference is None:
            from tpmk.engine.reference import ReferenceEngine
            self._reference = ReferenceEngine(self.cfg, self.runtime, self.shards, group=self.group,
                                              caches=self.caches)
        return self._reference

    def _chunks(self, n: int):
        B = self.buckets[-1]
        return [list(range(i, min(n, i + B))) for i in range(0, n, B)]

    def _step(self, tokens: list[int], positions: list[int], pages: list[list[int]]) -> torch.Tensor:
        """One step of len(tokens) <= max_batch sequences on the smallest bucket that holds
        them; self.vm is then that bucket's (its logits and top-k are this step's)."""
        self.vm = self.vms[bucket_for(self.buckets, len(tokens))]
        return self.vm.step(tokens, positions, pages)

    def prefill(self, cmd: Prefill) -> StepResult:
        if self.prefill_mode == "reference":
            return self._reference_engine().prefill(cmd)
        t0 = time.perf_counter()
        n = len(cmd.tokens)
        want_logits = cmd.return_logits or needs_logits(cmd.sampling)
        last_logits = torch.zeros(n, self.cfg.vocab_size) if want_logits else None
        greedy = torch.zeros(n, dtype=torch.int64)
        values, ids = torch.zeros(n, TOPK), torch.zeros(n, TOPK, dtype=torch.int64)
        for chunk in self._chunks(n):
            longest = max(len(cmd.tokens[b]) for b in chunk)
            for pos in range(longest):
                live = [b for b in chunk if pos < len(cmd.tokens[b])]
                toks = self._step([cmd.tokens[b][pos] for b in live], [pos] * len(live),
                                  [cmd.pages[b] for b in live]).cpu()
                ends = [i for i, b in enumerate(live) if pos == len(cmd.tokens[b]) - 1]
                if not ends:
                    continue
                at = torch.tensor([live[i] for i in ends])
                greedy[at] = toks[ends].long()
                v, k = self.vm.topk()
                values[at], ids[at] = v.cpu()[ends], k.cpu()[ends]
                if want_logits:
                    last_logits[at] = self.vm.logits().cpu()[ends]
        positions = [len(t) - 1 for t in cmd.tokens]
        tokens = sample_tokens(last_logits, (values, ids), self.cfg.vocab_size, positions,
                               cmd.sampling, greedy)
        return StepResult(tokens=tokens, logits=last_logits.tolist() if cmd.return_logits else None,
                          step_ms=(time.perf_counter() - t0) * 1e3)

    def decode(self, cmd: Decode) -> StepResult:
        if len(cmd.tokens) > self.buckets[-1] and self.buckets[-1] < self.runtime.max_batch:
            result = self._reference_engine().decode(cmd)   # above the stream's largest bucket
            result.extra["decoded_by"] = "reference"
            return result
        t0 = time.perf_counter()
        want_logits = cmd.return_logits or needs_logits(cmd.sampling)
        want_topk = any(uses_candidates(s) for s in cmd.sampling)
        toks, logits, values, ids = [], [], [], []
        for chunk in self._chunks(len(cmd.tokens)):
            toks.append(self._step([cmd.tokens[b] for b in chunk], [cmd.positions[b] for b in chunk],
                                   [cmd.pages[b] for b in chunk]).cpu().long())
            if want_logits:  # [batch, vocab]: the one large device-to-host copy of a step
                logits.append(self.vm.logits().cpu())
            if want_topk:
                v, k = self.vm.topk()
                values.append(v.cpu())
                ids.append(k.cpu())
        logits = torch.cat(logits) if want_logits else None
        topk = (torch.cat(values), torch.cat(ids)) if want_topk else None
        tokens = sample_tokens(logits, topk, self.cfg.vocab_size, cmd.positions, cmd.sampling,
                               torch.cat(toks))
        return StepResult(tokens=tokens, logits=logits.tolist() if cmd.return_logits else None,
                          step_ms=(time.perf_counter() - t0) * 1e3)
