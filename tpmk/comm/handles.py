"""Export / exchange / open the arenas of peer processes (one process per GPU).

Handle kind: legacy CUDA IPC memory handles (cuIpcGetMemHandle), not VMM POSIX fds.
Reason: an IPC handle is 64 plain bytes, so it travels through any object
rendezvous (torch.distributed all_gather_object on the gloo group that the local,
Ray and MPI launchers all provide); a POSIX fd only survives a Unix-socket
SCM_RIGHTS side channel (or pidfd_getfd, which needs ptrace rights), i.e.
launcher-specific plumbing. The price: the arena must be one cuMemAlloc
allocation (DeviceArena), not a torch caching-allocator block.

The rendezvous is any `all_gather(obj) -> list[obj]` callable; `gloo_all_gather(group)`
adapts an initialized torch.distributed group.
"""
from __future__ import annotations

import ctypes
import os
import socket
from dataclasses import dataclass
from typing import Callable

from tpmk.comm.arena import ArenaLayout

IPC_HANDLE_BYTES = 64
AllGather = Callable[[object], list]


@dataclass(frozen=True)
class PeerRecord:
    """What one rank publishes about its arena (picklable, plain data)."""
    rank: int
    world_size: int
    host: str
    pid: int
    pci_bus_id: str              # the GPU holding the arena, e.g. "0000:19:00.0"
    layout: tuple                # ArenaLayout.signature()
    handle: bytes                # cuIpcGetMemHandle, IPC_HANDLE_BYTES


def gloo_all_gather(group) -> AllGather:
    """Rendezvous through an initialized torch.distributed group (gloo is enough)."""
    import torch.distributed as dist

    def all_gather(obj):
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return all_gather


def validate_records(records: list[PeerRecord], rank: int, world_size: int) -> None:
    """Every rank must see the same world, one record per rank, one host, one layout."""
    if len(records) != world_size:
        raise ValueError(f"rendezvous returned {len(records)} records for world_size={world_size}")
    for i, r in enumerate(records):
        if r.rank != i:
            raise ValueError(f"record {i} claims rank {r.rank}: ranks of the group and of the "
                             f"communicator disagree (pass the group whose rank i is TP rank i)")
        if r.world_size != world_size:
            raise ValueError(f"rank {i} built its arena for world_size={r.world_size}, "
                             f"rank {rank} for {world_size}")
        if r.layout != records[rank].layout:
            raise ValueError(f"arena layout differs: rank {i} {r.layout} vs rank {rank} "
                             f"{records[rank].layout}; give every rank the same slot_bytes/blocks")
        if r.host != records[rank].host:
            raise ValueError(f"rank {i} is on host {r.host!r}, rank {rank} on {records[rank].host!r}: "
                             f"peer memory works inside one node only (TP stays in an NVLink domain)")
        if len(r.handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"rank {i} sent a {len(r.handle)}-byte IPC handle, expected {IPC_HANDLE_BYTES}")
    pids = [r.pid for r in records]
    if len(set(pids)) != len(pids):
        raise ValueError(f"two ranks share a process (pids {pids}): CUDA IPC cannot open a handle "
                         f"in the process that exported it; use Communicator.virtual for N ranks "
                         f"in one process")


def export_record(arena_ptr: int, layout: ArenaLayout, rank: int, pci_bus_id: str) -> PeerRecord:
    from cuda.bindings import driver as cu
    from tpmk.kernels.build import _check
    h = _check(cu.cuIpcGetMemHandle(arena_ptr), "cuIpcGetMemHandle(arena)")
    raw = ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)
    return PeerRecord(rank, layout.world_size, socket.gethostname(), os.getpid(), pci_bus_id,
                      layout.signature(), raw)


def open_record(rec: PeerRecord) -> int:
    """Map a peer's arena into this process; returns its device pointer here."""
    from cuda.bindings import driver as cu
    from tpmk.kernels.build import _check
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), rec.handle, IPC_HANDLE_BYTES)
    flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return int(_check(cu.cuIpcOpenMemHandle(h, flags),
                      f"cuIpcOpenMemHandle(arena of rank {rec.rank}, GPU {rec.pci_bus_id})"))


def close_peer(ptr: int) -> None:
    from cuda.bindings import driver as cu
    cu.cuIpcCloseMemHandle(ptr)


def exchange(all_gather: AllGather, mine: PeerRecord) -> list[PeerRecord]:
    """One collective: every rank gets every rank's record, validated."""
    records = all_gather(mine)
    validate_records(records, mine.rank, mine.world_size)
    return records
