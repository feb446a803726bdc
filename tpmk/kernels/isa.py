"""The instruction set: the single source of truth shared by Python and CUDA.

Everything the CUDA side needs to agree on is declared here and written into
`csrc/isa_generated.cuh` by `generate_header()`; tests/test_isa.py fails when
the checked-in header drifts from this file.

- An instruction is INSTR_WORDS int32 words, opcode first (`Field`).
- Dependencies are counters (uint32, one per COUNTER_STRIDE words so each
  sits on its own 128-byte line) that only grow: an instruction waits until
  `counter >= epoch * count` (wrap-around safe compare) and, when done, adds
  1 to its signal counter on its own rank, on every rank or on its tile's owner
  rank (`SIGNAL_PEERS` bits, `SignalBits`).
- The step header (int32 words in device memory) carries everything that
  changes per step: epoch, batch size, tokens, positions, page tables.
- `KernelArgs` is the per-rank kernel-argument struct (pointers + sizes).
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from pathlib import Path

INSTR_WORDS = 16          # 64-byte instructions
COUNTER_STRIDE = 32       # uint32 words per counter: one 128-byte line each
MAX_TP = 8
ERROR_WORDS = 16
NO_COUNTER = -1
NEG_INF = -1.0e30         # finite "minus infinity" for empty softmax splits
TOPK = 8                  # LM-head candidates per tile and per row (sampling with top_k <= TOPK)
MMA_MIN_BATCH = 2         # bf16 steps of at least this many rows run their matvecs on tensor cores
                          # (bf16 inputs); batch 1 on CUDA cores (f32 inputs). 70B tp=8 rank, H100,
                          # ctx 1024, against 5: batch 2 / 3 / 4 9.61 / 9.58 / 9.85 ms vs 9.89 /
                          # 10.76 / 11.58; batch 1 level (the CUDA cores, faster there)

# ---- kernel geometry: the CUDA side reads these (isa_generated.cuh), the host sizes shared
# memory and checks shapes with them. Change them here only.
NTHREADS = 256            # threads per CTA (one persistent CTA per SM). 512 capped every thread
                          # at 128 registers: 323 spills, a 456-byte stack frame per thread that
                          # L1 could not hold; 256: 15 spills, 224 bytes. 70B tp=8 rank, ctx 1024,
                          # H100, 2026-12-06, same call: batch 1 / 8 / 32 / 128 in 8.93 / 10.24 /
                          # 14.19 / 32.48 ms vs 10.61 / 11.28 / 14.98 / 34.35 at 512
NWARPS = NTHREADS // 32
BATCH_CHUNK = 4           # batch rows per CUDA-core matvec pass (inputs in shared memory)
ATTN_CHUNK = 128          # attention: most tokens per chunk (the scores' row stride)
ATTN_PAGES = ATTN_CHUNK + 4  # attention: page numbers of one chunk (page size 1: ATTN_CHUNK), padded
ATTN_KV_BYTES = 32768     # attention: most bytes of one K (or V) chunk in shared memory
MAX_SPLITS = 128          # attention splits per (sequence, kv head): the merge's lanes take 4 each
MMA_PASS = 128            # tensor-core matvec: batch rows per pass (n-tiles of 8): batch 128 streams
                          # each weight tile once
MMA_KC1 = 4096            # tensor-core K chunk with one n-tile; with NT n-tiles it is MMA_KC1 / NT
# mk_mma.cuh's shared memory in f32 words: [MMA_PASS] sums of squares, two chunk buffers of
# MMA_PASS rows x (KC + 32) bf16 (KC = MMA_KC1 / (MMA_PASS / 8)), then the staged outputs
# [nb][nrows], at most MMA_OUT_WORDS (a pass writes only its nb rows: the host sizes them by bucket).
MMA_OUT_AT = MMA_PASS + 2 * MMA_PASS * (MMA_KC1 * 8 // MMA_PASS + 32) // 2
MMA_OUT_WORDS = MMA_PASS * 128
MMA_SMEM_WORDS = MMA_OUT_AT + MMA_OUT_WORDS


class Opcode(enum.IntEnum):
    NOP = 0
    EMBED = 1        # vocab-parallel embedding row -> peers' residual slots
    QKV = 2          # rmsnorm(x) @ qkv rows + RoPE; q -> q buffer, k/v -> paged cache
    ATTENTION = 3    # one (sequence, kv head, split) of decode attention -> partial (m, l, acc)
    O_PROJ = 4       # merge splits, @ o_proj rows, push partial to every peer's slot[rank]
    RESIDUAL = 5     # x[:, cols] (+)= sum over ranks of slot[r][:, cols] (fixed rank order)
    GATE_UP = 6      # rmsnorm(x) @ gate/up rows, silu(gate) * up -> act
    DOWN = 7         # act @ down rows, push partial to every peer's slot[rank]
    LM_HEAD = 8      # rmsnorm(x) @ lm_head rows -> logits, per-tile top-TOPK pushed to peers
    ARGMAX = 9       # merge all ranks' candidates -> row top-TOPK (topk_values/ids), tokens_out
    ACT = 10         # gate_up split over K: sum its slices' partials, silu(gate) * up -> act


class Field(enum.IntEnum):
    """Word index of each instruction field (must match isa_generated.cuh)."""
    OP = 0
    LAYER = 1
    TILE = 2        # tile index within its (op, layer) group
    ROW0 = 3        # first output row / column / kv head the tile covers
    NROWS = 4       # rows / columns / splits covered
    ARG0 = 5        # op-specific (ATTENTION: sequence; RESIDUAL: stage; EMBED: stage;
                    # GATE_UP: K slice; ACT: slices)
    ARG1 = 6        # op-specific (ATTENTION: split; RESIDUAL: 1 = set, 0 = add; GATE_UP: slices,
                    # <= 1: the whole K, silu(gate) * up -> act; more: the slice's partial -> gu_part)
    WAIT0 = 7       # counter id or NO_COUNTER
    COUNT0 = 8      # expected increments per epoch
    WAIT1 = 9
    COUNT1 = 10
    SIGNAL = 11     # counter id or NO_COUNTER
    SIGNAL_PEERS = 12  # SignalBits: PEERS, OWNER (0: own rank's counter only)
    ARG2 = 13       # op-specific (ATTENTION: its (sequence, kv head) merge ticket counter;
                    # GATE_UP: columns per K slice, hidden / slices, or 0)
    ARG3 = 14
    ARG4 = 15       # stage number in program order (debug stop_after / op-by-op diff)


class SignalBits(enum.IntEnum):
    """Bits of the SIGNAL_PEERS word. The owner of an instruction is rank TILE % tp.
    PEERS: add on every rank's counter. OWNER without PEERS: every rank runs the
    instruction and adds on the owner's counter only (reduce-scatter pushes). OWNER with
    PEERS: only the owner runs it (others skip it, waits included) and adds on every
    rank's counter (all-gather)."""
    PEERS = 1
    OWNER = 2


