"""ReferenceEngine: plain PyTorch tensor parallelism, the baseline and the oracle.

One process holds one or more ranks' shards (`shards`, consecutive ranks).
Row-parallel partial sums (embedding, o_proj, down) are added over the local
shards in rank order, then all-reduced across processes on `group`
(torch.distributed: gloo on CPU or when ranks share a GPU, NCCL across GPUs),
or by the `all_reduce` callable when given (e.g. the in-kernel comm, or a
no-op for a single-rank benchmark). Prefill runs eagerly on a packed batch;
decode on CUDA replays one CUDA graph per batch-size bucket.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine import model as M
from tpmk.engine.api import Decode, Prefill, StepResult, batch_buckets, bucket_for
from tpmk.engine.kv_cache import HostPageTable, KVCache, check_pages, page_slots
from tpmk.engine.sampling import gather_ranks, sample_vocab_parallel
from tpmk.partition.weights import RankWeights


class ReferenceEngine:
    virtual_tp = False  # one process per rank by default; also accepts several shards

    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig, shards: list[RankWeights],
                 group=None, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 caches: list[KVCache] | None = None):
        """caches: the local ranks' KV caches to read and write (another engine's, which this
        one then serves prefill or large decode steps for); None: allocate them."""
        if not shards:
            raise ValueError("shards is empty; pass the RankWeights of the ranks this process holds")
        ranks = [s.rank for s in shards]
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"shards hold ranks {ranks}; they must be consecutive, in order")
        for s in shards:
            if s.tp != runtime.tp:
                raise ValueError(f"shard of rank {s.rank} was cut for tp={s.tp} but the runtime "
                                 f"has tp={runtime.tp}")
        world = dist.get_world_size(group) if group is not None else 1
        if all_reduce is None and len(shards) * world != runtime.tp:
            raise ValueError(f"{len(shards)} local shards x {world} processes != tp={runtime.tp}; "
                             f"pass every rank's shard, a process group, or an all_reduce")
        self.cfg, self.runtime, self.group = cfg, runtime, group
        self.shards = shards
        self.first_rank = ranks[0]
        self.device = shards[0].embed.device
        self.dtype = shards[0].embed.dtype
        self._all_reduce = all_reduce
        if caches is None:
            caches = [KVCache.allocate(cfg, runtime, self.device, self.dtype) for _ in shards]
        elif len(caches) != len(shards):
            raise ValueError(f"{len(caches)} KV caches for {len(shards)} local shards; give one per shard")
        self.caches = caches
        self.max_seq_len = runtime.max_seq_len
        self.cos, self.sin = M.rope_tables(cfg, self.max_seq_len, self.device, self.dtype)
        self.max_pages = math.ceil(self.max_seq_len / runtime.page_size)
        graph_safe = (group is None or all_reduce is not None
                      or dist.get_backend(group) == "nccl")
        self.use_graphs = runtime.cuda_graphs and self.device.type == "cuda" and graph_safe
        self.buckets = batch_buckets(runtime.max_batch)
        self._graphs: dict[int, tuple] = {}
        self._pool = None
        self._host_tables: dict[int, HostPageTable] = {}  # per graph bucket; 0: eager

    # ---- collectives ---------------------------------------------------
    def reduce(self, partials: list[torch.Tensor]) -> torch.Tensor:
        """Sum the local ranks' partials in rank order, then across processes."""
        total = partials[0]
        for p in partials[1:]:
            total = total + p
        if self._all_reduce is not None:
            return self._all_reduce(total)
        if self.group is not None:
            if total.is_cuda and dist.get_backend(self.group) == "gloo":
                host = total.cpu()
                dist.all_reduce(host, group=self.group)
                return host.to(total.device)
            dist.all_reduce(total, group=self.group)
        return total

    # ---- forward passes ------------------------------------------------
    def _layers(self, x: torch.Tensor, cos, sin, attend) -> torch.Tensor:
        """x [N, H] residual stream; attend(shard index, layer, q, k, v) -> [N, Hq * D]."""
        eps, D = self.cfg.rms_norm_eps, self.cfg.head_dim
        for layer in range(self.cfg.num_hidden_layers):
            parts = []
            for i, w in enumerate(self.shards):
                h = M.rms_norm(x, w.input_norm[layer], eps)
                q, k, v = M.qkv_rope(w, layer, h, cos, sin, D)
                parts.append(attend(i, layer, q, k, v) @ w.o_proj[layer].T)
            x = x + self.reduce(parts)
            parts = [M.mlp_partial(w, layer, M.rms_norm(x, w.post_norm[layer], eps))
                     for w in self.shards]
            x = x + self.reduce(parts)
        return x

    def _logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        return [M.lm_head_local(w, M.rms_norm(x, w.final_norm, eps)) for w in self.shards]

    def forward_decode(self, tokens: torch.Tensor, positions: torch.Tensor,
                       page_table: torch.Tensor) -> list[torch.Tensor]:
        """tokens, positions [B] int64; page_table [B, P] int64 -> local logits [B, Vl] per shard.
        Shape-static (CUDA-graph capturable): writes each token's KV, then attends 0..position."""
        P = self.runtime.page_size
        page_ids = page_table.gather(1, (positions // P)[:, None])[:, 0]
        slots = positions % P
        cos, sin = self.cos[positions], self.sin[positions]

        def attend(i, layer, q, k, v):
            cache = self.caches[i]
            cache.write(layer, k, v, page_ids, slots)
            return M.paged_decode_attention(q, cache, layer, page_table, positions)

        x = self.reduce([M.embed_partial(w, tokens) for w in self.shards])
        return self._logits(self._layers(x, cos, sin, attend))

    @torch.no_grad()
    def prefill(self, cmd: Prefill) -> StepResult:
        t0 = time.perf_counter()
        lens = [len(t) for t in cmd.tokens]
        self._check(cmd.pages, lens, cmd.sampling)
        if min(lens) == 0:
            raise ValueError(f"prompt {lens.index(0)} is empty; give at least one token")
        dev = self.device
        tokens = torch.tensor([t for seq in cmd.tokens for t in seq], device=dev)
        positions = torch.tensor([p for n in lens for p in range(n)], device=dev)
        page_ids, slots = page_slots(cmd.pages, [range(n) for n in lens], self.runtime.page_size)
        page_ids, slots = torch.tensor(page_ids, device=dev), torch.tensor(slots, device=dev)

        def attend(i, layer, q, k, v):
            self.caches[i].write(layer, k, v, page_ids, slots)
            return M.prefill_attention(q, k, v, lens)

        x = self.reduce([M.embed_partial(w, tokens) for w in self.shards])
        x = self._layers(x, self.cos[positions], self.sin[positions], attend)
        last = torch.tensor(lens, device=dev).cumsum(0) - 1
        logits = self._logits(x[last])
        return self._result(logits, [n - 1 for n in lens], cmd.sampling, cmd.return_logits, t0)

    @torch.no_grad()
    def decode(self, cmd: Decode) -> StepResult:
        t0 = time.perf_counter()
        B = len(cmd.tokens)
        if len(cmd.positions) != B:
            raise ValueError(f"Decode has {B} tokens but {len(cmd.positions)} positions")
        self._check(cmd.pages, [p + 1 for p in cmd.positions], cmd.sampling)
        if self.use_graphs and B <= self.buckets[-1]:
            logits = self._replay(cmd)
        else:
            n_pages = math.ceil((max(cmd.positions) + 1) / self.runtime.page_size)
            table = self._host_table(0, max(B, self.runtime.max_batch)).update(cmd.pages)
            table = table[:B, :n_pages].to(self.device)
            logits = self.forward_decode(torch.tensor(cmd.tokens, device=self.device),
                                         torch.tensor(cmd.positions, device=self.device), table)
        return self._result(logits, cmd.positions, cmd.sampling, cmd.return_logits, t0)

    # ---- CUDA graphs ---------------------------------------------------
    def _replay(self, cmd: Decode) -> list[torch.Tensor]:
        B = len(cmd.tokens)
        bucket = bucket_for(self.buckets, B)
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        graph, tokens, positions, table, out = self._graphs[bucket]
        table.copy_(self._host_table(bucket, bucket).update(cmd.pages))
        pad = bucket - B
        tokens.copy_(torch.tensor(cmd.tokens + [0] * pad))
        positions.copy_(torch.tensor(cmd.positions + [0] * pad))
        graph.replay()
        return [o[:B] for o in out]

    def _capture(self, bucket: int) -> tuple:
        dev = self.device
        tokens = torch.zeros(bucket, dtype=torch.long, device=dev)
        positions = torch.zeros(bucket, dtype=torch.long, device=dev)
        # every row on the scratch page while warming up and capturing: no live KV is touched
        table = torch.full((bucket, self.max_pages), self.caches[0].scratch_page,
                           dtype=torch.long, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward_decode(tokens, positions, table)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward_decode(tokens, positions, table)
        return graph, tokens, positions, table, out

    # ---- helpers -------------------------------------------------------
    def _host_table(self, key: int, rows: int) -> HostPageTable:
        if key not in self._host_tables or self._host_tables[key].rows < rows:
            self._host_tables[key] = HostPageTable(rows, self.max_pages,
                                                   self.caches[0].scratch_page)
        return self._host_tables[key]

    def _check(self, pages, n_tokens: list[int], sampling) -> None:
        if len(pages) != len(n_tokens) or len(sampling) != len(n_tokens):
            raise ValueError(f"{len(n_tokens)} sequences but {len(pages)} page lists and "
                             f"{len(sampling)} SamplingParams; give one of each per sequence")
        if max(n_tokens) > self.max_seq_len:
            raise ValueError(f"a sequence reaches {max(n_tokens)} tokens > max_seq_len="
                             f"{self.max_seq_len}; raise --max-seq-len")
        check_pages(pages, n_tokens, self.runtime.page_size, self.caches[0].num_pages)

    def _result(self, logits: list[torch.Tensor], positions: list[int], sampling,
                return_logits: bool, t0: float) -> StepResult:
        tokens = sample_vocab_parallel(logits, self.first_rank, self.cfg.vocab_size, positions,
                                       sampling, self.group)
        full = None
        if return_logits:  # [tp, B, Vl] -> [B, vocab]
            every = gather_ranks(torch.stack([lg.float() for lg in logits]), self.group)
            full = every.permute(1, 0, 2).reshape(len(positions), -1)[:, :self.cfg.vocab_size]
            full = full.cpu().tolist()
        return StepResult(tokens=tokens, logits=full, step_ms=(time.perf_counter() - t0) * 1e3)


__all__ = ["ReferenceEngine", "batch_buckets"]
