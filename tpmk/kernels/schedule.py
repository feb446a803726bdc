"""build_schedule: (ModelConfig, tp, batch bucket, SMs per rank) -> per-SM instruction queues.

Every rank runs the same schedule (SPMD). Instructions are emitted in stages
(embed, residual 0, then per layer qkv, attention, o_proj, residual,
gate_up, [act,] down, residual; lm_head, argmax); every wait refers to a counter
signalled only by an earlier stage, and each SM's queue is in stage order,
so with all SMs of all ranks resident the schedule cannot deadlock.

Counters (per rank, `Schedule.counter_names` for error messages):
  arrive[s][j]  partial tile j of residual stage s arrived from each rank (count tp;
                with reduce="rsag" only on tile j's owner rank, j % tp)
  ready[s]      residual stage s done on this rank (count n_h_tiles)
  qkv[l], attn[l], gate_up[l]   local stage completion (count = tiles)
  gate_up[l][t]  with gu_splits > 1: the K slices of gate_up column tile t written (count
                gu_splits); ACT's tiles of those columns wait on it, and gate_up[l] counts ACT's
                tiles instead (down waits on it either way)
  merge[l][b][g]  attention tickets (num_splits > 1): each split of (sequence b, kv head g)
                takes one; the split drawing a multiple of num_splits is the last of the step
                and merges the group's splits into attn_out. Nothing waits on a ticket.
  lm            LM-head candidates arrived from every rank (count tp * n_lm_tiles)
  done          argmax tiles finished (count: their number; rows of the bucket cut over the SMs)
Stage s = 0 is the embedding, 2l+1 the attention residual of layer l, 2l+2 its MLP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tpmk.config import REDUCE_CHOICES, ModelConfig
from tpmk.kernels.isa import INSTR_WORDS, NO_COUNTER
from tpmk.kernels.ops import (Act, Argmax, Attention, Down, Embed, GateUp, Instruction, LmHead,
                              OProj, Qkv, Residual)
from tpmk.partition.weights import local_heads, padded_vocab


@dataclass
class Schedule:
    tp: int
    bucket: int
    num_sms: int
    num_splits: int
    reduce: str                    # REDUCE_MODES: "oneshot" or "rsag"
    h_tile: int                    # hidden columns per embed/o_proj/down/residual tile
    n_h_tiles: int
    n_lm_tiles: int
    instructions: list[Instruction]            # in queue order: SM 0's queue, then SM 1's ...
    queue_start: list[int]                     # [num_sms + 1]
    counter_names: list[str] = field(default_factory=list)
    stage_names: list[str] = field(default_factory=list)   # stage number (ARG4) -> "qkv[layer 3]"
    gu_splits: int = 1                         # gate_up's K slices (1: whole rows, no ACT stage)

    @property
    def num_counters(self) -> int:
        return len(self.counter_names)

    def queue(self, sm: int) -> list[Instruction]:
        return self.instructions[self.queue_start[sm]:self.queue_start[sm + 1]]

    def stage_of(self, name: str, layer: int = 0) -> int:
        """Stage number of the first stage of op `name` in `layer` (for stop_after)."""
        key = f"{name}[layer {layer}]"
        if key not in self.stage_names:
            raise ValueError(f"no stage {key!r}; stages: {self.stage_names}")
        return self.stage_names.index(key)

    def first_unmet_wait(self, counters: dict[int, list[int]], epoch: int) -> str | None:
        """After a stalled step: the lowest-stage instruction, on the ranks given, with a wait
        its counter has not reached (counters: {rank: [value per counter id]}, u32), described
        for an error message; None when every wait is met. Every wait refers to an earlier
        stage and each SM's queue is in stage order, so once nothing moves, the lowest such
        stage is where the step stopped: later stages wait downstream of it (a timeout may
        name any of them)."""
        unmet = []
        for rank, values in counters.items():
            for sm in range(self.num_sms):
                for ins in self.queue(sm):
                    if not ins.runs_on(rank, self.tp):
                        continue
                    for c, n in ins.waits:
                        v, want = int(values[c]) & 0xFFFFFFFF, (epoch * n) & 0xFFFFFFFF
                        if (v - want) & 0xFFFFFFFF >= 1 << 31:   # v < want, wrap-safe as on the GPU
                            unmet.append((ins.arg4, rank, sm, ins, c, v, want))
        if not unmet:
            return None
        stage, rank, sm, ins, c, v, want = min(unmet, key=lambda u: u[:3])
        return (f"stage {stage} ({self.stage_names[stage]}): {ins} on rank {rank} SM {sm} waits "
                f"for counter {self.counter_names[c]} = {v} < {want}")

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, INSTR_WORDS] int32 instruction words, [num_sms + 1] int32 queue starts)."""
        words = torch.tensor([i.encode() for i in self.instructions], dtype=torch.int32)
        return words.reshape(-1, INSTR_WORDS), torch.tensor(self.queue_start, dtype=torch.int32)


