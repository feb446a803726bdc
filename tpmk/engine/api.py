"""The commands a driver sends to every rank, and what each engine implements.

Every rank executes the same command (SPMD); collectives happen inside.
The driver owns the KV page allocator (tpmk.engine.kv_cache.PageAllocator),
so commands carry page lists and engines keep no allocation state: the same
page table the megakernel reads from its step header.

Sampling is vocab-parallel and independent of tp: a sampled token is the
argmax over the vocab of logits / temperature + Gumbel noise, the noise drawn
from a generator seeded by (seed, position) over the whole padded vocab and
sliced per rank. Greedy is the same argmax without noise. top-k / top-p
gather only each rank's local top-k candidates, never full logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Union


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes an engine compiles for (the reference engine's CUDA graphs, the
    instruction-stream engines' schedules): powers of two below max_batch, then max_batch. A
    step of n sequences runs the smallest bucket >= n."""
    b, out = 1, []
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket_for(buckets: list[int], n: int) -> int:
    """The smallest of `buckets` (ascending, from batch_buckets) that holds n sequences."""
    return next(b for b in buckets if b >= n)


# Temperatures below this sample greedily: logits / T overflows float32 near T = 1e-38 and
# the argmax is all that is left well before (vLLM's _SAMPLING_EPS is the same).
GREEDY_BELOW = 1e-5
TOP_K_LIMIT = 2 ** 31 - 1   # int32: a top_k beyond any vocab is the whole vocab


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (below GREEDY_BELOW): greedy
    top_k: int = 0             # 0: whole vocab
    top_p: float = 1.0
    seed: int = 0              # the driver fills a random one when the user gives none

    def __post_init__(self):
        if not 0.0 <= self.temperature < math.inf:   # NaN fails too
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0")
        if not 0 <= self.top_k <= TOP_K_LIMIT:
            raise ValueError(f"top_k={self.top_k} must be in [0, {TOP_K_LIMIT}] (0: whole vocab)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass
class Prefill:
    """Run whole prompts, write their KV, sample the first new token of each."""
    tokens: list[list[int]]            # prompt token ids per sequence
    pages: list[list[int]]             # KV pages per sequence (cover len(prompt) + 1 tokens)
    sampling: list[SamplingParams]
    return_logits: bool = False        # full last-position logits back (tests, --logits)


@dataclass
class Decode:
    """One token per sequence at `positions` (0-based index of that token)."""
    tokens: list[int]
    positions: list[int]
    pages: list[list[int]]
    sampling: list[SamplingParams]
    return_logits: bool = False


@dataclass
class Shutdown:
    pass


Command = Union[Prefill, Decode, Shutdown]


@dataclass
class StepResult:
    tokens: list[int]
    logits: list | None = None         # optional [B, vocab] float32 rows (tests only)
    step_ms: float = 0.0
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    """What the reference, interpreter and megakernel engines implement (per rank)."""

    def prefill(self, cmd: Prefill) -> StepResult: ...

    def decode(self, cmd: Decode) -> StepResult: ...


class WorkerError(RuntimeError):
    """A rank failed; carries the rank and its formatted traceback. `input_error`: the rank
    refused its input at start-up (a wrong flag or checkpoint: ValueError, FileNotFoundError),
    which the CLI reports without the traceback."""

    def __init__(self, rank: int, message: str, traceback_text: str = "", input_error: bool = False):
        super().__init__(f"rank {rank}: {message}\n{traceback_text}".rstrip())
        self.rank = rank
        self.message = message
        self.traceback_text = traceback_text
        self.input_error = input_error


class EngineClient(Protocol):
    """Driver-side handle on all ranks, whatever launched them (local, Ray, MPI, inline).

    `execute` sends one command to every rank and returns rank 0's result;
    it raises WorkerError if any rank fails or dies, never hangs.
    """

    world_size: int

    def execute(self, cmd: Command) -> StepResult: ...

    def close(self) -> None: ...
