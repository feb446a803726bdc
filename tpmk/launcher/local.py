"""Local launcher: one spawned process per rank on this machine, a pipe to each.

The parent sends every command to every rank and waits on the pipes AND the
process sentinels together, so a rank that raises (its error record arrives)
or dies (its sentinel fires with no reply: SIGKILL, OOM, segfault) is noticed
at once; then every other rank is killed, since they may be blocked in a
collective waiting for the failed one. A child whose parent disappears sees
EOF on its pipe and exits. Nothing waits without a bound on liveness.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
from multiprocessing.connection import wait

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Command, Shutdown, StepResult, WorkerError
from tpmk.engine.worker import (NO_MULTICAST_ENV, Worker, WorkerSpec, error_record,
                                raise_error_record)

KILL_GRACE_S = 5.0


def _worker_main(spec: WorkerSpec, conn) -> None:
    """Child process: start the worker, then answer commands until Shutdown or EOF."""
    os.dup2(2, 1)  # the driver's stdout carries results (--json): workers write to stderr
    try:
        worker = Worker(spec)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("error", error_record(e, spec.rank)))
        return
    conn.send(("ready", None))
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):  # the parent is gone: nothing left to serve
            os._exit(1)
        try:
            result = worker.execute(cmd)
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", error_record(e, spec.rank)))
            return
        # Only rank 0's result is used; the others send an acknowledgement.
        conn.send(("ok", result if spec.rank == 0 else None))
        if isinstance(cmd, Shutdown):
            return


def exit_status(code: int | None) -> str:
    """A dead rank's exit code for an error message: a signal by name, SIGKILL with its usual
    cause (the kernel's out-of-memory killer)."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"exit code {code}"
    hint = ": the out-of-memory killer, or a kill -9" if -code == signal.SIGKILL else ""
    return f"exit code {code}, {name}{hint}"


class LocalClient:
    """EngineClient over `world_size` local processes."""

    def __init__(self, model_dir: str, runtime: RuntimeConfig, world_size: int,
                 timeout_s: float | None = None):
        import torch
        device = runtime.resolved_device()
        ngpu = torch.cuda.device_count() if device == "cuda" else 0
        if device == "cuda" and ngpu == 0:
            raise RuntimeError("device=cuda but no CUDA device is visible; use --device cpu")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one command in flight; close() may come from another thread
        self._rdv_dir = tempfile.mkdtemp(prefix="tpmk-rdv-")
        init_method = f"file://{os.path.join(self._rdv_dir, 'store')}"
        ctx = mp.get_context("spawn")  # fork after torch/CUDA init is unsafe
        self.procs: list[mp.Process] = []
        self.conns = []
        os.environ.update(NO_MULTICAST_ENV)
        try:
            for rank in range(world_size):
                spec = WorkerSpec(
                    model_dir=model_dir, runtime=runtime, rank=rank, world_size=world_size,
                    init_method=init_method, device_index=rank % ngpu if ngpu else 0,
                    shared_gpu=0 < ngpu < world_size)
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(spec, child), daemon=True,
                                name=f"tpmk-rank{rank}")
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._gather("start-up")
        except BaseException:
            self._kill_all()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _gather(self, what: str) -> list:
        """Replies of all ranks, or WorkerError for the first rank that fails or dies."""
        procs = self.procs  # _kill_all (maybe from close() in another thread) swaps the lists
        replies: dict[int, object] = {}
        waiting = {r: (self.conns[r], procs[r].sentinel) for r in range(self.world_size)}
        while waiting:
            handles = [h for pair in waiting.values() for h in pair]
            try:
                ready = wait(handles, timeout=self.timeout_s)
            except (OSError, ValueError):  # pipes closed under us by close() in another thread
                raise WorkerError(min(waiting), f"the client was closed during {what}") from None
            if not ready:
                self._kill_all()
                raise WorkerError(min(waiting), f"no reply to {what} within {self.timeout_s} s "
                                  f"from ranks {sorted(waiting)}; all ranks were killed")
            for r, (conn, sentinel) in list(waiting.items()):
                if conn in ready:
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        kind, payload = "dead", None
                elif sentinel in ready:
                    kind, payload = "dead", None
                else:
                    continue
                if kind in ("ready", "ok"):
                    replies[r] = payload
                    del waiting[r]
                    continue
                proc = procs[r]
                proc.join(1.0)  # a dead rank's exit code, for the message
                self._kill_all()
                if kind == "error":
                    raise_error_record(payload)
                raise WorkerError(r, f"process {proc.pid} died during {what} "
                                  f"({exit_status(proc.exitcode)}); all ranks were killed")
        return [replies[r] for r in range(self.world_size)]

    def execute(self, cmd: Command) -> StepResult:
        with self._lock:
            return self._execute(cmd)

    def _execute(self, cmd: Command) -> StepResult:
        if not self.procs:
            raise RuntimeError("this LocalClient is closed; launch a new one")
        for r, conn in enumerate(self.conns):
            try:
                conn.send(cmd)
            except (BrokenPipeError, OSError):
                self._kill_all()
                raise WorkerError(r, f"process {self.procs[r].pid} is gone "
                                  f"({exit_status(self.procs[r].exitcode)}); all ranks were killed") from None
        return self._gather(type(cmd).__name__)[0]

    def close(self) -> None:
        """Shut the ranks down cleanly; kill them if a command is still running after
        KILL_GRACE_S (a hung step must not block the exit)."""
        if not self._lock.acquire(timeout=KILL_GRACE_S):
            self._kill_all()
            return
        try:
            if self.procs and all(p.is_alive() for p in self.procs):
                try:
                    self._execute(Shutdown())
                except WorkerError as e:
                    print(f"tpmk: shutdown: {e}", file=sys.stderr)
                for p in self.procs:
                    p.join(KILL_GRACE_S)
            self._kill_all()
        finally:
            self._lock.release()

    def _kill_all(self) -> None:
        procs, conns = self.procs, self.conns
        self.procs, self.conns = [], []
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(KILL_GRACE_S)
        for c in conns:
            c.close()
        shutil.rmtree(self._rdv_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
