"""End-to-end tensor-parallel decode: the megakernel vs the reference engine, same run.

Both engines serve the same random checkpoint through the same launcher (default
`local`: one process per rank, one GPU each when there are tp GPUs). The megakernel
runs one rank per process with its peers' buffers mapped over CUDA IPC (NVLink
stores + flags inside the kernel); the reference engine is PyTorch with an NCCL
all-reduce per row-parallel layer and CUDA graphs. Every batch size gets one
prefill of `ctx - 1`-token prompts, then `--warmup` and `--steps` timed Decode
commands. Per step: the driver's wall time (command to every rank and back: what a
server sees) and rank 0's own step time; tokens/s from the driver's time; and how
many greedy tokens the engines agree on (bf16 near-ties may flip a few).
Writes bench/results/tp_decode_<device>_tp<N>.json.

  python bench/tp_decode.py --tp 8 --config llama-3-70b --layers 8 --batch 1 8 32 64
  python bench/tp_decode.py --tp 2 --config tiny --device cpu --engines reference interpreter \
      --batch 1 2 --ctx 16 --steps 3 --out /tmp/tp   # CPU smoke (tests/test_bench_tp_decode.py)

A checkpoint of `--layers` layers (0: all) is written once to --ckpt (random weights,
tpmk.checkpoint); step times then cover those layers plus embedding and LM head.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from tpmk.checkpoint import make_checkpoint
from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams
from tpmk.engine.kv_cache import PageAllocator
from tpmk.launcher.launch import launch


def checkpoint_dir(cfg: ModelConfig, root: str) -> str:
    d = Path(root) / f"{cfg.name}_L{cfg.num_hidden_layers}_{cfg.dtype}"
    if not (d / "config.json").exists():
        t0 = time.time()
        make_checkpoint(cfg, d)
        print(f"checkpoint {d} written in {time.time() - t0:.0f} s")
    return str(d)


def check_fits_cpu(cfg: ModelConfig, free_bytes: int) -> None:
    """Without GPUs the ranks' shards together hold every weight in float32: refuse a shape
    that cannot fit in `free_bytes` before writing its checkpoint (the rank processes would
    be killed by the out-of-memory killer minutes later)."""
    need = 4 * cfg.num_parameters
    if need > free_bytes:
        raise SystemExit(f"--config {cfg.name} with {cfg.num_hidden_layers} layers runs on the CPU in "
                         f"float32 and needs ~{need / 1e9:.0f} GB, {free_bytes / 1e9:.0f} GB are free: "
                         f"on a machine without tp GPUs use a small shape, e.g. --config tiny "
                         f"--device cpu --engines reference interpreter (or fewer --layers)")


def time_engine(model_dir: str, runtime: RuntimeConfig, launcher: str, batches: list[int],
                ctx: int, warmup: int, steps: int, vocab: int) -> list[dict]:
    """One launch of `runtime.engine`; per batch size: prefill, warm-up, timed decode steps."""
    client = launch(model_dir, runtime, launcher)
    rows = []
    try:
        for batch in batches:
            alloc = PageAllocator(runtime.num_pages, runtime.page_size)
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(3, vocab, (batch, ctx - 1), generator=g).tolist()
            pages = [alloc.allocate(ctx + warmup + steps) for _ in range(batch)]
            greedy = [SamplingParams()] * batch
            tokens = client.execute(Prefill(prompts, pages, greedy)).tokens
            out, wall, own = [list(tokens)], [], []
            for i in range(warmup + steps):
                pos = ctx - 1 + i
                t0 = time.perf_counter()
                res = client.execute(Decode(tokens, [pos] * batch, pages, greedy))
                if i >= warmup:
                    wall.append((time.perf_counter() - t0) * 1e3)
                    own.append(res.step_ms)
                tokens = res.tokens
                out.append(list(tokens))
            r = dict(engine=runtime.engine, batch=batch, ctx=ctx, step_ms=statistics.median(wall),
                     rank0_step_ms=statistics.median(own), tokens=out)
            r["tok_s"] = batch * 1e3 / r["step_ms"]
            rows.append(r)
            print(f"{runtime.engine:>11} batch {batch:>3}: {r['step_ms']:8.2f} ms/step (rank 0: "
                  f"{r['rank0_step_ms']:.2f}), {r['tok_s']:9.1f} tok/s", flush=True)
    finally:
        client.close()   # shuts the ranks down
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama-3-70b", help="registry model shape (random weights)")
    ap.add_argument("--layers", type=int, default=8, help="at most this many layers in the checkpoint (0: all)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--engines", nargs="+", default=["reference", "megakernel"])
    ap.add_argument("--launcher", default="local", choices=("local", "ray", "mpi"))
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ctx", type=int, default=1024, help="context length at the first decode step")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reduce", default="auto", choices=("auto", "oneshot", "rsag"))
    ap.add_argument("--ckpt", default="/tmp/tpmk_bench_ckpt", help="where the checkpoint is written")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    cfg = ModelConfig.from_name(args.config)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=min(args.layers, cfg.num_hidden_layers))
    on_gpu = args.device != "cpu" and torch.cuda.is_available()
    cfg = cfg.replace(dtype="bfloat16" if on_gpu else "float32")
    if not on_gpu:
        check_fits_cpu(cfg, os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    model_dir = checkpoint_dir(cfg, args.ckpt)
    rows = []
    for engine in args.engines:
        runtime = RuntimeConfig(tp=args.tp, engine=engine, device=args.device, dtype=cfg.dtype,
                                max_batch=max(args.batch), max_seq_len=args.ctx + args.warmup + args.steps,
                                reduce=args.reduce if engine in ("interpreter", "megakernel") else "auto",
                                megakernel_max_batch=0)   # every batch in the stream: what is timed
        rows += time_engine(model_dir, runtime, args.launcher, args.batch, args.ctx, args.warmup,
                            args.steps, cfg.vocab_size)
    base = {r["batch"]: r for r in rows if r["engine"] == args.engines[0]}
    print(f"\n{'engine':>11} {'batch':>5} {'ms/step':>9} {'tok/s':>9} {'vs ' + args.engines[0]:>12} "
          f"{'same tokens':>12}")
    for r in rows:
        b = base[r["batch"]]
        same = sum(x == y for s, t in zip(r["tokens"], b["tokens"]) for x, y in zip(s, t))
        r["speedup"], r["same_tokens"] = b["step_ms"] / r["step_ms"], same / (len(b["tokens"]) * r["batch"])
        print(f"{r['engine']:>11} {r['batch']:>5} {r['step_ms']:9.2f} {r['tok_s']:9.1f} "
              f"{r['speedup']:11.2f}x {r['same_tokens']:11.0%}")
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tp_decode_{device.replace(' ', '_')}_tp{args.tp}.json"
    path.write_text(json.dumps(dict(device=device, gpus=torch.cuda.device_count() if on_gpu else 0,
                                    model=args.config, layers=cfg.num_hidden_layers, tp=args.tp,
                                    launcher=args.launcher, reduce=args.reduce,
                                    rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows]),
                               indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
