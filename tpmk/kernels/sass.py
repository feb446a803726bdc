"""The compiled megakernel read statically, without a GPU: nvdisasm's SASS with line info,
and its register spills (STL / LDL that nvdisasm marks SpillRefill) per source line.

A spilled load stalls its consumer for the load's whole round trip: attention's per-thread
K/V loads did, until they went through shared memory. tests/test_sass.py keeps ops free of
spills where they must be; this CLI shows where the others have theirs.

  python -m tpmk.kernels.sass                  # bf16 build: spills per file, then the top lines
  python -m tpmk.kernels.sass --f32 --top 40
  python -m tpmk.kernels.sass --frames         # ptxas's stack frame per function
nvdisasm comes from the nvidia-cuda-nvdisasm wheel (the `cuda` extra) or a CUDA toolkit.
"""
from __future__ import annotations

import argparse
import re
import signal
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

LINE_INFO = re.compile(r'//## File "([^"]+)", line (\d+)')


def nvdisasm_path() -> str:
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
        found = find_nvidia_binary_utility("nvdisasm")
    except ImportError:
        found = None
    found = found or shutil.which("nvdisasm") or (
        "/usr/local/cuda/bin/nvdisasm" if Path("/usr/local/cuda/bin/nvdisasm").exists() else None)
    if not found:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm "
                                "(or put a CUDA toolkit's bin/ on PATH)")
    return found


def disassemble(cubin: bytes) -> str:
    """SASS of every function, each instruction after a `//## File "...", line N` comment."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm_path(), "-g", "-c", f.name], check=True,
                              capture_output=True, text=True).stdout


def spills_by_line(sass: str) -> Counter:
    """(source file name, line) -> spill stores and reloads attributed to it."""
    where, out = None, Counter()
    for line in sass.splitlines():
        m = LINE_INFO.search(line)
        if m:
            where = (Path(m.group(1)).name, int(m.group(2)))
        elif "SpillRefill" in line and re.search(r"\b(STL|LDL)\b", line):
            out[where] += 1
    return out


FRAME = re.compile(r"Function properties for (\S+)\s*\n\s*ptxas\s+\.\s+(\d+) bytes stack frame, "
                   r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def stack_frames(report: str) -> dict[str, tuple[int, int, int]]:
    """ptxas -v report (tpmk.kernels.build.ptxas_report) -> {function: (stack frame, spill
    store, spill load bytes)}; the entry `megakernel`'s frame is the whole call tree's
    (callees save the caller's registers there)."""
    return {m.group(1): tuple(int(g) for g in m.group(2, 3, 4)) for m in FRAME.finditer(report)}


def megakernel_frames(dtype, defines: tuple[str, ...] = ()) -> dict[str, tuple[int, int, int]]:
    from tpmk.kernels.build import CSRC, ptxas_report
    from tpmk.kernels.megakernel import megakernel_options
    return stack_frames(ptxas_report(CSRC / "megakernel.cu", options=megakernel_options(dtype, defines)))


def main() -> None:
    import torch
    from tpmk.kernels.megakernel import compile_megakernel
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--f32", action="store_true", help="the float32 build (MK_FLOAT32)")
    ap.add_argument("--define", nargs="*", action="extend", default=[], metavar="NAME=VALUE",
                    help="kernel macros; repeatable (--define A=1 --define B=2 or --define A=1 B=2)")
    ap.add_argument("--top", type=int, default=20, help="source lines to list")
    ap.add_argument("--frames", action="store_true",
                    help="ptxas's stack frame and spill bytes per function instead (a compile of its own)")
    args = ap.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # `| head` ends the listing quietly
    dtype = torch.float32 if args.f32 else torch.bfloat16
    if args.frames:
        for fn, (frame, st, ld) in megakernel_frames(dtype, tuple(args.define)).items():
            print(f"{frame:6d} bytes stack frame {st:5d} / {ld:5d} bytes spill stores / loads  {fn}")
        return
    cubin = compile_megakernel(dtype, defines=tuple(args.define))
    spills = spills_by_line(disassemble(cubin))
    per_file = Counter()
    for (name, _), n in spills.items():
        per_file[name] += n
    print(f"{sum(spills.values())} spill stores + reloads")
    for name, n in per_file.most_common():
        print(f"  {n:5d}  {name}")
    print(f"top {args.top} lines:")
    for (name, line), n in spills.most_common(args.top):
        print(f"  {n:5d}  {name}:{line}")


if __name__ == "__main__":
    main()
