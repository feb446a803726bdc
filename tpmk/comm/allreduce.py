"""bf16 all-reduce over peer memory (kernel: tpmk/kernels/csrc/allreduce.cu).

Two modes, one kernel:
  Communicator.virtual(world_size)   N ranks in this process on one GPU, one cooperative
                                     launch split into N rank groups; arenas are plain
                                     device buffers. `comm.all_reduce_virtual(tensors)`.
  Communicator.from_group(group)     one rank per process (one GPU each, or several
                                     processes on one GPU for the handle-exchange test);
                                     arenas exchanged once as CUDA IPC handles through the
                                     group's all_gather_object. `comm(tensor)` is a drop-in
                                     for torch.distributed.all_reduce(tensor) (SUM, bf16).
Algorithms: "one_shot" (push whole tensor to every peer, each rank reduces it all:
latency), "two_shot" (reduce-scatter + all-gather: bandwidth), "auto" picks by size.
Every rank sums in rank order 0..W-1 in fp32: results are bit-identical across ranks.
A wait that times out records (rank, peer, flag, expected, seen); the next call (or
`check()`) raises CommError with it and the communicator stays unusable.
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch

from tpmk.comm import handles, topology
from tpmk.comm.arena import MAX_RANKS, ArenaLayout, DeviceArena, ErrorBlock, ErrorInfo
from tpmk.kernels import build

SOURCE = build.CSRC / "allreduce.cu"
ENTRY = "tpmk_allreduce_bf16"
THREADS = 512                      # must match allreduce.cu TPMK_THREADS
ALGOS = {"one_shot": 0, "two_shot": 1}
_U64 = ctypes.c_uint64
_BF16 = torch.bfloat16


class CommError(RuntimeError):
    """An in-kernel wait timed out; the message carries the kernel's error record."""

    def __init__(self, info: ErrorInfo, timeout_s: float):
        super().__init__(info.message(timeout_s))
        self.info = info


class _Params(ctypes.Structure):
    """Must match struct AllReduceParams in allreduce.cu (tests compare names and size)."""
    _fields_ = [("peers", _U64 * MAX_RANKS), ("inputs", _U64 * MAX_RANKS),
                ("outputs", _U64 * MAX_RANKS), ("err", _U64), ("alarm", _U64), ("n", _U64),
                ("slot_bytes", _U64), ("flags_offset", _U64), ("epochs_offset", _U64),
                ("data_offset", _U64), ("timeout_ns", _U64),
                ("world_size", ctypes.c_int), ("local_ranks", ctypes.c_int), ("rank0", ctypes.c_int),
                ("blocks_per_rank", ctypes.c_int), ("max_blocks", ctypes.c_int), ("algo", ctypes.c_int),
                ("absent_rank", ctypes.c_int), ("pad", ctypes.c_int)]


_MODULES: dict = {}


def _function(device: int, gpu_scope: bool):
    """Compiled once per (device, scope) per process; NVRTC output cached on disk."""
    key = (device, gpu_scope)
    if key not in _MODULES:
        opts = ("-DTPMK_COMM_GPU_SCOPE",) if gpu_scope else ()
        mod = build.compile_module(SOURCE, "allreduce.cu", opts, device=device)
        _MODULES[key] = (mod, mod.function(ENTRY))
    return _MODULES[key][1]


def pick_algo(nbytes: int, one_shot_max_bytes: int) -> str:
    return "one_shot" if nbytes <= one_shot_max_bytes else "two_shot"


def default_one_shot_max_bytes(world_size: int) -> int:
    """One-shot moves (W-1)x more bytes than two-shot but needs one flag round instead of
    two. Crossover measured in virtual TP on an H200 (bench/results/comm_NVIDIA_H200.json):
    ~1-2 MiB at W=2, ~1 MiB at W=4, ~256-512 KiB at W=8, i.e. about 2 MiB / W. Re-measure
    on NVLink when a multi-GPU machine is lent."""
    return (2 << 20) // max(world_size, 1)


