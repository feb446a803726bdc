"""All-reduce latency: tpmk peer-memory kernels vs torch.distributed NCCL, B x 8192 bf16.

    PYTHONPATH=. python bench/comm.py [--worlds 2,4,8] [--out bench/results]
    PYTHONPATH=. python bench/comm.py --smoke       # tiny correctness run (compute-sanitizer)

On one GPU: tpmk runs in virtual TP (all W ranks in one cooperative launch on this GPU,
sharing its SMs and HBM), NCCL runs with world_size=1 (NCCL refuses two ranks on one
GPU). Neither is a multi-GPU number; the JSON says so. With a multi-GPU machine, run the
per-process mode (Communicator.from_group) against NCCL at the same world size instead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

from tpmk.comm.allreduce import Communicator  # noqa: E402
from tpmk.kernels.build import nvrtc_version  # noqa: E402

HIDDEN = 8192
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
NOT_MEASURED = ("multi-GPU latency was NOT measured: no multi-GPU machine was lent this session. "
                "tpmk rows are virtual TP (all ranks on ONE GPU, sharing its SMs and HBM); "
                "NCCL rows are world_size=1 on the same GPU: for an in-place all-reduce NCCL then "
                "launches no GPU work (its captured graph is empty), so those rows measure "
                "torch.distributed host overhead only, not communication.")


def time_calls(fn, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time per call (us), CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(out)


def time_graph(fn, calls: int) -> float:
    """`calls` back-to-back calls captured in one CUDA graph; us per call."""
    fn()
    torch.cuda.synchronize()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            fn()
    return time_calls(g.replay, 1) / calls


def bench_tpmk(world: int, batches, calls: int) -> list[dict]:
    comm = Communicator.virtual(world)
    rows = []
    for B in batches:
        xs = [torch.randn(B * HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(world)]
        outs = [torch.empty_like(x) for x in xs]
        for algo in ("one_shot", "two_shot"):
            fn = lambda: comm.all_reduce_virtual(xs, outs, algo=algo)  # noqa: E731
            row = dict(impl="tpmk_virtual_tp", world_size=world, B=B, bytes=2 * B * HIDDEN, algo=algo,
                       eager_us=time_calls(fn, calls), graph_us=time_graph(fn, 20))
            comm.check()
            rows.append(row)
            print(f"tpmk W={world} B={B:5d} {algo:8s} eager {row['eager_us']:8.1f} us  "
                  f"graph {row['graph_us']:8.1f} us", flush=True)
    comm.close()
    return rows


def bench_nccl(batches, calls: int) -> list[dict]:
    import torch.distributed as dist
    init = Path(tempfile.mkdtemp()) / "nccl_init"
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for B in batches:
        x = torch.randn(B * HIDDEN, device="cuda").to(torch.bfloat16)
        fn = lambda: dist.all_reduce(x)  # noqa: E731
        row = dict(impl="nccl", world_size=1, B=B, bytes=2 * B * HIDDEN, algo="nccl",
                   eager_us=time_calls(fn, calls), graph_us=time_graph(fn, 20))
        rows.append(row)
        print(f"nccl W=1 B={B:5d} eager {row['eager_us']:8.1f} us  graph {row['graph_us']:8.1f} us",
              flush=True)
    dist.destroy_process_group()
    return rows


def smoke():
    """A few small calls of every path, for compute-sanitizer."""
    for world in (2, 4):
        comm = Communicator.virtual(world, slot_bytes=1 << 16, blocks_per_rank=2)
        for n in (1, 9, 4099, 70_001):
            xs = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(world)]
            outs = [torch.empty_like(x) for x in xs]
            for algo in ("one_shot", "two_shot"):
                comm.all_reduce_virtual(xs, outs, algo=algo)
                comm.check()
                want = sum(x.float() for x in xs).to(torch.bfloat16)
                assert all(torch.equal(o, want) for o in outs), (world, n, algo)
        comm.close()
    print("smoke ok")


def print_table(rows):
    nccl = {r["B"]: r for r in rows if r["impl"] == "nccl"}
    print(f"\n{'W':>2} {'B':>5} {'KiB':>7} | {'1shot':>7} {'2shot':>7} {'1shot-g':>7} {'2shot-g':>7} |"
          f" {'nccl1':>7} {'nccl1-g':>7}   (us per all-reduce)")
    for w in sorted({r["world_size"] for r in rows if r["impl"] != "nccl"}):
        for B in sorted({r["B"] for r in rows}):
            t = {r["algo"]: r for r in rows if r["impl"] != "nccl" and r["world_size"] == w and r["B"] == B}
            if not t:
                continue
            n = nccl.get(B, {})
            print(f"{w:>2} {B:>5} {2 * B * HIDDEN / 1024:>7.0f} | {t['one_shot']['eager_us']:7.1f} "
                  f"{t['two_shot']['eager_us']:7.1f} {t['one_shot']['graph_us']:7.1f} "
                  f"{t['two_shot']['graph_us']:7.1f} | {n.get('eager_us', float('nan')):7.1f} "
                  f"{n.get('graph_us', float('nan')):7.1f}")
    print(NOT_MEASURED)
    auto = [(w, B, t) for w in sorted({r["world_size"] for r in rows if r["impl"] != "nccl"})
            for B in sorted({r["B"] for r in rows})
            for t in [min((r["graph_us"], r["algo"]) for r in rows
                          if r["impl"] != "nccl" and r["world_size"] == w and r["B"] == B)]]
    print("fastest (graph): " + ", ".join(f"W{w}/B{B}:{a}" for w, B, (_, a) in auto))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        return smoke()
    batches = [int(b) for b in a.batches.split(",")]
    t0 = time.time()
    rows = []
    for w in (int(x) for x in a.worlds.split(",")):
        rows += bench_tpmk(w, batches, a.calls)
    rows += bench_nccl(batches, a.calls)
    print_table(rows)
    name = torch.cuda.get_device_name()
    result = dict(device=name, torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())),
                  nvrtc=".".join(map(str, nvrtc_version())), hidden=HIDDEN, multi_gpu_measured=False,
                  note=NOT_MEASURED, wall_s=round(time.time() - t0, 1), rows=rows)
    out = Path(a.out) / f"comm_{name.replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
