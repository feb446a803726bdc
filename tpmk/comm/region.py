"""PeerRegion: named device buffers that peer processes write, in one IPC-exportable block.

One cuMemAlloc allocation per process (a CUDA IPC handle covers exactly one), zeroed,
cut into 256-byte-aligned buffers at the same offsets on every rank, so a peer's buffer
is the peer's mapped base + the offset. Handles travel through tpmk.comm.handles (the
same records, validation and peer-access check as the all-reduce arenas).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpmk.comm import handles, topology


class _CudaArray:
    """A device pointer seen by torch.as_tensor (__cuda_array_interface__, zero-copy)."""

    def __init__(self, ptr: int, shape: tuple, dtype: torch.dtype):
        typestr = {torch.float32: "<f4", torch.int32: "<i4", torch.int16: "<i2"}[dtype]
        self.__cuda_array_interface__ = dict(data=(ptr, False), shape=tuple(shape), typestr=typestr,
                                             strides=None, version=3)


@dataclass(frozen=True)
class RegionLayout:
    """What a PeerRecord says about a region (every rank's must be the same)."""
    world_size: int
    buffers: tuple   # ((name, shape, dtype), ...)

    def signature(self) -> tuple:
        return ("peer-region",) + self.buffers


class PeerRegion:
    """spec {name: (shape, dtype)} -> zeroed torch views `tensors` and byte `offsets`.
    `group`: the torch.distributed group (rank i = TP rank i) whose ranks map each other's
    regions; open_peers() and close() are collective over it."""

    def __init__(self, spec: dict, dev: torch.device, group):
        from cuda.bindings import driver as cu
        from tpmk.kernels.build import _check
        self.group, self.dev, self.opened = group, dev, []
        self.offsets, buffers, total = {}, [], 0
        for name, (shape, dt) in spec.items():
            self.offsets[name] = total
            buffers.append((name, tuple(shape), str(dt)))
            total += (math.prod(shape) * torch.empty((), dtype=dt).element_size() + 255) // 256 * 256
        self.buffers, self.nbytes = tuple(buffers), total
        self.ptr = int(_check(cu.cuMemAlloc(total), f"cuMemAlloc({total} B peer region)"))
        _check(cu.cuMemsetD8(self.ptr, 0, total), "cuMemsetD8(peer region)")
        self.tensors = {name: torch.as_tensor(_CudaArray(self.ptr + self.offsets[name], shape, dt), device=dev)
                        for name, (shape, dt) in spec.items()}

    def open_peers(self) -> list[int]:
        """Every rank's region base, mapped into this process (this rank's own at its index)."""
        import torch.distributed as dist
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        gather = handles.gloo_all_gather(self.group)
        bus = topology.pci_bus_id(self.dev.index)
        mine = handles.export_record(self.ptr, RegionLayout(world, self.buffers), rank, bus)
        records = handles.exchange(gather, mine)
        topology.require_peer_access(bus, [r.pci_bus_id for r in records])
        bases = []
        for r in records:
            bases.append(self.ptr if r.rank == rank else handles.open_record(r))
            if r.rank != rank:
                self.opened.append(bases[-1])
        gather("opened")   # every rank has mapped every region before anyone writes
        return bases

    def close(self) -> None:
        """Collective: once every rank is past its last kernel, unmap the peers, free ours."""
        from cuda.bindings import driver as cu
        handles.gloo_all_gather(self.group)("closing")
        for ptr in self.opened:
            handles.close_peer(ptr)
        self.opened, self.tensors = [], {}
        if self.ptr:
            cu.cuMemFree(self.ptr)
            self.ptr = 0