MAX_TILE_ROWS = 256  # bounds the per-tile output staging in shared memory

# choose_reduce's cost model (a model, not yet measured: no multi-GPU machine so far).
LINK_BYTES_PER_S = 450e9   # NVLink 4 (H100 / H200), per GPU and direction
HOP_S = 3e-6               # rsag's second hop: the owner's stores + flag to every peer


def choose_reduce(cfg: ModelConfig, tp: int, bucket: int) -> str:
    """oneshot or rsag for one residual of `bucket` rows: whichever moves its bytes sooner.
    A rank's partial is S = bucket * hidden * 4 bytes (f32). One-shot sends it to the tp - 1
    peers in one hop: (tp - 1) S. Reduce-scatter + all-gather sends (tp - 1) / tp of it to
    the owners, then the owned 1 / tp, summed, to the tp - 1 peers: 2 (tp - 1) / tp S, one
    hop more. At tp 2 both move S, so one-shot always; at tp 8 (hidden 8192) rsag from
    bucket 8, at tp 4 from bucket 28."""
    if tp == 1:
        return "oneshot"
    S = bucket * cfg.hidden_size * 4
    oneshot = (tp - 1) * S / LINK_BYTES_PER_S
    rsag = 2 * (tp - 1) / tp * S / LINK_BYTES_PER_S + HOP_S
    return "rsag" if rsag < oneshot else "oneshot"


