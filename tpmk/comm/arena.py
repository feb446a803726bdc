"""Per-rank communication arena: flag lines, epoch counters, receive slots.

One arena per rank, allocated once (cuMemAlloc, so it can be exported as a CUDA
IPC handle), zeroed once, never reset: flags and epochs only grow.

Layout (bytes from the arena base; the kernel gets these offsets as parameters,
so this class is the single source of truth):

    flags   [FLAG_KINDS][max_blocks][world_size]   u64 at the start of a 128-byte line
    epochs  [max_blocks]                            u64, one per block of this rank
    data    [2 parities][world_size + 1][slot_bytes]  slots 0..W-1 receive from rank src,
                                                       slot W is the all-gather buffer
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

FLAG_LINE = 128
FLAG_KINDS = ("data", "gather")          # must match allreduce.cu FLAG_DATA, FLAG_GATHER
MAX_RANKS = 8                            # must match allreduce.cu TPMK_MAX_RANKS
# ErrorRecord in comm.cuh: status, rank, peer, flag, block, pad (int32), expected, seen (u64)
ERROR_RECORD = struct.Struct("<6i2Q")
assert ERROR_RECORD.size == 40


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class ArenaLayout:
    world_size: int
    max_blocks: int
    slot_bytes: int

    def __post_init__(self):
        if not 1 <= self.world_size <= MAX_RANKS:
            raise ValueError(f"world_size={self.world_size} must be in 1..{MAX_RANKS}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks={self.max_blocks} must be >= 1")
        if self.slot_bytes < 4096 or self.slot_bytes % 4096:
            raise ValueError(f"slot_bytes={self.slot_bytes} must be a positive multiple of 4096")

    @property
    def flags_offset(self) -> int:
        return 0

    @property
    def flags_bytes(self) -> int:
        return len(FLAG_KINDS) * self.max_blocks * self.world_size * FLAG_LINE

    @property
    def epochs_offset(self) -> int:
        return _align(self.flags_offset + self.flags_bytes, FLAG_LINE)

    @property
    def data_offset(self) -> int:
        return _align(self.epochs_offset + 8 * self.max_blocks, 4096)

    @property
    def nbytes(self) -> int:
        return self.data_offset + 2 * (self.world_size + 1) * self.slot_bytes

    @property
    def chunk_elems(self) -> int:
        """bf16 elements one launch can carry (one slot holds a whole chunk)."""
        return self.slot_bytes // 2

    def flag_offset(self, kind: int, block: int, src: int) -> int:
        for name, v, hi in (("kind", kind, len(FLAG_KINDS)), ("block", block, self.max_blocks),
                            ("src", src, self.world_size)):
            if not 0 <= v < hi:
                raise ValueError(f"{name}={v} out of range 0..{hi - 1}")
        return self.flags_offset + ((kind * self.max_blocks + block) * self.world_size + src) * FLAG_LINE

    def slot_offset(self, parity: int, src: int) -> int:
        """src == world_size is the all-gather buffer."""
        if parity not in (0, 1) or not 0 <= src <= self.world_size:
            raise ValueError(f"parity={parity}, src={src} out of range")
        return self.data_offset + (parity * (self.world_size + 1) + src) * self.slot_bytes

    def signature(self) -> tuple:
        """Every rank must agree on this before peers touch each other's arenas."""
        return (self.world_size, self.max_blocks, self.slot_bytes, self.nbytes)


@dataclass(frozen=True)
class ErrorInfo:
    """A decoded ErrorRecord: a wait that timed out."""
    status: int
    rank: int
    peer: int
    flag: int
    block: int
    expected: int
    seen: int

    @classmethod
    def from_bytes(cls, raw: bytes) -> "ErrorInfo":
        status, rank, peer, flag, block, _pad, expected, seen = ERROR_RECORD.unpack(raw[:ERROR_RECORD.size])
        return cls(status, rank, peer, flag, block, expected, seen)

    def message(self, timeout_s: float) -> str:
        kind = FLAG_KINDS[self.flag] if 0 <= self.flag < len(FLAG_KINDS) else f"?{self.flag}"
        return (f"rank {self.rank} timed out after {timeout_s:g} s waiting for rank {self.peer}: "
                f"flag '{kind}' block {self.block} expected epoch >= {self.expected}, saw {self.seen}. "
                f"Rank {self.peer} did not reach this all-reduce (crashed, hung, or called a "
                f"different collective sequence); this communicator is unusable, create a new one.")


class DeviceArena:
    """One rank's arena in device memory (cuMemAlloc'd: exportable as a CUDA IPC handle)."""

    def __init__(self, layout: ArenaLayout):
        from cuda.bindings import driver as cu
        from tpmk.kernels.build import _check
        self.layout = layout
        self.ptr = int(_check(cu.cuMemAlloc(layout.nbytes), f"cuMemAlloc({layout.nbytes} B arena)"))
        _check(cu.cuMemsetD8(self.ptr, 0, layout.nbytes), "cuMemsetD8(arena)")

    def free(self):
        from cuda.bindings import driver as cu
        if self.ptr:
            cu.cuMemFree(self.ptr)
            self.ptr = 0


class ErrorBlock:
    """ErrorRecord in device memory + an alarm int in mapped pinned host memory, which the
    host reads without synchronizing (a set alarm means: synchronize and read the record)."""

    def __init__(self):
        from cuda.bindings import driver as cu
        from tpmk.kernels.build import _check
        self.dev = int(_check(cu.cuMemAlloc(ERROR_RECORD.size), "cuMemAlloc(error record)"))
        _check(cu.cuMemsetD8(self.dev, 0, ERROR_RECORD.size), "cuMemsetD8(error record)")
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self.host = int(_check(cu.cuMemHostAlloc(4, flags), "cuMemHostAlloc(alarm)"))
        ctypes.c_int.from_address(self.host).value = 0
        self.alarm_dev = int(_check(cu.cuMemHostGetDevicePointer(self.host, 0), "cuMemHostGetDevicePointer"))

    @property
    def alarmed(self) -> bool:
        return ctypes.c_int.from_address(self.host).value != 0

    def read(self) -> ErrorInfo:
        """Caller synchronizes first."""
        from cuda.bindings import driver as cu
        from tpmk.kernels.build import _check
        buf = bytearray(ERROR_RECORD.size)
        raw = (ctypes.c_char * ERROR_RECORD.size).from_buffer(buf)
        _check(cu.cuMemcpyDtoH(ctypes.addressof(raw), self.dev, ERROR_RECORD.size), "read error record")
        return ErrorInfo.from_bytes(bytes(buf))

    def free(self):
        from cuda.bindings import driver as cu
        if self.dev:
            cu.cuMemFree(self.dev)
            cu.cuMemFreeHost(self.host)
            self.dev = self.host = 0
