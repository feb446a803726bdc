"""Decode step time: megakernel vs torch + CUDA graph on one rank of a TP shard (same card, same run).

Per-rank proxy: one rank of Llama-3-70B tp=8 with random bf16
weights; the megakernel's peer slots are looped back to local memory, the
baseline does no communication at all. Prints one table and writes
bench/results/decode_<device>.json.

  python bench/decode.py --model llama-3-70b --tp 8 --batch 1 8 32 128 --ctx 1024 4096
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tpmk.config import ModelConfig
from tpmk.rope import rope_inv_freq
from tpmk.kernels import isa
from tpmk.kernels.megakernel import Megakernel
from tpmk.kernels.schedule import build_schedule
from tpmk.partition.weights import RankWeights, local_heads, padded_vocab


def random_rank(cfg: ModelConfig, tp: int) -> RankWeights:
    hq, hkv = local_heads(cfg, tp)
    D, H, L = cfg.head_dim, cfg.hidden_size, cfg.num_hidden_layers
    inter, vp = cfg.intermediate_size // tp, padded_vocab(cfg, tp) // tp
    r = lambda *s: (torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02)  # noqa: E731
    n = lambda *s: torch.ones(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return RankWeights(rank=0, tp=tp, embed=r(vp, H), lm_head=r(vp, H), final_norm=n(H),
                       input_norm=n(L, H), qkv=r(L, (hq + 2 * hkv) * D, H), o_proj=r(L, H, hq * D),
                       post_norm=n(L, H), gate_up=r(L, 2 * inter, H), down=r(L, H, inter))


def copy_bandwidth() -> float:
    """Device copy bandwidth in B/s (read + write counted), 4 GiB buffer, median of 10."""
    a = torch.empty(2 ** 31, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(12):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); b.copy_(a); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * 2 / sorted(ts[2:])[len(ts[2:]) // 2]


class TorchStep:
    """Baseline: the same per-rank math as eager torch ops, captured in one CUDA graph.
    KV is contiguous per sequence [L, B, Hkv, ctx, D] (no paging), SDPA attention."""

    def __init__(self, cfg, w: RankWeights, tp, batch, ctx):
        self.cfg, self.w, self.tp = cfg, w, tp
        hq, hkv = local_heads(cfg, tp)
        self.hq, self.hkv, D = hq, hkv, cfg.head_dim
        L = cfg.num_hidden_layers
        self.k = torch.randn(L, batch, hkv, ctx, D, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        self.x = torch.randn(batch, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.pos = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.long)
        self.inv = rope_inv_freq(cfg).cuda()
        self.graph = None

    def _norm(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype) * w

    def _rope(self, t):  # t [B, heads, D]
        ang = self.pos[:, None].float() * self.inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].to(t.dtype), torch.cat([ang.sin()] * 2, -1)[:, None].to(t.dtype)
        h = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., h:], t[..., :h]], -1) * sin

    def forward(self):
        cfg, w, D = self.cfg, self.w, self.cfg.head_dim
        B, inter = self.x.shape[0], cfg.intermediate_size // self.tp
        x = self.x
        for l in range(cfg.num_hidden_layers):
            qkv = self._norm(x, w.input_norm[l]) @ w.qkv[l].T
            q = self._rope(qkv[:, :self.hq * D].view(B, self.hq, D))
            k = self._rope(qkv[:, self.hq * D:(self.hq + self.hkv) * D].view(B, self.hkv, D))
            v = qkv[:, (self.hq + self.hkv) * D:].view(B, self.hkv, D)
            self.k[l, :, :, -1] = k
            self.v[l, :, :, -1] = v
            a = F.scaled_dot_product_attention(q[:, :, None], self.k[l], self.v[l], enable_gqa=True)
            x = x + a.reshape(B, -1) @ w.o_proj[l].T
            gu = self._norm(x, w.post_norm[l]) @ w.gate_up[l].T
            x = x + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w.down[l].T
        return (self._norm(x, w.final_norm) @ w.lm_head.T).argmax(-1)

    def capture(self):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.forward()

    def __call__(self):
        self.graph.replay()


def time_fn(fn, iters: int) -> float:
    fn(); fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-70b")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=0, help="0: all")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--define", nargs="*", action="extend", default=[], metavar="NAME=VALUE",
                    help="extra megakernel macros for tuning experiments, e.g. PREFETCH_CAP=393216")
    ap.add_argument("--splits", type=int, default=0,
                    help="attention splits per (sequence, kv head); 0: the scheduler's choice")
    ap.add_argument("--bucket", type=int, default=0,
                    help="run every batch on this bucket's schedule (>= each batch; what an engine "
                         "without batch buckets did); 0: each batch its own bucket")
    ap.add_argument("--qkv-pairs", type=int, default=0,
                    help="rotary pairs per qkv tile (build_schedule qkv_pairs); 0: one tile per SM")
    ap.add_argument("--gu-splits", type=int, default=1,
                    help="K slices of gate_up (build_schedule gu_splits; 1: whole rows)")
    ap.add_argument("--profile", default="", help="write a Chrome trace (per-instruction start/end) "
                    "of the first configuration's last step to this JSON file")
    args = ap.parse_args()
    if args.bucket and args.bucket < max(args.batch):
        ap.error(f"--bucket {args.bucket} < --batch {max(args.batch)}: a bucket holds at most its size")
    cfg = ModelConfig.from_name(args.model)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    dev = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    w = random_rank(cfg, args.tp)
    wbytes = sum(t.numel() * 2 for t in (w.qkv, w.o_proj, w.gate_up, w.down, w.lm_head))
    _, hkv = local_heads(cfg, args.tp)
    rows = []
    print(f"{dev.name}: copy bandwidth {bw / 1e12:.2f} TB/s; {cfg.name} tp={args.tp} rank 0, "
          f"{cfg.num_hidden_layers} layers, weights {wbytes / 1e9:.2f} GB")
    print(f"{'batch':>5} {'ctx':>5} | {'mk ms':>7} {'tok/s':>8} {'bw %':>5} | {'graph ms':>8} {'bw %':>5} | speedup")
    for ctx in args.ctx:
        for B in args.batch:
            kv_bytes = B * ctx * cfg.num_hidden_layers * hkv * cfg.head_dim * 2 * 2
            per_seq = math.ceil(ctx / args.page_size)
            L = cfg.num_hidden_layers
            kc = torch.randn(L, B * per_seq, hkv, args.page_size, cfg.head_dim, device="cuda",
                             dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            sched = build_schedule(cfg, args.tp, args.bucket or B, dev.multi_processor_count, num_splits=args.splits,
                                   qkv_pairs=args.qkv_pairs, gu_splits=args.gu_splits)
            row = dict(batch=B, ctx=ctx, bytes=wbytes + kv_bytes)
            t0 = time.time()
            profile = bool(args.profile) and not rows
            mk = Megakernel(cfg, sched, [w], [kc], [vc], loopback=True, timeout_s=10.0,
                            max_pages_per_seq=per_seq, profile=profile, defines=tuple(args.define))
            pages = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(B)]
            toks, pos = [1] * B, [ctx - 1] * B

            def mk_step():
                mk.write_header(toks, pos, pages)
                mk.launch()
            mk_ms = time_fn(mk_step, args.iters)
            mk.check_error()
            if profile:
                Path(args.profile).write_text(json.dumps({"traceEvents": mk.profile_trace()}))
            row.update(mk_ms=mk_ms, mk_tok_s=B / mk_ms * 1e3, mk_bw_frac=(wbytes + kv_bytes) / (mk_ms / 1e3) / bw)
            del mk, kc, vc
            if not args.no_baseline:
                base = TorchStep(cfg, w, args.tp, B, ctx)
                base.capture()
                g_ms = time_fn(base, args.iters)
                del base
                row.update(graph_ms=g_ms, graph_bw_frac=(wbytes + kv_bytes) / (g_ms / 1e3) / bw,
                           speedup=g_ms / mk_ms)
            torch.cuda.empty_cache()
            rows.append(row)
            print(f"{B:>5} {ctx:>5} | {mk_ms:7.3f} {B / mk_ms * 1e3:8.0f} {100 * row['mk_bw_frac']:5.1f} | "
                  f"{row.get('graph_ms', float('nan')):8.3f} {100 * row.get('graph_bw_frac', float('nan')):5.1f} | "
                  f"{row.get('speedup', float('nan')):.2f}x   ({time.time() - t0:.0f}s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = dev.name.replace(" ", "_")
    res = dict(device=dev.name, copy_bw_Bps=bw, model=cfg.name, tp=args.tp, defines=args.define, splits=args.splits,
               bucket=args.bucket, page_size=args.page_size,
               qkv_pairs=args.qkv_pairs, gu_splits=args.gu_splits, mma_min_batch=isa.MMA_MIN_BATCH,
               layers=cfg.num_hidden_layers, weights_bytes=wbytes, note="one rank, peer slots looped back; baseline: torch + CUDA graph, "
               "contiguous KV, no communication", rows=rows)
    (out / f"decode_{name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