class Communicator:
    def __init__(self, layout: ArenaLayout, device: int, rank0: int, local_ranks: int,
                 peer_ptrs: list[int], arenas: list[DeviceArena], opened: list[int],
                 timeout_s: float, one_shot_max_bytes: int):
        self.layout, self.device, self.rank0, self.local_ranks = layout, device, rank0, local_ranks
        self.world_size = layout.world_size
        self.peer_ptrs, self.arenas, self.opened = peer_ptrs, arenas, opened
        self.timeout_s = timeout_s
        self.one_shot_max_bytes = (default_one_shot_max_bytes(self.world_size)
                                   if one_shot_max_bytes is None else one_shot_max_bytes)
        self.virtual_mode = local_ranks == self.world_size
        self.error = ErrorBlock()
        self.broken: CommError | None = None
        self._rendezvous = None     # per-process mode: the all_gather used at start
        self._plans: dict = {}      # (algo, absent, n, buffer pointers) -> kernel args per chunk
        # one GPU for every rank of the launch -> .gpu scope; otherwise .sys
        self.fn = _function(device, gpu_scope=self.virtual_mode)

    # ---- construction -------------------------------------------------------------
    @staticmethod
    def _layout(world_size: int, blocks_per_rank: int | None, slot_bytes: int, device: int,
                virtual: bool) -> ArenaLayout:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if blocks_per_rank is None:
            blocks_per_rank = max(1, min(32, sms // world_size)) if virtual else 32
        if virtual and blocks_per_rank * world_size > sms:
            raise ValueError(f"virtual TP: {world_size} ranks x {blocks_per_rank} blocks > {sms} SMs; "
                             f"lower blocks_per_rank")
        return ArenaLayout(world_size, blocks_per_rank, slot_bytes)

    @classmethod
    def virtual(cls, world_size: int, device: int | None = None, slot_bytes: int = 16 << 20,
                blocks_per_rank: int | None = None, timeout_s: float = 10.0,
                one_shot_max_bytes: int | None = None) -> "Communicator":
        """N ranks in this process on one GPU (rank groups of one cooperative launch)."""
        device = torch.cuda.current_device() if device is None else device
        layout = cls._layout(world_size, blocks_per_rank, slot_bytes, device, virtual=True)
        build.ensure_context(device)
        arenas = [DeviceArena(layout) for _ in range(world_size)]
        return cls(layout, device, 0, world_size, [a.ptr for a in arenas], arenas, [],
                   timeout_s, one_shot_max_bytes)

    @classmethod
    def from_group(cls, group=None, device: int | None = None, slot_bytes: int = 16 << 20,
                   blocks_per_rank: int | None = None, timeout_s: float = 10.0,
                   one_shot_max_bytes: int | None = None, all_gather=None) -> "Communicator":
        """One rank per process; `group` is an initialized torch.distributed group (gloo is
        enough) whose rank i is TP rank i. `all_gather` overrides the rendezvous."""
        import torch.distributed as dist
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        device = torch.cuda.current_device() if device is None else device
        layout = cls._layout(world_size, blocks_per_rank, slot_bytes, device, virtual=False)
        build.ensure_context(device)
        arena = DeviceArena(layout)
        my_bus = topology.pci_bus_id(device)
        mine = handles.export_record(arena.ptr, layout, rank, my_bus)
        records = handles.exchange(all_gather or handles.gloo_all_gather(group), mine)
        topology.require_peer_access(my_bus, [r.pci_bus_id for r in records])
        ptrs, opened = [], []
        try:
            for r in records:
                ptrs.append(arena.ptr if r.rank == rank else handles.open_record(r))
                if r.rank != rank:
                    opened.append(ptrs[-1])
        except Exception:
            for p in opened:
                handles.close_peer(p)
            arena.free()
            raise
        comm = cls(layout, device, rank, 1, ptrs, [arena], opened, timeout_s, one_shot_max_bytes)
        comm._rendezvous = all_gather or handles.gloo_all_gather(group)
        comm._rendezvous("opened")  # every peer mapped before anyone can close
        return comm

    def close(self):
        """Unmap peers, free arenas. Collective in per-process mode: call on every rank
        after its last all-reduce (no rank frees an arena a peer may still write or map)."""
        if not self.arenas:
            return
        torch.cuda.synchronize(self.device)
        if self._rendezvous:
            self._rendezvous("kernels done")
        for p in self.opened:
            handles.close_peer(p)
        if self._rendezvous:
            self._rendezvous("peers unmapped")
        for a in self.arenas:
            a.free()
        self.error.free()
        self.opened, self.arenas = [], []

    # ---- errors ---------------------------------------------------------------------
    def _raise_if_alarmed(self):
        if self.broken is not None:
            raise self.broken
        if self.error.alarmed:
            torch.cuda.synchronize(self.device)
            self.broken = CommError(self.error.read(), self.timeout_s)
            raise self.broken

    def check(self):
        """Synchronize and raise CommError if any wait of any earlier call timed out."""
        torch.cuda.synchronize(self.device)
        self._raise_if_alarmed()
        info = self.error.read()
        if info.status:
            self.broken = CommError(info, self.timeout_s)
            raise self.broken

    # ---- all-reduce -----------------------------------------------------------------
    def pick_algo(self, nbytes: int) -> str:
        return pick_algo(nbytes, self.one_shot_max_bytes)

    def _validate(self, tensors: list[torch.Tensor]) -> int:
        n = tensors[0].numel()
        for r, t in enumerate(tensors):
            if t.dtype != torch.bfloat16:
                raise ValueError(f"tpmk all-reduce takes bfloat16 tensors; rank {self.rank0 + r} "
                                 f"gave {t.dtype} (cast, or use torch.distributed for other dtypes)")
            if t.device != torch.device("cuda", self.device):
                raise ValueError(f"tensor of rank {self.rank0 + r} is on {t.device}, "
                                 f"communicator on cuda:{self.device}")
            if t.numel() != n:
                raise ValueError(f"all ranks must reduce the same numel: {[x.numel() for x in tensors]}")
        return n

    def _params(self, ins: list[int], outs: list[int], n: int, algo: int, absent_rank: int) -> _Params:
        L = self.layout
        p = _Params()
        p.peers[:self.world_size] = self.peer_ptrs
        p.inputs[:len(ins)] = ins
        p.outputs[:len(outs)] = outs
        p.err, p.alarm, p.n, p.slot_bytes = self.error.dev, self.error.alarm_dev, n, L.slot_bytes
        p.flags_offset, p.epochs_offset, p.data_offset = L.flags_offset, L.epochs_offset, L.data_offset
        p.timeout_ns = int(self.timeout_s * 1e9)
        p.world_size, p.local_ranks, p.rank0 = self.world_size, self.local_ranks, self.rank0
        p.blocks_per_rank = p.max_blocks = L.max_blocks
        p.algo, p.absent_rank = algo, absent_rank
        return p

    def _plan(self, tensors, outputs, algo: str, absent_rank: int) -> list[build.KernelArgs]:
        """Validate once per (buffers, size, algo): one kernel-argument block per chunk."""
        if len(tensors) != self.local_ranks:
            raise ValueError(f"expected {self.local_ranks} tensors (one per local rank), got {len(tensors)}")
        if len(outputs) != len(tensors):
            raise ValueError(f"{len(outputs)} outputs for {len(tensors)} inputs")
        n = self._validate(list(tensors) + list(outputs))
        algo = self.pick_algo(2 * n) if algo == "auto" else algo
        if algo not in ALGOS:
            raise ValueError(f"algo={algo!r}; choose one of {list(ALGOS)} or 'auto'")
        chunk, plan = self.layout.chunk_elems, []
        for c0 in range(0, n, chunk):
            p = self._params([t.data_ptr() + 2 * c0 for t in tensors],
                             [t.data_ptr() + 2 * c0 for t in outputs],
                             min(chunk, n - c0), ALGOS[algo], absent_rank)
            plan.append(build.KernelArgs([p]))
        return plan

    def _run(self, tensors, outputs, algo: str, absent_rank: int = -1):
        if self.broken is not None or self.error.alarmed:
            self._raise_if_alarmed()
        everything = tensors if outputs is None else (*tensors, *outputs)
        n = tensors[0].numel()
        # one pass, cheap checks only; a plan is re-validated whenever anything differs
        key, usable = [algo, absent_rank, n], True
        for t in everything:
            ptr = t.data_ptr()
            key.append(ptr)
            usable &= t.is_contiguous() and ptr % 16 == 0 and t.dtype == _BF16 and t.numel() == n
        if not usable:
            self._run_unaligned(tensors, everything[len(tensors):] or tensors, algo, absent_rank)
            return
        if n == 0:
            return
        plan = self._plans.get(key := tuple(key))
        if plan is None:
            plan = self._plan(tensors, everything[len(tensors):] or tensors, algo, absent_rank)
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan
        stream = torch.cuda.current_stream(self.device).cuda_stream
        grid = self.local_ranks * self.layout.max_blocks
        for args in plan:
            build.launch(self.fn, grid, THREADS, args, stream, cooperative=self.virtual_mode)

    def _run_unaligned(self, tensors, outputs, algo: str, absent_rank: int):
        """16-byte vector access needs contiguous, 16-byte aligned buffers: copy, run, copy back."""
        self._validate(list(tensors) + list(outputs))
        work = [t.contiguous().clone() for t in tensors]
        self._run(work, None, algo, absent_rank)
        for o, w in zip(outputs, work):
            o.copy_(w.view(o.shape))

    def all_reduce_virtual(self, tensors: list[torch.Tensor], outputs: list[torch.Tensor] | None = None,
                           algo: str = "auto", absent_rank: int = -1):
        """outputs[r] (default: tensors[r], in place) <- sum over ranks of tensors[*], bf16.
        `absent_rank` is a test hook: that rank's blocks return at once, so the others
        must time out."""
        if not self.virtual_mode:
            raise RuntimeError("all_reduce_virtual needs Communicator.virtual; use comm(tensor)")
        self._run(tensors, outputs, algo, absent_rank)

    def all_reduce(self, tensor: torch.Tensor, algo: str = "auto"):
        """In place, one rank per process."""
        if self.virtual_mode and self.world_size > 1:
            raise RuntimeError("a virtual communicator reduces all ranks at once: all_reduce_virtual")
        self._run([tensor], None, algo)

    def __call__(self, tensor: torch.Tensor, op=None, group=None, async_op: bool = False):
        """Drop-in for torch.distributed.all_reduce(tensor, op=SUM, group, async_op)."""
        import torch.distributed as dist
        if op is not None and op != dist.ReduceOp.SUM:
            raise ValueError(f"tpmk all-reduce implements SUM only, got op={op}")
        self.all_reduce(tensor)
        return _Done() if async_op else None


class _Done:
    """Work handle for async_op=True: the kernel is already ordered on the current stream."""

    def wait(self):
        return True

    def is_completed(self):
        return True


def source_params_fields(path: Path = SOURCE) -> tuple[list[str], int]:
    """Field names and static_assert size of AllReduceParams as written in the .cu file
    (tests check them against _Params, the Python mirror)."""
    text = path.read_text()
    body = re.search(r"struct AllReduceParams \{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        _type, rest = decl.split(None, 1)
        names += [re.sub(r"\[.*\]", "", v).strip() for v in rest.split(",")]
    size = int(re.search(r"sizeof\(AllReduceParams\) == (\d+)", text).group(1))
    return names, size
