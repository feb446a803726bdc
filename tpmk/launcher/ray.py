"""Ray launcher: one actor per process in a STRICT_PACK placement group.

Bundles: `{GPU: 1}` per rank when the cluster has a GPU per rank;
`{GPU: 1/n}` when it has a single GPU (ranks share it and talk over gloo);
`{CPU: 1}` with device=cpu. Ranks are ordered by (node IP, GPU id) so that
rank r lands on GPU r of a node, and rank 0's address is the rendezvous,
found by rank 0's actor and passed to the others through Ray. The cluster is
the one named by RAY_ADDRESS (`ray job submit` sets it for the job; `auto`
finds a cluster started on this machine), else a local Ray instance is started.
"""
from __future__ import annotations

import dataclasses
import os
import threading

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Command, Shutdown, StepResult, WorkerError
from tpmk.engine.worker import Worker, WorkerSpec, error_record, raise_error_record
from tpmk.launcher.launch import free_port


class RankActor:
    """Hosts one Worker; replies are plain data ("ok", x) / ("error", record)."""

    def __init__(self):
        self.worker = None

    def node_info(self) -> dict:
        import ray
        gpu_ids = [int(g) for g in ray.get_gpu_ids()] if ray.get_gpu_ids() else []
        return {"ip": ray.util.get_node_ip_address(), "gpu": min(gpu_ids) if gpu_ids else -1,
                "pid": os.getpid()}

    def rendezvous(self) -> str:
        import ray
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, spec: WorkerSpec):
        try:
            self.worker = Worker(spec)
            return ("ok", None)
        except BaseException as e:  # noqa: BLE001 - goes back to the driver as data
            return ("error", error_record(e, spec.rank))

    def execute(self, cmd: Command):
        try:
            return ("ok", self.worker.execute(cmd))
        except BaseException as e:  # noqa: BLE001
            return ("error", error_record(e, self.worker.rank))


def _bundles(runtime: RuntimeConfig, world_size: int) -> tuple[RuntimeConfig, list[dict], dict]:
    """(runtime with a concrete device, bundles, actor resource options)."""
    import ray
    gpus = ray.cluster_resources().get("GPU", 0)
    device = runtime.device if runtime.device != "auto" else ("cuda" if gpus else "cpu")
    runtime = dataclasses.replace(runtime, device=device)
    if device == "cpu":
        return runtime, [{"CPU": 1}] * world_size, {"num_cpus": 1}
    if gpus >= world_size:
        return runtime, [{"GPU": 1}] * world_size, {"num_cpus": 0, "num_gpus": 1}
    if gpus >= 1:  # one real GPU: ranks share it (functional only; NCCL refuses, gloo works)
        share = 1.0 / world_size
        return runtime, [{"GPU": share}] * world_size, {"num_cpus": 0, "num_gpus": share}
    raise RuntimeError(f"device=cuda but the Ray cluster has no GPU (resources: "
                       f"{ray.cluster_resources()}); use --device cpu or add GPU nodes")


class RayClient:
    def __init__(self, model_dir: str, runtime: RuntimeConfig, world_size: int,
                 timeout_s: float | None = None):
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
        except ImportError as e:
            raise ImportError("--launcher ray needs Ray: pip install 'tpmk[ray]' "
                              "(or pip install 'ray[default]')") from e
        self._ray, self._remove_pg = ray, remove_placement_group
        self.world_size, self.timeout_s, self.actors, self.pg = world_size, timeout_s, [], None
        self._lock = threading.Lock()  # one command in flight; close() may come from another thread
        if not ray.is_initialized():
            # RAY_ADDRESS (`ray job submit` sets it for the job; `auto`: the cluster started on
            # this machine), else a new local instance: never attach to a cluster by accident.
            ray.init(address=os.environ.get("RAY_ADDRESS") or "local")
        runtime, bundles, opts = _bundles(runtime, world_size)
        self.pg = placement_group(bundles, strategy="STRICT_PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=120)
        if not ready:
            self.close()
            raise RuntimeError(f"Ray could not place {world_size} bundles {bundles[0]} on one "
                               f"node within 120 s (cluster: {ray.cluster_resources()}); "
                               f"lower --tp or add resources")
        try:
            self._start_actors(model_dir, runtime, opts)
        except BaseException:
            self._kill_all()  # no actor or placement group outlives a failed start
            raise

    def _start_actors(self, model_dir: str, runtime: RuntimeConfig, opts: dict) -> None:
        ray, n = self._ray, self.world_size
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        actor_cls = ray.remote(RankActor)
        actors = [actor_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i), **opts).remote()
                  for i in range(n)]
        self.actors = actors
        infos = ray.get([a.node_info.remote() for a in actors])
        order = sorted(range(n), key=lambda i: (infos[i]["ip"], infos[i]["gpu"], i))
        self.actors = [actors[i] for i in order]
        self.pids = [infos[i]["pid"] for i in order]
        init_method = ray.get(self.actors[0].rendezvous.remote()) if n > 1 else None
        shared = opts.get("num_gpus", 1) < 1
        # Actors do not inherit the driver's environment: pass NCCL and tpmk settings on.
        env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TPMK_"))}
        refs = [a.start.remote(WorkerSpec(
            model_dir=model_dir, runtime=runtime, rank=r, world_size=n,
            init_method=init_method, device_index=0, shared_gpu=shared, env=env))
            for r, a in enumerate(self.actors)]
        self._gather(refs, "start-up")

    def _gather(self, refs: list, what: str) -> list:
        ray = self._ray
        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            if not ready:
                self._kill_all()
                raise WorkerError(rank_of[pending[0]], f"no reply to {what} within "
                                  f"{self.timeout_s} s; all ranks were killed")
            r = rank_of[ready[0]]
            try:
                kind, payload = ray.get(ready[0])
            except Exception as e:  # RayActorError: the actor process died
                self._kill_all()
                raise WorkerError(r, f"Ray actor died during {what}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}; all ranks were "
                                  f"killed") from None
            if kind == "error":
                self._kill_all()
                raise_error_record(payload)
            results[r] = payload
        return results

    def execute(self, cmd: Command) -> StepResult:
        with self._lock:
            return self._execute(cmd)

    def _execute(self, cmd: Command) -> StepResult:
        if not self.actors:
            raise RuntimeError("this RayClient is closed; launch a new one")
        return self._gather([a.execute.remote(cmd) for a in self.actors], type(cmd).__name__)[0]

    def close(self) -> None:
        """Shut the ranks down cleanly; kill them if a command is still running after 5 s."""
        if not self._lock.acquire(timeout=5.0):
            self._kill_all()
            return
        try:
            if self.actors:
                try:
                    self._execute(Shutdown())
                except WorkerError:
                    pass
            self._kill_all()
        finally:
            self._lock.release()

    def _kill_all(self) -> None:
        actors, self.actors = self.actors, []
        for a in actors:
            self._ray.kill(a)
        if self.pg is not None:
            self._remove_pg(self.pg)
            self.pg = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
