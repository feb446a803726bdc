"""CPU interpreter: executes a Schedule's instruction stream with torch, all ranks in one process.

It is the executable specification of the megakernel. Peer writes are plain
writes into another rank's buffers. Three orders:
  - "queue": what the GPU does; per-SM queues in order, SMs interleaved at
    random, an instruction runs once its counters are reached (a stuck state
    is reported as a deadlock);
  - "adversarial": ignores the queues; any instruction of any rank whose
    declared dependencies are met may run next, picked by random priority.
    A missing dependency then changes the result (buffers are poisoned with
    NaN before every step, so a premature read cannot pass by luck);
  - "program": the stream in stage order (deterministic, fastest).
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import torch

from tpmk.config import ModelConfig
from tpmk.kernels.isa import MMA_MIN_BATCH, NEG_INF, TOPK, cand_shape, check_vocab
from tpmk.kernels.ops import Instruction
from tpmk.kernels.schedule import Schedule
from tpmk.partition.weights import RankWeights, local_heads, padded_vocab
from tpmk.rope import rope_inv_freq


@dataclass
class RankState:
    w: RankWeights
    k_cache: torch.Tensor          # [L, pages, Hkv, page_size, D] model dtype (shared with the engine)
    v_cache: torch.Tensor
    x: torch.Tensor                # [bucket, H] f32
    q: torch.Tensor                # [bucket, Hq * D]
    attn_part: torch.Tensor        # [bucket, Hq, splits, D + 2]
    attn_out: torch.Tensor         # [bucket, Hq * D] merged by each group's last split
    act: torch.Tensor              # [bucket, I]
    gu_part: torch.Tensor          # [gu_splits, bucket, 2 I] gate_up's K-slice partials (empty unsplit)
    logits: torch.Tensor           # [bucket, Vp]
    tokens_out: torch.Tensor       # [bucket] int64
    topk_values: torch.Tensor      # [bucket, TOPK] f32, value desc then id asc
    topk_ids: torch.Tensor         # [bucket, TOPK] int64
    attn_slots: torch.Tensor       # [tp, bucket, H] written by peers
    mlp_slots: torch.Tensor
    cand: torch.Tensor             # isa.cand_shape: [tp, n_lm_tiles, bucket, TOPK, 2]

    def slots(self, stage: int) -> torch.Tensor:
        return self.attn_slots if stage % 2 else self.mlp_slots

    def poison(self) -> None:
        for t in (self.x, self.q, self.attn_part, self.attn_out, self.act, self.gu_part, self.logits,
                  self.topk_values, self.attn_slots, self.mlp_slots, self.cand):
            t.fill_(float("nan"))
        self.tokens_out.fill_(-1)
        self.topk_ids.fill_(-1)


class VM:
    """All ranks' state plus the current step header; ops read their sizes from here."""

    def __init__(self, cfg: ModelConfig, sched: Schedule, shards: list[RankWeights],
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        if len(shards) != sched.tp:
            raise ValueError(f"{len(shards)} shards for a tp={sched.tp} schedule; "
                             "the interpreter runs all ranks in one process")
        check_vocab(cfg.vocab_size)
        self.cfg, self.sched, self.tp = cfg, sched, sched.tp
        self.q_heads, self.kv_heads = local_heads(cfg, sched.tp)
        self.head_dim, self.num_splits = cfg.head_dim, sched.num_splits
        self.inter = cfg.intermediate_size // sched.tp
        self.vocab_size = cfg.vocab_size
        self.attn_scale = cfg.head_dim ** -0.5
        self.page_size, self.num_pages = k_caches[0].shape[3], k_caches[0].shape[1]
        self.inv_freq = rope_inv_freq(cfg)
        B, H, D = sched.bucket, cfg.hidden_size, cfg.head_dim
        vp = padded_vocab(cfg, sched.tp) // sched.tp
        f32 = dict(dtype=torch.float32)
        self.ranks = [RankState(
            w=w, k_cache=k, v_cache=v, x=torch.zeros(B, H, **f32),
            q=torch.zeros(B, self.q_heads * D, **f32),
            attn_part=torch.zeros(B, self.q_heads, sched.num_splits, D + 2, **f32),
            attn_out=torch.zeros(B, self.q_heads * D, **f32),
            act=torch.zeros(B, self.inter, **f32),
            gu_part=torch.zeros(sched.gu_splits if sched.gu_splits > 1 else 0, B, 2 * self.inter, **f32),
            logits=torch.zeros(B, vp, **f32),
            tokens_out=torch.zeros(B, dtype=torch.int64),
            topk_values=torch.zeros(B, TOPK, **f32), topk_ids=torch.zeros(B, TOPK, dtype=torch.int64),
            attn_slots=torch.zeros(self.tp, B, H, **f32), mlp_slots=torch.zeros(self.tp, B, H, **f32),
            cand=torch.zeros(cand_shape(self.tp, sched.n_lm_tiles, B), **f32))
            for w, k, v in zip(shards, k_caches, v_caches)]
        self.epoch = 0
        self.counters = [[0] * sched.num_counters for _ in range(self.tp)]

    # ---- helpers the ops use ------------------------------------------
    @property
    def tensor_cores(self) -> bool:
        """Whether this step's matvecs take bf16 inputs, as the megakernel's tensor-core path
        does (bf16 weights, batch >= MMA_MIN_BATCH); otherwise f32 inputs (CUDA cores)."""
        return self.batch >= MMA_MIN_BATCH and self.ranks[0].w.qkv.dtype == torch.bfloat16

    def matvec(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [B, K] f32 @ weight rows w [n, K] -> [B, n] f32."""
        if self.tensor_cores:
            x = x.to(torch.bfloat16).float()
        return x @ w.float().T

    def norm_matvec(self, x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor,
                    k: slice = slice(None)) -> torch.Tensor:
        """RMSNorm(x) (weight norm_w) @ weight rows w, over the columns k only (a K slice; the
        norm is the whole row's). The tensor-core path rounds x * norm_w to bf16 (its producer,
        the residual, writes it so) and applies 1 / rms(x) after the dot products."""
        r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.cfg.rms_norm_eps)
        if self.tensor_cores:
            return (x * norm_w.float())[:, k].to(torch.bfloat16).float() @ w[:, k].float().T * r
        return (x * r * norm_w.float())[:, k] @ w[:, k].float().T

    def k_slice(self, j: int, slices: int) -> slice:
        """Slice j of `slices` equal parts of the hidden size (slices <= 1: all of it)."""
        if slices <= 1:
            return slice(None)
        n = self.cfg.hidden_size // slices
        return slice(j * n, (j + 1) * n)

    # ---- one step -----------------------------------------------------
    def set_header(self, tokens: list[int], positions: list[int], pages: list[list[int]]) -> None:
        if not 1 <= len(tokens) <= self.sched.bucket:
            raise ValueError(f"batch={len(tokens)} must be in 1..bucket={self.sched.bucket}")
        self.epoch += 1
        self.batch, self.tokens, self.positions = len(tokens), list(tokens), list(positions)
        width = max(len(p) for p in pages)
        self.pages = torch.zeros(self.batch, width, dtype=torch.int64)
        for b, p in enumerate(pages):
            if len(p) * self.page_size <= positions[b]:
                raise ValueError(f"sequence {b}: position {positions[b]} is past its "
                                 f"{len(p)} pages of {self.page_size} tokens")
            if p and not 0 <= min(p) <= max(p) < self.num_pages:
                raise ValueError(f"sequence {b}: page ids {p} outside 0..{self.num_pages - 1}")
            self.pages[b, :len(p)] = torch.tensor(p)

    def ready(self, rank: int, ins: Instruction) -> bool:
        return not ins.runs_on(rank, self.tp) or all(
            self.counters[rank][c] >= self.epoch * n for c, n in ins.waits)

    stop_after = -1  # debug: skip instructions of stages after this one (op-by-op diff)

    def run(self, rank: int, ins: Instruction) -> None:
        if not ins.runs_on(rank, self.tp):   # an all-gather tile this rank does not own
            return
        if self.stop_after < 0 or ins.arg4 <= self.stop_after:
            ins.execute(self, rank)
        if ins.signal >= 0:
            for r in ins.signal_ranks(rank, self.tp):
                self.counters[r][ins.signal] += 1

    def step(self, tokens, positions, pages, order: str = "program", seed: int = 0,
             poison: bool = False) -> torch.Tensor:
        """Run one decode step for every rank; returns tokens [batch] (rank 0's; every rank's
        tokens and top-TOPK are checked equal to rank 0's)."""
        self.set_header(tokens, positions, pages)
        if poison:
            for st in self.ranks:
                st.poison()
        getattr(self, f"_run_{order}")(random.Random(seed))
        out = self.ranks[0].tokens_out[:self.batch].clone()
        values, ids = self.topk()
        for r, st in enumerate(self.ranks[1:], 1):
            if not torch.equal(st.tokens_out[:self.batch], out):
                raise RuntimeError(f"rank {r} tokens {st.tokens_out[:self.batch].tolist()} != "
                                   f"rank 0 tokens {out.tolist()}")
            if not (torch.equal(st.topk_ids[:self.batch], ids)
                    and torch.equal(st.topk_values[:self.batch], values)):
                raise RuntimeError(f"rank {r} top-{TOPK} ids {st.topk_ids[:self.batch].tolist()} "
                                   f"!= rank 0's {ids.tolist()} (or their values differ)")
        return out

    def _run_program(self, rng) -> None:
        # Stage order is a topological order; check it as we go.
        by_sm = [self.sched.queue(s) for s in range(self.sched.num_sms)]
        self._run_queues(by_sm, rng, interleave=False)

    def _run_queue(self, rng) -> None:
        self._run_queues([self.sched.queue(s) for s in range(self.sched.num_sms)], rng, True)

    def _run_queues(self, queues, rng, interleave: bool) -> None:
        heads = {(r, s): 0 for r in range(self.tp) for s in range(len(queues))}
        while heads:
            live = [k for k, i in heads.items()
                    if self.ready(k[0], queues[k[1]][i])]
            if not live:
                stuck = [f"rank {r} sm {s}: {queues[s][i]}" for (r, s), i in heads.items()]
                raise RuntimeError(f"deadlock: no SM can proceed; first unmet wait: {self._first_unmet()}\n"
                                   + "\n".join(stuck[:8]))
            picks = [rng.choice(live)] if interleave else live
            for r, s in picks:
                i = heads[(r, s)]
                if not self.ready(r, queues[s][i]):
                    continue
                self.run(r, queues[s][i])
                heads[(r, s)] = i + 1
                if i + 1 == len(queues[s]):
                    del heads[(r, s)]

    def _run_adversarial(self, rng) -> None:
        """Random-priority list scheduling over all ranks' instructions, dependencies only."""
        instrs = self.sched.instructions
        waiting: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        heap = []
        prio, pending = {}, {}
        for r in range(self.tp):
            for idx, ins in enumerate(instrs):
                prio[(r, idx)] = rng.random()
                waits = ins.waits if ins.runs_on(r, self.tp) else []
                missing = [(c, n) for c, n in waits if self.counters[r][c] < self.epoch * n]
                pending[(r, idx)] = len(missing)
                if not missing:
                    heapq.heappush(heap, (prio[(r, idx)], r, idx))
                for c, n in missing:
                    waiting.setdefault((r, c), []).append((r, idx, n))
        done = 0
        while heap:
            _, r, idx = heapq.heappop(heap)
            ins = instrs[idx]
            self.run(r, ins)
            done += 1
            if ins.signal < 0 or not ins.runs_on(r, self.tp):
                continue
            for tr in ins.signal_ranks(r, self.tp):
                val = self.counters[tr][ins.signal]
                for wr, widx, n in waiting.get((tr, ins.signal), []):
                    if val == self.epoch * n:       # crossed the threshold just now
                        pending[(wr, widx)] -= 1
                        if pending[(wr, widx)] == 0:
                            heapq.heappush(heap, (prio[(wr, widx)], wr, widx))
        if done != self.tp * len(instrs):
            raise RuntimeError(f"adversarial run stalled after {done} of "
                               f"{self.tp * len(instrs)} instructions; first unmet wait: {self._first_unmet()}")

    def _first_unmet(self) -> str | None:
        return self.sched.first_unmet_wait(dict(enumerate(self.counters)), self.epoch)

    def logits(self) -> torch.Tensor:
        """[batch, vocab_size] float32, gathered from every rank's vocab slice."""
        full = torch.cat([st.logits[:self.batch] for st in self.ranks], dim=1)
        return full[:, :self.vocab_size]

    def topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-TOPK from the ARGMAX op (rank 0's copy): values [batch, TOPK] f32,
        ids [batch, TOPK] int64; value descending, then id ascending."""
        st = self.ranks[0]
        return st.topk_values[:self.batch].clone(), st.topk_ids[:self.batch].clone()


__all__ = ["VM", "RankState", "NEG_INF"]
