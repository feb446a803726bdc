"""Instruction base class: the Python side of one fixed-width instruction record.

Every op is a subclass in tpmk/kernels/ops/<name>.py with the same name as its
CUDA device function in tpmk/kernels/csrc/ops/<name>.cuh (`op_<name>`); the
subclass's `execute` is the CPU-interpreter function for that op.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from tpmk.kernels.isa import INSTR_WORDS, NO_COUNTER, Field, Opcode, SignalBits

REGISTRY: dict[int, type["Instruction"]] = {}


@dataclass
class Instruction:
    opcode: ClassVar[Opcode] = Opcode.NOP
    name: ClassVar[str] = "nop"

    layer: int = 0
    tile: int = 0
    row0: int = 0
    nrows: int = 0
    arg0: int = 0
    arg1: int = 0
    arg2: int = 0
    arg3: int = 0
    arg4: int = 0
    waits: list[tuple[int, int]] = field(default_factory=list)  # (counter id, count per epoch)
    signal: int = NO_COUNTER
    signal_peers: bool = False
    owner: bool = False   # SignalBits.OWNER: the tile's owner rank (tile % tp) is special

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.opcode in REGISTRY:
            raise ValueError(f"opcode {cls.opcode!r} registered twice ({REGISTRY[cls.opcode]}, {cls})")
        REGISTRY[int(cls.opcode)] = cls

    def encode(self) -> list[int]:
        if len(self.waits) > 2:
            raise ValueError(f"{self.name}: {len(self.waits)} waits; an instruction holds at most 2")
        w = [0] * INSTR_WORDS
        w[Field.OP], w[Field.LAYER], w[Field.TILE] = int(self.opcode), self.layer, self.tile
        w[Field.ROW0], w[Field.NROWS] = self.row0, self.nrows
        w[Field.ARG0], w[Field.ARG1], w[Field.ARG2] = self.arg0, self.arg1, self.arg2
        w[Field.ARG3], w[Field.ARG4] = self.arg3, self.arg4
        waits = list(self.waits) + [(NO_COUNTER, 0)] * (2 - len(self.waits))
        (w[Field.WAIT0], w[Field.COUNT0]), (w[Field.WAIT1], w[Field.COUNT1]) = waits
        w[Field.SIGNAL] = self.signal
        w[Field.SIGNAL_PEERS] = SignalBits.PEERS * self.signal_peers | SignalBits.OWNER * self.owner
        return w

    @staticmethod
    def decode(words) -> "Instruction":
        words = [int(v) for v in words]
        op = words[Field.OP]
        if op not in REGISTRY:
            raise ValueError(f"unknown opcode {op}; known: {sorted(REGISTRY)}")
        waits = [(words[c], words[n]) for c, n in ((Field.WAIT0, Field.COUNT0),
                                                   (Field.WAIT1, Field.COUNT1))
                 if words[c] != NO_COUNTER]
        return REGISTRY[op](
            layer=words[Field.LAYER], tile=words[Field.TILE], row0=words[Field.ROW0],
            nrows=words[Field.NROWS], arg0=words[Field.ARG0], arg1=words[Field.ARG1],
            arg2=words[Field.ARG2], arg3=words[Field.ARG3], arg4=words[Field.ARG4],
            waits=waits, signal=words[Field.SIGNAL],
            signal_peers=bool(words[Field.SIGNAL_PEERS] & SignalBits.PEERS),
            owner=bool(words[Field.SIGNAL_PEERS] & SignalBits.OWNER))

    def execute(self, vm, rank: int) -> None:
        """CPU-interpreter function: run this instruction for `rank` (vm: interpreter.VM)."""

    def owner_rank(self, tp: int) -> int:
        return self.tile % tp

    def runs_on(self, rank: int, tp: int) -> bool:
        """False for an all-gather instruction (OWNER + PEERS) on a rank that does not own it."""
        return not (self.owner and self.signal_peers) or rank == self.owner_rank(tp)

    def signal_ranks(self, rank: int, tp: int) -> range | tuple[int, ...]:
        """Ranks whose `signal` counter this instruction bumps when `rank` has run it."""
        if self.signal_peers:
            return range(tp)
        return (self.owner_rank(tp),) if self.owner else (rank,)

    def push_ranks(self, tp: int) -> range | tuple[int, ...]:
        """Ranks a row-parallel op (o_proj, down) pushes its partial to."""
        return (self.owner_rank(tp),) if self.owner and not self.signal_peers else range(tp)

    def __str__(self) -> str:
        return (f"{self.name}(layer={self.layer}, tile={self.tile}, rows={self.row0}+{self.nrows}, "
                f"args={self.arg0},{self.arg1}, waits={self.waits}, signal={self.signal}"
                f"{'@peers' if self.signal_peers else ''}{'@owner' if self.owner else ''})")


class Nop(Instruction):
    opcode = Opcode.NOP
    name = "nop"
