"""Peer-access checks: megakernel mode needs direct loads/stores between every GPU pair."""
from __future__ import annotations


class PeerAccessError(RuntimeError):
    """Some pair of GPUs cannot address each other's memory."""


def pci_bus_id(device: int) -> str:
    from cuda.bindings import driver as cu
    from tpmk.kernels.build import _check, ensure_context
    dev = ensure_context(device)
    return _check(cu.cuDeviceGetPCIBusId(32, dev), "cuDeviceGetPCIBusId").split(b"\0")[0].decode().lower()


def device_by_bus_id(bus_id: str) -> int | None:
    """Ordinal of the visible device with this PCI bus id, or None if not visible here."""
    from cuda.bindings import driver as cu
    err, dev = cu.cuDeviceGetByPCIBusId(bus_id.encode())
    return int(dev) if int(err) == 0 else None


def can_access_peer(a: int, b: int) -> bool:
    from cuda.bindings import driver as cu
    from tpmk.kernels.build import _check
    if a == b:
        return True
    return bool(_check(cu.cuDeviceCanAccessPeer(a, b), f"cuDeviceCanAccessPeer({a}, {b})"))


def require_peer_access(my_bus_id: str, peer_bus_ids: list[str], can_access=can_access_peer,
                        lookup=device_by_bus_id) -> None:
    """Raise PeerAccessError naming the pair when this GPU cannot reach a peer's GPU.
    Ranks on the same GPU (multi-process test mode) need no peer access."""
    me = lookup(my_bus_id)
    for rank, bus in enumerate(peer_bus_ids):
        if bus == my_bus_id:
            continue
        peer = lookup(bus)
        if peer is None:
            raise PeerAccessError(
                f"rank {rank}'s GPU {bus} is not visible from this process (GPU {my_bus_id}); "
                f"peer memory needs every GPU of the node visible in every worker: leave "
                f"CUDA_VISIBLE_DEVICES unset or identical on all ranks and select the GPU by index")
        if not can_access(me, peer):
            raise PeerAccessError(
                f"GPU {my_bus_id} cannot access GPU {bus} (rank {rank}) by peer-to-peer: "
                f"megakernel mode needs NVLink/P2P between every pair of GPUs. "
                f"Run the reference engine (NCCL) on this machine instead")
