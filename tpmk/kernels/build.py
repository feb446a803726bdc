"""Run-time CUDA C++ compilation with NVRTC (cuda-python), cached on disk.

API (small and stable; shared by tpmk.comm and the megakernel):

    compile_to_cubin(source_or_path, name=None, options=(), arch="sm_90a") -> bytes
        Needs no GPU (CI compiles every csrc/*.cu for sm_90a on a CPU machine).
    compile_module(source_or_path, name, options=(), arch=None) -> Module
        Compiles for the current device (arch=None: sm_90a on Hopper, anything else
        refused with a clear message), loads the cubin into the current CUDA context;
        `Module.function(entry)` returns the CUfunction to launch.
    launch(function, grid, block, params, stream=0, shmem=0, cooperative=False)
        `params`: ctypes objects, one per kernel parameter, in order, or a KernelArgs
        built from them once (reused across launches).
    source_variants(path) -> list[tuple[str, ...]]
        The option sets a .cu file declares in a `// nvrtc-variants: A ; B` line
        (`<default>` = no extra option); CI compiles every variant of every csrc/*.cu.

The cache key is a sha256 of: source text, every header in the include roots
that the source can reach (csrc/ by default), options, arch, NVRTC version. A cubin
built by a newer NVRTC may not load on an older driver, so build on the machine
that runs it (the device machine builds at run time; its NVRTC is 13.0).
Cache directory: $TPMK_CACHE or ~/.cache/tpmk.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
BASE_OPTIONS = ("-std=c++17", "-lineinfo")
HEADER_SUFFIXES = (".cu", ".cuh", ".h")


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries NVRTC's log."""


