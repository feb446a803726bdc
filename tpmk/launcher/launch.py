"""Choose a launcher and start the workers; the runtime flags shared by `tpmk generate`
and `tpmk serve` (one flag per RuntimeConfig field)."""
from __future__ import annotations

import argparse
import socket
from pathlib import Path

from tpmk.config import MODEL_REGISTRY, REDUCE_CHOICES, RuntimeConfig
from tpmk.engine.api import EngineClient
from tpmk.engine.worker import ENGINES, is_virtual_tp, supports_per_process

LAUNCHERS = ("inline", "local", "ray", "mpi")


def default_launcher(runtime: RuntimeConfig) -> str:
    """inline when one process holds every rank (tp=1 or a virtual-TP engine), else local."""
    return "inline" if runtime.tp == 1 or is_virtual_tp(runtime.engine) else "local"


def num_processes(runtime: RuntimeConfig, launcher: str = "inline") -> int:
    """tp processes, except one for a virtual-TP engine launched inline (or one that cannot
    run a rank per process). The megakernel runs either way: inline it is virtual TP on one
    GPU, under local / ray / mpi one rank per process and GPU."""
    if not is_virtual_tp(runtime.engine):
        return runtime.tp
    return runtime.tp if launcher != "inline" and supports_per_process(runtime.engine) else 1


def launch(model_dir: str, runtime: RuntimeConfig, launcher: str | None = None,
           timeout_s: float | None = None) -> EngineClient:
    """Start the workers and return the driver's EngineClient.

    Under `--launcher mpi` only MPI rank 0 returns; the other ranks serve
    commands until Shutdown and exit inside this call.
    """
    launcher = launcher or default_launcher(runtime)
    world_size = num_processes(runtime, launcher)
    if launcher == "inline":
        from tpmk.launcher.inline import InlineClient
        return InlineClient(model_dir, runtime)
    if launcher == "local":
        from tpmk.launcher.local import LocalClient
        return LocalClient(model_dir, runtime, world_size, timeout_s=timeout_s)
    if launcher == "ray":
        from tpmk.launcher.ray import RayClient
        return RayClient(model_dir, runtime, world_size, timeout_s=timeout_s)
    if launcher == "mpi":
        from tpmk.launcher.mpi import launch_mpi
        return launch_mpi(model_dir, runtime, world_size)
    raise ValueError(f"unknown launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")


def resolve_model(model: str) -> str:
    """A checkpoint directory, or "tiny": the embedded default checkpoint, created on first use."""
    if Path(model).is_dir():
        if not (Path(model) / "config.json").exists():
            raise FileNotFoundError(f"--model {model}: no config.json in that directory; "
                                    f"pass a Hugging Face Llama checkpoint directory")
        return str(model)
    if model == "tiny":
        from tpmk.checkpoint import default_model_dir
        return str(default_model_dir())
    if model in MODEL_REGISTRY:
        raise FileNotFoundError(
            f"--model {model} names a model shape, not a checkpoint; create random weights "
            f"with `tpmk make-checkpoint --config {model} DIR` and pass --model DIR, "
            f"or pass a downloaded Hugging Face checkpoint directory")
    raise FileNotFoundError(f"--model {model}: no such directory; pass a Hugging Face Llama "
                            f"checkpoint directory or 'tiny' (the embedded default)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_ip() -> str:
    """This host's address on the interface that routes outwards (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `tpmk generate` and `tpmk serve`."""
    d = RuntimeConfig()
    p.add_argument("--model", default="tiny", metavar="PATH_OR_NAME",
                   help="Hugging Face Llama checkpoint directory, or 'tiny' (default): a small "
                        "random Llama that tpmk creates on first use")
    p.add_argument("--tp", type=int, default=d.tp, metavar="N",
                   help="tensor-parallel degree: 1, 2, 4 or 8 (default %(default)s)")
    p.add_argument("--engine", default=d.engine, metavar="|".join(ENGINES),
                   help="reference: PyTorch + torch.distributed; interpreter: the instruction "
                        "stream on the CPU; megakernel: the CUDA megakernel (default %(default)s)")
    p.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when a GPU is visible (default %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on cpu, bfloat16 on cuda (default %(default)s)")
    p.add_argument("--launcher", default=None, choices=LAUNCHERS,
                   help="where the ranks run; default: inline when tp=1 or the engine holds "
                        "every rank in one process (interpreter, megakernel), else local")
    p.add_argument("--page-size", type=int, default=d.page_size, metavar="T",
                   help="tokens per KV-cache page, a power of two (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=d.max_batch, metavar="B",
                   help="most sequences per step; the engines build batch buckets 1, 2, 4, .. "
                        "up to it (CUDA graphs, schedules) and run each step on the smallest "
                        "that holds it (default %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=d.max_seq_len, metavar="T",
                   help="longest prompt + generated tokens (default %(default)s)")
    p.add_argument("--num-pages", type=int, default=0, metavar="P",
                   help="KV-cache pages per rank; 0: enough for max-batch sequences of "
                        "max-seq-len (default)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="decode eagerly on GPU (reference engine)")
    p.add_argument("--reduce", default=d.reduce, choices=REDUCE_CHOICES,
                   help="interpreter / megakernel: how the o_proj and down partial sums meet; "
                        "oneshot: every rank pushes to every rank (one hop), rsag: "
                        "reduce-scatter to each tile's owner + all-gather, auto: whichever an "
                        "NVLink cost model says is faster at each batch bucket (default %(default)s)")
    p.add_argument("--megakernel-max-batch", type=int, default=d.megakernel_max_batch, metavar="B",
                   help="interpreter / megakernel: steps of more than B sequences decode through "
                        "the reference engine (torch + CUDA graphs) on the same KV cache, where "
                        "cuBLAS beats the megakernel's tensor-core path; 0: every step in the "
                        "megakernel (default %(default)s)")
    p.add_argument("--profile", default="", metavar="TRACE.json",
                   help="megakernel: write per-instruction start/end times of the latest decode "
                        "step it ran as a Chrome trace (open in chrome://tracing or Perfetto)")


def runtime_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """RuntimeConfig from the add_runtime_args flags; errors name the flag."""
    if args.engine not in ENGINES and ":" not in args.engine:
        raise ValueError(f"--engine {args.engine!r} is unknown; use one of {', '.join(ENGINES)}")
    if args.profile and args.engine != "megakernel":
        raise ValueError(f"--profile needs --engine megakernel (got --engine {args.engine}): "
                         "only the megakernel records per-instruction timestamps")
    if args.reduce not in ("auto", "oneshot") and args.engine not in ("interpreter", "megakernel"):
        raise ValueError(f"--reduce {args.reduce} needs --engine interpreter or megakernel (got "
                         f"--engine {args.engine}): only the instruction stream has the choice")
    return RuntimeConfig(
        tp=args.tp, device=args.device, dtype=args.dtype, engine=args.engine,
        page_size=args.page_size, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
        num_pages=args.num_pages, cuda_graphs=args.cuda_graphs,
        seed=getattr(args, "seed", None) or 0, profile=args.profile, reduce=args.reduce,
        megakernel_max_batch=args.megakernel_max_batch)
