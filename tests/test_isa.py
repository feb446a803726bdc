"""Instruction-set layout: the generated CUDA header must match isa.py, encode/decode round-trips."""
import ctypes

import pytest

from _mk_helpers import compile_or_skip
from tpmk.config import ModelConfig
from tpmk.kernels import isa
from tpmk.kernels.ops import REGISTRY, Instruction
from tpmk.kernels.schedule import build_schedule


def test_generated_header_matches_isa():
    assert isa.HEADER_PATH.read_text() == isa.generate_header(), (
        "csrc/isa_generated.cuh drifted from isa.py; run `python -m tpmk.kernels.isa`")


def test_kernel_args_layout_is_packed_as_cuda_expects():
    # 8-byte members first, then 4-byte: the natural C layout has no padding holes.
    size = sum(ctypes.sizeof(ctypes.c_uint64 if t in (isa.PTR, isa.I64) else ctypes.c_int32) * c
               for _, t, c in isa.KERNEL_ARGS)
    assert ctypes.sizeof(isa.KernelArgs) == size


def test_every_opcode_has_one_class_and_one_cuda_file():
    assert sorted(REGISTRY) == sorted(int(o) for o in isa.Opcode)
    csrc = isa.HEADER_PATH.parent / "ops"
    for cls in REGISTRY.values():
        if cls.opcode == isa.Opcode.NOP:
            continue
        assert (csrc / f"{cls.name}.cuh").exists(), f"missing csrc/ops/{cls.name}.cuh"
        assert f"op_{cls.name}(" in (csrc / f"{cls.name}.cuh").read_text()


@pytest.mark.parametrize("name,tp", [("tiny", 2), ("tiny-gqa", 8)])
def test_encode_decode_roundtrip(name, tp):
    sched = build_schedule(ModelConfig.from_name(name), tp, bucket=3, num_sms=4)
    words, starts = sched.encode()
    assert words.shape == (len(sched.instructions), isa.INSTR_WORDS)
    assert starts[-1] == len(sched.instructions)
    for w, ins in zip(words.tolist(), sched.instructions):
        back = Instruction.decode(w)
        assert type(back) is type(ins) and back.encode() == w


def test_too_many_waits_is_an_error():
    with pytest.raises(ValueError, match="at most 2"):
        Instruction(waits=[(0, 1), (1, 1), (2, 1)]).encode()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_megakernel_compiles_for_sm90a_with_nvrtc(dtype, tmp_path):
    """CPU-only: NVRTC compiles the whole kernel (catches CUDA syntax errors in CI)."""
    cubin = compile_or_skip(dtype, tmp_path)
    assert len(cubin) > 10_000


def test_vocab_must_hold_topk_real_tokens():
    from tpmk.kernels.isa import TOPK, check_vocab
    check_vocab(TOPK)
    with pytest.raises(ValueError, match=f"vocab_size={TOPK - 1} must be in"):
        check_vocab(TOPK - 1)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        check_vocab(2 ** 24)


@pytest.mark.parametrize("bucket,pages", [(1, 1), (3, 7), (128, 64)])
def test_header_words_hold_tokens_positions_and_page_table(bucket, pages):
    """The header: its fixed fields, then tokens [bucket], positions [bucket], page table
    [bucket, pages]: the size is where the page table starts plus its words."""
    from tpmk.kernels.isa import header_offsets, header_words
    tokens, positions, table = header_offsets(bucket)
    assert positions - tokens == bucket and table - positions == bucket
    assert header_words(bucket, pages) == table + bucket * pages