class ErrorField(enum.IntEnum):
    """Words of the error block written by a timed-out wait."""
    FLAG = 0        # 0 ok, 1 wait timeout, 2 bad opcode, 3 shape check
    RANK = 1
    SM = 2
    OPCODE = 3
    LAYER = 4
    TILE = 5
    COUNTER = 6
    EXPECTED = 7
    VALUE = 8
    INSTR = 9       # index of the instruction in the stream


class HeaderField(enum.IntEnum):
    EPOCH = 0
    BATCH = 1
    TOKENS = 4      # then tokens[bucket], positions[bucket], pages[bucket * max_pages]


def header_words(bucket: int, max_pages: int) -> int:
    return HeaderField.TOKENS + 2 * bucket + bucket * max_pages


def cand_shape(tp: int, n_lm_tiles: int, bucket: int) -> tuple[int, int, int, int, int]:
    """LM-head candidates, f32, on every rank (`peer_cand`): [tp, n_lm_tiles, bucket, TOPK, 2].

    cand[r, t, b] holds tile t of rank r's TOPK best (value, global vocab id as f32; ids
    < vocab_size < 2**24 are exact) of row b, value descending then id ascending; entries
    past a tile's rows are (-inf, -1)."""
    return tp, n_lm_tiles, bucket, TOPK, 2


def check_vocab(vocab_size: int) -> None:
    if not TOPK <= vocab_size < 2 ** 24:
        raise ValueError(f"vocab_size={vocab_size} must be in [TOPK={TOPK}, 2**24): the row's "
                         f"top-TOPK must be real tokens and candidate ids are exact f32")


SMALL_ATTN_CHUNK = 64     # attention tokens per chunk for buckets below MMA_MIN_BATCH (see attn_chunk)


