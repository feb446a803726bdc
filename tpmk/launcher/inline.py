"""Inline launcher: the worker runs in the driver process (tp=1, or virtual-TP engines
that hold all tp shards in one process: interpreter, single-GPU megakernel)."""
from __future__ import annotations

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Command, StepResult
from tpmk.engine.worker import Worker, WorkerSpec


class InlineClient:
    world_size = 1

    def __init__(self, model_dir: str, runtime: RuntimeConfig):
        self.worker = Worker(WorkerSpec(model_dir=model_dir, runtime=runtime))

    def execute(self, cmd: Command) -> StepResult:
        return self.worker.execute(cmd)

    def close(self) -> None:
        self.worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
