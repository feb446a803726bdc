"""MPI launcher: `mpirun -n N tpmk generate|serve --launcher mpi ...`, one rank per GPU.

MPI is used for rendezvous only: rank 0 picks the torch.distributed address
and broadcasts it over MPI; the local rank (which GPU) comes from a
shared-memory split of COMM_WORLD. Rank 0 is the driver; it sends each
command to the other ranks with torch.distributed broadcast_object_list on a
gloo group with a long timeout (a server may sit idle for hours), then
executes it itself. Ranks other than 0 never return from `launch_mpi`: they
serve commands until Shutdown and exit.

Failure: a rank that fails prints its error and calls MPI Abort, which ends
every rank of the job (the others may be blocked in a collective). A driver
that sees an error raises WorkerError; its `close()` then aborts the job.
"""
from __future__ import annotations

import datetime
import os
import sys

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Command, Shutdown, StepResult, WorkerError
from tpmk.engine.worker import Worker, WorkerSpec
from tpmk.launcher.launch import free_port, host_ip

CONTROL_TIMEOUT = datetime.timedelta(days=30)


def _abort(comm, e: BaseException) -> None:
    """Bad input (a wrong flag or checkpoint) prints its message only, as the CLI does."""
    if isinstance(e, WorkerError) and e.input_error and not os.environ.get("TPMK_TRACEBACK"):
        text = f"rank {e.rank}: {e.message}\n(TPMK_TRACEBACK=1 shows the rank's traceback)"
    else:
        text = str(e)
    print(f"tpmk: error: {text}\ntpmk: aborting the MPI job", file=sys.stderr, flush=True)
    comm.Abort(1)


class MPIClient:
    """Rank 0's EngineClient."""

    def __init__(self, comm, worker: Worker, control_group, world_size: int):
        self.comm, self.worker, self.group = comm, worker, control_group
        self.world_size = world_size
        self.failed: BaseException | None = None
        self.closed = False

    def execute(self, cmd: Command) -> StepResult:
        if self.closed or self.failed is not None:
            raise RuntimeError(f"this MPIClient is {'closed' if self.closed else 'failed'}")
        if self.group is not None:
            import torch.distributed as dist
            dist.broadcast_object_list([cmd], src=0, group=self.group)
        try:
            return self.worker.execute(cmd)
        except WorkerError as e:
            self.failed = e
            raise

    def close(self) -> None:
        if self.failed is not None:  # other ranks may be stuck in a collective
            _abort(self.comm, self.failed)
        if not self.closed:
            self.execute(Shutdown())
            self.closed = True


def launch_mpi(model_dir: str, runtime: RuntimeConfig, world_size: int) -> MPIClient:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError("--launcher mpi needs mpi4py and an MPI library: "
                          "pip install 'tpmk[mpi]' (mpi4py and Open MPI's wheel), or mpi4py alone "
                          "built against your cluster's MPI") from e
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != world_size:
        raise ValueError(f"mpirun started {size} ranks but tp={runtime.tp} with "
                         f"engine={runtime.engine!r} needs {world_size} processes; "
                         f"run mpirun -n {world_size}")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    all_local = comm.allreduce(local_size) == size * size  # every rank on one node
    init_method = None
    if rank == 0 and size > 1:
        addr = "127.0.0.1" if all_local else os.environ.get("MASTER_ADDR") or host_ip()
        init_method = f"tcp://{addr}:{os.environ.get('MASTER_PORT') or free_port()}"
    init_method = comm.bcast(init_method, root=0)

    import torch
    ngpu = torch.cuda.device_count() if runtime.resolved_device() == "cuda" else 0
    spec = WorkerSpec(model_dir=model_dir, runtime=runtime, rank=rank, world_size=size,
                      init_method=init_method, device_index=local_rank % ngpu if ngpu else 0,
                      shared_gpu=0 < ngpu < local_size)
    try:
        worker = Worker(spec)
        group = None
        if size > 1:
            import torch.distributed as dist
            group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    except BaseException as e:  # noqa: BLE001
        _abort(comm, e)
    if rank == 0:
        return MPIClient(comm, worker, group, size)

    import torch.distributed as dist
    os.dup2(2, 1)  # rank 0's stdout carries results (--json): the other ranks write to stderr
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        try:
            worker.execute(box[0])
        except BaseException as e:  # noqa: BLE001
            _abort(comm, e)
        if isinstance(box[0], Shutdown):
            sys.exit(0)