def attn_chunk(head_dim: int, elem_bytes: int, bucket: int) -> int:
    """Tokens per attention chunk (KernelArgs.attn_chunk): ATTN_CHUNK, fewer where a K chunk
    would pass ATTN_KV_BYTES (head_dim 256 in bf16, 128 and 256 in f32); a power of two.
    Buckets below MMA_MIN_BATCH take SMALL_ATTN_CHUNK: there the K/V ring is the largest user
    of shared memory, and what the CTA leaves is L1 for the stack frames. 70B tp=8 rank,
    H200, batch 1 / 2 at ctx 1024 (2026-12-06, both below the threshold then): 8.80 / 9.10 ms
    with 64 tokens, 9.04-9.23 / 9.48-9.67 with 128 (ctx 4096 within noise; 32 tokens were
    slower there: 10.16 vs 9.80 ms). Bucket 2 now runs the tensor cores with 128-token chunks,
    faster still (MMA_MIN_BATCH)."""
    chunk = SMALL_ATTN_CHUNK if bucket < MMA_MIN_BATCH else ATTN_CHUNK
    return min(chunk, ATTN_KV_BYTES // (head_dim * elem_bytes))


def header_offsets(bucket: int) -> tuple[int, int, int]:
    """(tokens, positions, page table) word offsets in the step header."""
    t = int(HeaderField.TOKENS)
    return t, t + bucket, t + 2 * bucket


# ---- kernel-argument struct (one per rank) --------------------------------
PTR, I32, F32, I64 = "ptr", "i32", "f32", "i64"

KERNEL_ARGS: list[tuple[str, str, int]] = [
    # weights (wtype: the model dtype; layouts as tpmk.partition.weights.RankWeights)
    ("embed", PTR, 1), ("lm_head", PTR, 1), ("final_norm", PTR, 1), ("input_norm", PTR, 1),
    ("qkv", PTR, 1), ("o_proj", PTR, 1), ("post_norm", PTR, 1), ("gate_up", PTR, 1),
    ("down", PTR, 1),
    ("k_cache", PTR, 1), ("v_cache", PTR, 1),        # [L, pages, Hkv, page_size, D] wtype
    ("rope_inv_freq", PTR, 1),                      # [D/2] f32
    ("header", PTR, 1),                             # int32 step header
    ("instructions", PTR, 1),                       # [n, INSTR_WORDS] int32
    ("queue_start", PTR, 1),                        # [num_sms + 1] int32
    ("x", PTR, 1),                                  # [bucket, H] f32 residual stream
    ("q", PTR, 1),                                  # [bucket, Hq * D] f32
    ("attn_part", PTR, 1),                          # [bucket, Hq, splits, D + 2] f32
    ("attn_out", PTR, 1),                           # [bucket, Hq * D] f32 merged attention
    ("act", PTR, 1),                                # [bucket, I] f32; a schedule that splits gate_up
                                                    # over K puts its partials right after it:
                                                    # gu_part [gu_splits, bucket, 2 I] f32
    # Tensor-core inputs (batch >= MMA_MIN_BATCH), written by their producers rounded to bf16
    # so the matvecs copy them straight into shared memory.
    ("attn_bf", PTR, 1),                            # attn_out as [bucket, Hq * D] bf16
    ("act_bf", PTR, 1),                             # act as [bucket, I] bf16
    ("logits", PTR, 1),                             # [bucket, Vp] f32
    ("tokens_out", PTR, 1),                         # [bucket] int32
    ("topk_values", PTR, 1),                        # [bucket, TOPK] f32, value desc then id asc
    ("topk_ids", PTR, 1),                           # [bucket, TOPK] int32 global vocab ids
    ("counters", PTR, 1),                           # [num_counters * COUNTER_STRIDE] u32
    ("error", PTR, 1),                              # [ERROR_WORDS] int32 (shared by all ranks)
    ("profile", PTR, 1),                            # [n, 2] u64 timestamps or 0
    ("peer_counters", PTR, MAX_TP),
    ("peer_attn_slots", PTR, MAX_TP),               # [tp, bucket, H] f32 on each peer
    ("peer_mlp_slots", PTR, MAX_TP),
    ("peer_x", PTR, MAX_TP),                        # [bucket, H] f32 on each peer (all-gather)
    ("peer_xn", PTR, MAX_TP),                       # x times the next norm's weight, [bucket, H] bf16
    ("peer_xn_ssq", PTR, MAX_TP),                   # [bucket, n_h_tiles] f32: x^2 summed per residual tile
    ("peer_cand", PTR, MAX_TP),                     # cand_shape(tp, n_lm_tiles, bucket) f32 on each peer
    ("timeout_ns", I64, 1),
    ("rank", I32, 1), ("tp", I32, 1), ("num_sms", I32, 1), ("bucket", I32, 1),
    ("num_layers", I32, 1), ("hidden", I32, 1), ("q_heads", I32, 1), ("kv_heads", I32, 1),
    ("head_dim", I32, 1), ("inter", I32, 1), ("vocab_local", I32, 1), ("vocab_size", I32, 1),
    ("page_size", I32, 1), ("num_pages", I32, 1), ("max_pages", I32, 1), ("num_splits", I32, 1),
    ("n_lm_tiles", I32, 1), ("n_h_tiles", I32, 1), ("num_instructions", I32, 1),
    ("kmax", I32, 1),             # shared memory: BATCH_CHUNK * kmax f32 inputs, then outputs
    ("stop_after", I32, 1),       # debug: skip instructions whose stage (ARG4) > this; -1 off
    ("eps", F32, 1), ("attn_scale", F32, 1),
    ("attn_chunk", I32, 1),       # attention tokens per chunk: attn_chunk(head_dim, dtype size, bucket)
]   # an even count of 4-byte members: no tail padding

_CTYPE = {PTR: ctypes.c_uint64, I32: ctypes.c_int32, F32: ctypes.c_float, I64: ctypes.c_int64}
_CDECL = {PTR: "unsigned long long", I32: "int", F32: "float", I64: "long long"}


class KernelArgs(ctypes.Structure):
    """Must match `struct KernelArgs` in csrc/isa_generated.cuh (generated from this list)."""
    _fields_ = [(n, _CTYPE[t] * c if c > 1 else _CTYPE[t]) for n, t, c in KERNEL_ARGS]


@dataclass(frozen=True)
class CounterRef:
    counter: int
    count: int


def generate_header() -> str:
    lines = [
        "// GENERATED by tpmk/kernels/isa.py: generate_header(). Do not edit by hand;",
        "// tests/test_isa.py fails when this file and isa.py disagree.",
        "#pragma once",
        "namespace isa {",
        f"constexpr int INSTR_WORDS = {INSTR_WORDS};",
        f"constexpr int COUNTER_STRIDE = {COUNTER_STRIDE};",
        f"constexpr int MAX_TP = {MAX_TP};",
        f"constexpr int ERROR_WORDS = {ERROR_WORDS};",
        f"constexpr int NO_COUNTER = {NO_COUNTER};",
        f"constexpr float NEG_INF = {NEG_INF:.1e}f;",
        f"constexpr int TOPK = {TOPK};",
        f"constexpr int MMA_MIN_BATCH = {MMA_MIN_BATCH};",
        f"constexpr int NTHREADS = {NTHREADS};",
        f"constexpr int BATCH_CHUNK = {BATCH_CHUNK};",
        f"constexpr int ATTN_CHUNK = {ATTN_CHUNK};",
        f"constexpr int ATTN_PAGES = {ATTN_PAGES};",
        f"constexpr int MAX_SPLITS = {MAX_SPLITS};",
        f"constexpr int MMA_PASS = {MMA_PASS};",
        f"constexpr int MMA_KC1 = {MMA_KC1};",
        f"constexpr int MMA_OUT_AT = {MMA_OUT_AT};",
        f"constexpr int MMA_OUT_WORDS = {MMA_OUT_WORDS};",
        f"constexpr int MMA_SMEM_WORDS = {MMA_SMEM_WORDS};",
        f"constexpr int HDR_TOKENS = {int(HeaderField.TOKENS)};",
    ]
    for cls, prefix in ((Opcode, "OP_"), (Field, "F_"), (SignalBits, "SIG_"), (ErrorField, "E_"),
                        (HeaderField, "H_")):
        lines += [f"constexpr int {prefix}{m.name} = {int(m)};" for m in cls]
    lines.append("}  // namespace isa")
    lines.append("")
    lines.append("// Must match tpmk.kernels.isa.KernelArgs (ctypes); passed by value.")
    lines.append("struct KernelArgs {")
    for n, t, c in KERNEL_ARGS:
        lines.append(f"  {_CDECL[t]} {n}{f'[{c}]' if c > 1 else ''};")
    lines.append("};")
    lines.append(f"static_assert(sizeof(KernelArgs) == {ctypes.sizeof(KernelArgs)}, "
                 "\"KernelArgs drifted from isa.py\");")
    # Field offsets follow from the generated declaration order (8-byte members first,
    # then 4-byte: no padding); NVRTC does not fold offsetof in static_assert.
    return "\n".join(lines) + "\n"


HEADER_PATH = Path(__file__).parent / "csrc" / "isa_generated.cuh"


def write_header() -> Path:
    HEADER_PATH.parent.mkdir(parents=True, exist_ok=True)
    HEADER_PATH.write_text(generate_header())
    return HEADER_PATH


if __name__ == "__main__":
    print(write_header())
