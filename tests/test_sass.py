"""tpmk.kernels.sass: the compiled kernel read on the CPU. Attention stays free of register
spills (its per-thread K/V loads once spilled, and every token then waited for its own
round trip), in the bf16 and the f32 build."""
import pytest

from tpmk.kernels import sass

SNIPPET = '''
	//## File "/x/csrc/ops/attention.cuh", line 12
        /*0680*/                   STL [R1+0x29c], R0          (*"SpillRefill"*);
        /*0690*/                   LDS.128 R4, [R2] ;
	//## File "/x/csrc/mk_common.cuh", line 7
        /*06a0*/                   LDL R3, [R1+0x298]          (*"SpillRefill"*);
        /*06b0*/                   LDL R5, [R1+0x2a0]          (*"SpillRefill"*);
        /*06c0*/                   STL.64 [R1+0x10], R6 ;
'''


def test_spills_are_counted_per_source_line():
    # the STL.64 without SpillRefill is a call frame's save, not a spill
    assert sass.spills_by_line(SNIPPET) == {("attention.cuh", 12): 1, ("mk_common.cuh", 7): 2}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_attention_has_no_register_spills(dtype, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("cuda.bindings.nvrtc")
    try:
        sass.nvdisasm_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from tpmk.kernels.megakernel import compile_megakernel
    monkeypatch.setenv("TPMK_CACHE", str(tmp_path))
    try:
        cubin = compile_megakernel(getattr(torch, dtype))
    except Exception as e:  # noqa: BLE001 - no libnvrtc on this machine
        if "libnvrtc" in str(e) or "DynamicLibNotFound" in type(e).__name__:
            pytest.skip(f"NVRTC library not installed: {e}")
        raise
    text = sass.disassemble(cubin)
    assert 'ops/attention.cuh", line' in text   # line info present, attention compiled in
    spills = {k: n for k, n in sass.spills_by_line(text).items() if k[0] == "attention.cuh"}
    assert not spills, f"register spills in attention ({dtype}): {spills}"
