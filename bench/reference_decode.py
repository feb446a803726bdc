"""Decode step time of the reference engine on one rank of a TP shard: eager vs CUDA graph.

One rank of Llama-3-70B at tp=8 by default (random weights made on the device,
no checkpoint), paged KV filled with random values, every sequence at context
length ctx. The all-reduce is replaced by a no-op (one GPU, one rank: no
communication at all) and greedy sampling sees only this rank's vocab slice,
so these are the per-rank compute + memory figures the megakernel must beat.
Bytes moved per step = weights read (lm_head included, the embedding's few
rows not) + KV read (batch x ctx tokens); the fraction is of the device copy
bandwidth measured in the same run (read + write counted).

  python bench/reference_decode.py                                  # H200: 70B rank, full grid
  python bench/reference_decode.py --config tiny --device cpu --batch 1 4 --ctx 64 --steps 3
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.api import Decode, SamplingParams
from tpmk.engine.reference import ReferenceEngine
from tpmk.partition.weights import RankWeights, local_heads, padded_vocab

NOTE = ("single rank on one device: all_reduce replaced by a no-op (no communication), greedy "
        "over this rank's vocab slice; bytes = weights + KV read once per step")


def random_rank(cfg: ModelConfig, tp: int, device, dtype) -> RankWeights:
    hq, hkv = local_heads(cfg, tp)
    D, H, L = cfg.head_dim, cfg.hidden_size, cfg.num_hidden_layers
    inter, vl = cfg.intermediate_size // tp, padded_vocab(cfg, tp) // tp
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02, mean=0.0):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g) * std + mean

    return RankWeights(rank=0, tp=tp, embed=rnd(vl, H), lm_head=rnd(vl, H),
                       final_norm=rnd(H, std=0.1, mean=1.0), input_norm=rnd(L, H, std=0.1, mean=1.0),
                       qkv=rnd(L, (hq + 2 * hkv) * D, H), o_proj=rnd(L, H, hq * D),
                       post_norm=rnd(L, H, std=0.1, mean=1.0), gate_up=rnd(L, 2 * inter, H),
                       down=rnd(L, H, inter))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a big device-to-device copy, read + write counted, median of 10."""
    a = torch.empty(nbytes // 2, dtype=torch.int16, device=device).fill_(1)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * nbytes / statistics.median(times[2:])


def time_steps(engine: ReferenceEngine, cmd: Decode, warmup: int, steps: int) -> float:
    """Median wall ms of engine.decode (it returns tokens on the host: the step is complete)."""
    for _ in range(warmup):
        engine.decode(cmd)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.decode(cmd)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-3-70b", help="registry name (default %(default)s)")
    ap.add_argument("--tp", type=int, default=8, help="tp degree of the shard (default %(default)s)")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: keep)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096],
                    help="context length per sequence, the new token included")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--copy-mib", type=int, default=2048, help="copy-bandwidth buffer size")
    ap.add_argument("--out-dir", default="bench/results",
                    help="writes reference_decode_<device>.json there (default %(default)s)")
    args = ap.parse_args(argv)

    cfg = ModelConfig.from_name(args.config)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    dtype_name = args.dtype if args.dtype != "auto" else (
        "bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    copy_bw = copy_bandwidth(args.device, args.copy_mib << 20)
    shard = random_rank(cfg, args.tp, args.device, dtype)
    _, hkv = local_heads(cfg, args.tp)
    weight_bytes = shard.nbytes - shard.embed.numel() * shard.embed.element_size()
    modes = ["eager", "graph"] if args.device == "cuda" else ["eager"]
    rows = []
    print(f"{dev_name}: {cfg.name} tp={args.tp} rank 0, {cfg.num_hidden_layers} layers, "
          f"{dtype_name}, weights {weight_bytes / 1e9:.2f} GB, copy bw {copy_bw / 1e12:.2f} TB/s")
    print(f"note: {NOTE}")
    for ctx in args.ctx:
        pages_per_seq = -(-ctx // args.page_size)
        rt = RuntimeConfig(tp=args.tp, device=args.device, dtype=dtype_name,
                           page_size=args.page_size, max_batch=max(args.batch), max_seq_len=ctx,
                           num_pages=max(args.batch) * pages_per_seq, cuda_graphs=True)
        engine = ReferenceEngine(cfg, rt, [shard], all_reduce=lambda t: t)
        for c in engine.caches:
            c.k.normal_()
            c.v.normal_()
        for B in args.batch:
            pages = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(B)]
            tokens = torch.randint(0, cfg.vocab_size, (B,)).tolist()
            cmd = Decode(tokens, [ctx - 1] * B, pages, [SamplingParams()] * B)
            kv_bytes = B * ctx * cfg.num_hidden_layers * hkv * cfg.head_dim * 2 * dtype.itemsize
            for mode in modes:
                engine.use_graphs = mode == "graph"
                ms = time_steps(engine, cmd, args.warmup, args.steps)
                bw = (weight_bytes + kv_bytes) / (ms / 1e3)
                rows.append(dict(ctx=ctx, batch=B, mode=mode, step_ms=ms, tok_s=B / ms * 1e3,
                                 bytes=weight_bytes + kv_bytes, TBps=bw / 1e12,
                                 frac_copy_bw=bw / copy_bw))
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()

    print(f"{'ctx':>5} {'batch':>5} {'mode':>6} {'step ms':>8} {'tok/s':>9} {'GB':>7} "
          f"{'TB/s':>6} {'% copy':>7}")
    for r in rows:
        print(f"{r['ctx']:>5} {r['batch']:>5} {r['mode']:>6} {r['step_ms']:>8.2f} "
              f"{r['tok_s']:>9.1f} {r['bytes'] / 1e9:>7.2f} {r['TBps']:>6.2f} "
              f"{100 * r['frac_copy_bw']:>6.1f}%")
    result = dict(device=dev_name, copy_bw_Bps=copy_bw, model=cfg.name, tp=args.tp,
                  layers=cfg.num_hidden_layers, dtype=dtype_name, page_size=args.page_size,
                  weights_bytes=weight_bytes, note=NOTE, rows=rows)
    out = Path(args.out_dir) / f"reference_decode_{re.sub(r'[^A-Za-z0-9]+', '_', dev_name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