def _tiles(total: int, num_sms: int, multiple: int, size: int = 0) -> list[tuple[int, int]]:
    """Cut `total` rows into (start, rows) tiles of `size` rows (the last may be shorter);
    size 0: about num_sms tiles, sizes multiples of `multiple`, <= MAX_TILE_ROWS."""
    if size == 0:
        size = max(multiple, math.ceil(total / num_sms / multiple) * multiple)
        size = min(size, max(multiple, MAX_TILE_ROWS // multiple * multiple))
    return [(r, min(size, total - r)) for r in range(0, total, size)]


class _Counters:
    def __init__(self):
        self.names: list[str] = []

    def new(self, name: str) -> int:
        self.names.append(name)
        return len(self.names) - 1


def build_schedule(cfg: ModelConfig, tp: int, bucket: int, num_sms: int,
                   num_splits: int = 0, reduce: str = "oneshot", qkv_pairs: int = 0,
                   gu_splits: int = 1) -> Schedule:
    """reduce: how the o_proj / down partial sums meet.
      "oneshot": every rank pushes its partial of every hidden tile to every rank, which
        sums all tp partials itself (one hop; tp x the traffic).
      "rsag": reduce-scatter + all-gather: a tile's partials go to its owner rank only
        (tile % tp), the owner sums them, adds the residual and writes the result into
        every rank's x (two hops, 2 (tp - 1) / tp x the data per rank instead of tp - 1).
      "auto": choose_reduce(cfg, tp, bucket); Schedule.reduce holds the mode chosen.
    qkv_pairs: rotary pairs (2 rows each) per qkv tile; 0: as many tiles as SMs. Every qkv
      tile reads all of the step's activations, so at large buckets fewer, taller tiles
      trade SMs for less of that traffic (a tuning knob: bench/decode.py --qkv-pairs).
    gu_splits: K slices of gate_up. Every gate_up tile reads all of the step's activations
      (at batch 128, 2 MB per tile against its 0.9 MB of weights on a 70B tp=8 rank); with S
      slices, ~num_sms / S column tiles of S times the columns each take 1 / S of K, write
      partial sums, and an ACT stage sums them (fixed order) into silu(gate) * up: 1 / S of
      the activation reads, for one more stage (bench/decode.py --gu-splits). 70B tp=8 rank,
      H100, batch 128, ctx 1024 (2026-12-07, traces): S = 2 took gate_up from 104.6 to 94.7 us
      per layer, ACT added 5.5, the traced step 0.6 % shorter; S = 4 needs two batch passes
      there and took the traced step from 29.5 to 37.4 ms (timed: 31.80 -> 40.04). Not worth
      a second compiled kernel: default 1.
    """
    if bucket < 1 or num_sms < 1:
        raise ValueError(f"bucket={bucket} and num_sms={num_sms} must be >= 1")
    if reduce not in REDUCE_CHOICES:
        raise ValueError(f"reduce={reduce!r}; use one of {REDUCE_CHOICES}")
    if reduce == "auto":
        reduce = choose_reduce(cfg, tp, bucket)
    rsag = reduce == "rsag"
    hq, hkv = local_heads(cfg, tp)
    D, H, L = cfg.head_dim, cfg.hidden_size, cfg.num_hidden_layers
    if D % 2:
        raise ValueError(f"head_dim={D} must be even for RoPE")
    if not 0 <= qkv_pairs <= D // 2:
        raise ValueError(f"qkv_pairs={qkv_pairs} must be in 0..head_dim/2={D // 2} (0: one tile per SM)")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={cfg.intermediate_size}")
    if gu_splits < 1 or (gu_splits > 1 and H % (8 * gu_splits)):   # 1: whole rows, any H
        raise ValueError(f"gu_splits={gu_splits}: hidden_size={H} must split into gu_splits slices of "
                         f"a multiple of 8 columns; use a divisor of {H // 8}")
    inter, vp = cfg.intermediate_size // tp, padded_vocab(cfg, tp) // tp
    if num_splits == 0:  # enough attention tiles to cover the SMs: at most 64 splits for one
        # (sequence, kv head) pair, 32 otherwise. Batch 1 of a 70B tp=8 rank on an H100, three
        # passes: 64 vs 32 splits 9.28 vs 9.69 ms per step at ctx 4096, 9.05 vs 9.02 at ctx 1024
        # (128: 9.29 / 9.13); at batch 2, 64 splits were level at ctx 4096 and 0.9 % slower at
        # ctx 1024, 128 20 % slower (2026-12-08). 32 rather than 16 at batch 1 on an H200: 12.7
        # vs 14.3 ms at ctx 4096 (2026-12-03).
        cap = 64 if bucket * hkv == 1 else 32
        num_splits = max(1, min(cap, num_sms // (bucket * hkv)))
    ctr = _Counters()
    n_stages = 2 * L + 1
    h_tiles = _tiles(H, num_sms, 8)
    arrive = [[ctr.new(f"arrive[stage {s}][tile {j}]") for j in range(len(h_tiles))]
              for s in range(n_stages)]
    ready = [ctr.new(f"ready[stage {s}]") for s in range(n_stages)]
    qkv_done = [ctr.new(f"qkv[layer {l}]") for l in range(L)]
    attn_done = [ctr.new(f"attn[layer {l}]") for l in range(L)]
    gu_done = [ctr.new(f"gate_up[layer {l}]") for l in range(L)]
    gu_tiles = _tiles(inter, max(1, num_sms // gu_splits), 4)
    gu_part = [[ctr.new(f"gate_up[layer {l}][tile {t}]") for t in range(len(gu_tiles))]
               if gu_splits > 1 else [] for l in range(L)]
    merge = [[[ctr.new(f"merge[layer {l}][seq {b}][kv {g}]") if num_splits > 1 else NO_COUNTER
               for g in range(hkv)] for b in range(bucket)] for l in range(L)]
    lm_tiles = _tiles(vp, num_sms, 8)
    lm = ctr.new("lm")
    done = ctr.new("done")
    nh = len(h_tiles)

    def residual_stage(s: int) -> list[Instruction]:
        ag = rsag and s > 0   # the embedding (stage 0) always goes one-shot
        return [Residual(layer=max(0, (s - 1) // 2), tile=j, row0=c, nrows=n, arg0=s,
                         arg1=int(s == 0), waits=[(arrive[s][j], tp)], signal=ready[s],
                         signal_peers=ag, owner=ag)
                for j, (c, n) in enumerate(h_tiles)]

    stages: list[list[Instruction]] = [
        [Embed(tile=j, row0=c, nrows=n, arg0=0, signal=arrive[0][j], signal_peers=True)
         for j, (c, n) in enumerate(h_tiles)],
        residual_stage(0)]
    # qkv tiles: (local head, rotary pair range); pairs cut so there are ~num_sms tiles.
    n_heads = hq + 2 * hkv
    pair_tiles = _tiles(D // 2, max(1, num_sms // n_heads), 1, size=qkv_pairs)
    for l in range(L):
        qkv = [Qkv(layer=l, row0=h, arg0=p, nrows=n, waits=[(ready[2 * l], nh)],
                   signal=qkv_done[l]) for h in range(n_heads) for p, n in pair_tiles]
        for t, ins in enumerate(qkv):
            ins.tile = t
        attn = [Attention(layer=l, row0=g, arg0=b, arg1=s, arg2=merge[l][b][g],
                          waits=[(qkv_done[l], len(qkv))], signal=attn_done[l])
                for b in range(bucket) for g in range(hkv) for s in range(num_splits)]
        for t, ins in enumerate(attn):
            ins.tile = t
        o = [OProj(layer=l, tile=j, row0=c, nrows=n, waits=[(attn_done[l], len(attn))],
                   signal=arrive[2 * l + 1][j], signal_peers=not rsag, owner=rsag)
             for j, (c, n) in enumerate(h_tiles)]
        # mlp: gate_up, or its K slices then ACT; the last stage signals gu_done[l]
        if gu_splits == 1:
            mlp = [[GateUp(layer=l, tile=t, row0=c, nrows=n, waits=[(ready[2 * l + 1], nh)],
                           signal=gu_done[l]) for t, (c, n) in enumerate(gu_tiles)]]
        else:   # slices j of column tile t on consecutive queues; ACT cuts each tile's columns
            slices = [GateUp(layer=l, tile=t * gu_splits + j, row0=c, nrows=n, arg0=j, arg1=gu_splits,
                             arg2=H // gu_splits, waits=[(ready[2 * l + 1], nh)], signal=gu_part[l][t])
                      for t, (c, n) in enumerate(gu_tiles) for j in range(gu_splits)]
            act = [Act(layer=l, row0=c + a, nrows=m, arg0=gu_splits, waits=[(gu_part[l][t], gu_splits)],
                       signal=gu_done[l])
                   for t, (c, n) in enumerate(gu_tiles) for a, m in _tiles(n, gu_splits, 4)]
            for t, ins in enumerate(act):
                ins.tile = t
            mlp = [slices, act]
        dn = [Down(layer=l, tile=j, row0=c, nrows=n, waits=[(gu_done[l], len(mlp[-1]))],
                   signal=arrive[2 * l + 2][j], signal_peers=not rsag, owner=rsag)
              for j, (c, n) in enumerate(h_tiles)]
        stages += [qkv, attn, o, residual_stage(2 * l + 1), *mlp, dn, residual_stage(2 * l + 2)]
    stages.append([LmHead(tile=t, row0=r, nrows=n, waits=[(ready[2 * L], nh)], signal=lm,
                          signal_peers=True) for t, (r, n) in enumerate(lm_tiles)])
    # One SM merging every row's candidates took 0.92 ms of a batch-128 step (H200, 2026-12-04).
    stages.append([Argmax(tile=t, row0=r, nrows=n, waits=[(lm, tp * len(lm_tiles))], signal=done)
                   for t, (r, n) in enumerate(_tiles(bucket, num_sms, 1))])

    # Round-robin each stage over the SMs, continuing where the last stage stopped.
    queues: list[list[Instruction]] = [[] for _ in range(num_sms)]
    nxt = 0
    for stage_no, stage in enumerate(stages):
        for ins in stage:
            ins.arg4 = stage_no
            queues[nxt].append(ins)
            nxt = (nxt + 1) % num_sms
    flat, starts = [], [0]
    for q in queues:
        flat += q
        starts.append(len(flat))
    return Schedule(tp=tp, bucket=bucket, num_sms=num_sms, num_splits=num_splits, reduce=reduce,
                    h_tile=h_tiles[0][1], n_h_tiles=nh, n_lm_tiles=len(lm_tiles),
                    instructions=flat, queue_start=starts, counter_names=ctr.names,
                    stage_names=[f"{st[0].name}[layer {st[0].layer}]" for st in stages],
                    gu_splits=gu_splits)

