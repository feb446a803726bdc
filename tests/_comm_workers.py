"""Process entry points for tests/test_comm.py (importable by spawned children)."""
import json
import os

import torch
import torch.distributed as dist


def _init(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)


def exchange_worker(rank, world_size, init_file, out_dir):
    """CPU: publish a fake record through the gloo rendezvous, write what came back."""
    from tpmk.comm import handles
    _init(rank, world_size, init_file)
    mine = handles.PeerRecord(rank, world_size, "node0", os.getpid(), f"0000:{rank:02x}:00.0",
                              (world_size, 4, 4096, 123), bytes([rank]) * handles.IPC_HANDLE_BYTES)
    records = handles.exchange(handles.gloo_all_gather(None), mine)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump([[r.rank, r.pci_bus_id, r.handle.hex()] for r in records], f)
    dist.destroy_process_group()


def ipc_allreduce_worker(rank, world_size, init_file, out_dir, sizes):
    """GPU: several processes on GPU 0 exchange arenas by CUDA IPC and all-reduce."""
    from tpmk.comm.allreduce import Communicator
    _init(rank, world_size, init_file)
    torch.cuda.set_device(0)
    comm = Communicator.from_group(None, slot_bytes=1 << 20, blocks_per_rank=2, timeout_s=60.0)
    result = {}
    for n in sizes:
        for algo in ("one_shot", "two_shot"):
            g = torch.Generator().manual_seed(1000 * n + rank)
            x = torch.randn(n, generator=g).to(torch.bfloat16).cuda()
            comm(x) if algo == "one_shot" else comm.all_reduce(x, algo=algo)
            comm.check()
            result[f"{n}_{algo}"] = x.view(torch.int16).cpu().tolist()
    comm.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def peer_region_worker(rank, world_size, init_file, out_dir):
    """GPU: each process writes its rank into slot[rank] of every peer's region buffer
    through the mapped base + offset, then reads what its own buffer received."""
    import struct
    from cuda.bindings import driver as cu
    from tpmk.comm.region import PeerRegion
    from tpmk.kernels.build import _check
    _init(rank, world_size, init_file)
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    region = PeerRegion({"pad": ((37,), torch.int32), "slots": ((world_size, 4), torch.float32)}, dev, None)
    bases = region.open_peers()
    row = struct.pack("<4f", *[float(rank + 1)] * 4)   # this rank's row in every peer's slots
    for base in bases:
        _check(cu.cuMemcpyHtoD(base + region.offsets["slots"] + 16 * rank, row, len(row)), "cuMemcpyHtoD")
    torch.cuda.synchronize()
    dist.barrier()
    got = region.tensors["slots"].cpu().tolist()
    region.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()
