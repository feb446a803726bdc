"""Engines that fail on purpose, for the launcher tests (imported by name in worker processes).

Rank 0 blocks in a gloo all-reduce that the failing rank never joins, the way a
real rank is stuck in a collective when a peer dies: the launcher must kill it.
"""
import os
import signal

import torch
import torch.distributed as dist

from tpmk.engine.api import StepResult


class _Base:
    def __init__(self, cfg, runtime, shards, group=None):
        self.rank, self.group = shards[0].rank, group

    def _collective_tokens(self, n: int) -> StepResult:
        t = torch.ones(n)
        dist.all_reduce(t, group=self.group)
        return StepResult(tokens=[int(v) for v in t])


class RaisesOnRank1(_Base):
    def prefill(self, cmd):
        if self.rank == 1:
            raise ValueError("rank 1 fails on purpose")
        return self._collective_tokens(len(cmd.tokens))


class KilledOnRank1(_Base):
    def prefill(self, cmd):
        return self._collective_tokens(len(cmd.tokens))

    def decode(self, cmd):
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self._collective_tokens(len(cmd.tokens))


class StartFailsOnRank1(_Base):
    def __init__(self, cfg, runtime, shards, group=None):
        super().__init__(cfg, runtime, shards, group)
        if self.rank == 1:
            raise self.error("rank 1 cannot start on purpose")
        dist.barrier(group=group)  # rank 0 waits for a peer that never comes

    error = RuntimeError


class RefusesInputOnRank1(StartFailsOnRank1):
    error = ValueError   # bad input (a wrong flag or checkpoint): WorkerError.input_error