def _check(res, what: str):
    """cuda.bindings calls return (err, *values): raise on err, return the values."""
    err = res[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return None if len(res) == 1 else res[1] if len(res) == 2 else res[1:]


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc
    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def include_dirs() -> list[str]:
    """csrc/, then CUDA headers (cuda_bf16.h, cuda/atomic) from the pip wheels found by
    cuda.pathfinder, then a system toolkit. NVRTC 13.0 has no built-in cuda_bf16.h."""
    dirs = [str(CSRC)]
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        for lib in ("cudart", "cccl"):
            d = find_nvidia_header_directory(lib)
            if d and str(d) not in dirs:
                dirs.append(str(d))
    except Exception:  # noqa: BLE001 - no pathfinder / no wheel: try a toolkit below
        pass
    for d in ("/usr/local/cuda/include", "/usr/local/cuda/include/cccl"):
        if Path(d).is_dir() and d not in dirs:
            dirs.append(d)
    return dirs


def _read_source(source_or_path, name: str | None) -> tuple[str, str, list[Path]]:
    """-> (source text, program name, include roots to hash)."""
    if isinstance(source_or_path, Path) or (
            isinstance(source_or_path, str) and "\n" not in source_or_path
            and source_or_path.endswith(HEADER_SUFFIXES)):
        path = Path(source_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"CUDA source {path} does not exist")
        roots = [path.parent] + ([CSRC] if path.parent.resolve() != CSRC.resolve() else [])
        return path.read_text(), name or path.name, roots
    return str(source_or_path), name or "tpmk_kernel.cu", [CSRC]


def _cache_key(src: str, opts: list[str], arch: str, roots: list[Path]) -> str:
    """Everything the cubin depends on: NVRTC, arch, options, the source, every header under
    `roots` (csrc/ and the folders of `-I` options given by the caller), and a fingerprint of
    the CUDA header folders (include_dirs(): thousands of files, so their listing with sizes
    and times rather than their bytes; a wheel upgrade rewrites them)."""
    h = hashlib.sha256()
    h.update(repr((nvrtc_version(), arch, opts)).encode())
    h.update(src.encode())
    for root in roots:
        for f in sorted(p for p in root.rglob("*") if p.suffix in HEADER_SUFFIXES):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    hashed = {Path(r).resolve() for r in roots}
    for d in include_dirs():
        if Path(d).resolve() in hashed:
            continue
        for f in sorted(Path(d).iterdir()):
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def _include_roots(options) -> list[Path]:
    """The folders of the caller's -I options (-Idir or -I dir): their headers are hashed."""
    opts, out = list(options), []
    for i, o in enumerate(opts):
        d = o[2:] if o.startswith("-I") and len(o) > 2 else opts[i + 1] if o == "-I" and i + 1 < len(opts) else None
        if d and Path(d).is_dir():
            out.append(Path(d))
    return out


def source_variants(path) -> list[tuple[str, ...]]:
    for line in Path(path).read_text().splitlines():
        if line.startswith("// nvrtc-variants:"):
            variants = [v.strip() for v in line.split(":", 1)[1].split(";")]
            return [() if v in ("", "<default>") else tuple(v.split()) for v in variants]
    return [()]


def cache_dir() -> Path:
    return Path(os.environ.get("TPMK_CACHE", Path.home() / ".cache" / "tpmk"))


def compile_to_cubin(source_or_path, name: str | None = None, options=(), arch: str = "sm_90a",
                     use_cache: bool = True) -> bytes:
    """CUDA C++ (text, or a path to a .cu file) -> cubin bytes for `arch`."""
    src, prog_name, roots = _read_source(source_or_path, name)
    opts = _nvrtc_options(arch, options)
    key = _cache_key(src, opts, arch, roots + _include_roots(options))
    cache = cache_dir() / f"{Path(prog_name).stem}_{arch}_{key}.cubin"
    if use_cache and cache.exists():
        return cache.read_bytes()
    cubin, _ = _nvrtc(src, prog_name, opts, arch, options)
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        tmp.replace(cache)   # atomic: concurrent ranks may compile the same source
    return cubin


def _nvrtc_options(arch: str, options) -> list[str]:
    return [f"--gpu-architecture={arch}", *BASE_OPTIONS, *options, *(f"-I{d}" for d in include_dirs())]


def _nvrtc(src: str, prog_name: str, opts: list[str], arch: str, options) -> tuple[bytes, str]:
    """One NVRTC compile -> (cubin, NVRTC's log)."""
    from cuda.bindings import nvrtc
    prog = _check(nvrtc.nvrtcCreateProgram(src.encode(), prog_name.encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log_size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * log_size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip(chr(0))
        if int(res[0]) != 0:
            raise CompileError(f"NVRTC {nvrtc_version()} failed to compile {prog_name} for {arch} "
                               f"with options {list(options)}:\n{log}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log


def ptxas_report(source_or_path, name: str | None = None, options=(), arch: str = "sm_90a") -> str:
    """ptxas's -v report of one compile (not cached): per function its stack frame, spill
    bytes and registers (tpmk.kernels.sass.stack_frames reads it)."""
    src, prog_name, _ = _read_source(source_or_path, name)
    return _nvrtc(src, prog_name, _nvrtc_options(arch, (*options, "--ptxas-options=-v")), arch, options)[1]


def ensure_context(device: int | None = None):
    """Make the device's primary context (the one torch uses) current on this thread."""
    from cuda.bindings import driver as cu
    _check(cu.cuInit(0), "cuInit")
    if device is None:
        import torch
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    dev = _check(cu.cuDeviceGet(int(device)), "cuDeviceGet")
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev


def device_arch(device: int | None = None) -> str:
    """'sm_90a' on Hopper; any other GPU is refused with the reason."""
    from cuda.bindings import driver as cu
    dev = ensure_context(device)
    attr = cu.CUdevice_attribute
    major = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc")
    minor = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc")
    if (major, minor) != (9, 0):
        name = _check(cu.cuDeviceGetName(64, dev), "cuDeviceGetName").split(b"\0")[0].decode()
        raise RuntimeError(f"tpmk kernels are built for sm_90a (Hopper: H100/H200); GPU {device} "
                           f"({name}) is sm_{major}{minor}. Use the reference engine (NCCL) there.")
    return "sm_90a"


@dataclass
class Module:
    """A loaded cubin. Kept alive as long as its functions are used."""
    handle: object
    name: str

    def function(self, entry: str):
        from cuda.bindings import driver as cu
        return _check(cu.cuModuleGetFunction(self.handle, entry.encode()),
                      f"cuModuleGetFunction({entry!r} in {self.name})")

    def unload(self):
        from cuda.bindings import driver as cu
        if self.handle is not None:
            cu.cuModuleUnload(self.handle)
            self.handle = None


def compile_module(source_or_path, name: str | None = None, options=(), arch: str | None = None,
                   device: int | None = None) -> Module:
    """Compile (or fetch from the cache) and load into the current device's context."""
    from cuda.bindings import driver as cu
    arch = arch or device_arch(device)
    ensure_context(device)
    cubin = compile_to_cubin(source_or_path, name, options, arch)
    handle = _check(cu.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
    return Module(handle, name or str(source_or_path)[:40])


_LAUNCH_CONFIGS: dict = {}


class KernelArgs:
    """ctypes kernel parameters plus the void*[] that cuLaunchKernelEx reads; build once
    and launch many times (saves host time on every call)."""

    def __init__(self, params):
        self.params = list(params)
        self._ptrs = (ctypes.c_void_p * len(self.params))(*[ctypes.addressof(p) for p in self.params])
        self.address = ctypes.addressof(self._ptrs)


def launch(function, grid: int, block: int, params, stream=0, shmem: int = 0,
           cooperative: bool = False):
    """Launch with ctypes parameters. cooperative=True guarantees every block is resident
    at once (virtual TP spins across blocks) and fails loudly if the grid cannot fit."""
    from cuda.bindings import driver as cu
    args = params if isinstance(params, KernelArgs) else KernelArgs(params)
    key = (grid, block, shmem, int(stream), cooperative)
    cfg = _LAUNCH_CONFIGS.get(key)
    if cfg is None:
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
        cfg.sharedMemBytes, cfg.hStream = shmem, cu.CUstream(int(stream))
        if cooperative:  # cuLaunchKernelEx + attribute: also valid inside CUDA-graph capture
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            cfg.attrs, cfg.numAttrs = [attr], 1
        else:
            cfg.numAttrs = 0
        if len(_LAUNCH_CONFIGS) > 256:
            _LAUNCH_CONFIGS.clear()
        _LAUNCH_CONFIGS[key] = cfg
    _check(cu.cuLaunchKernelEx(cfg, function, args.address, 0),
           f"launch(grid={grid}, block={block}, cooperative={cooperative})")
