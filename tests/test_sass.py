"""tpmk.kernels.sass: the compiled kernel read on the CPU. The hot loops stay free of
register spills: attention as a whole (its per-thread K/V loads once spilled, and every
token then waited for its own round trip), the matvecs' weight-load and multiply lines and
residual's batch-1 loop, in the bf16 and the f32 build, and in the build with the tensor-core
matvec's knobs set back (one m-tile per warp, two chunk buffers)."""
import pytest

from _mk_helpers import compile_or_skip, nvrtc_or_skip
from tpmk.kernels import sass
from tpmk.kernels.build import CSRC

SNIPPET = '''
	//## File "/x/csrc/ops/attention.cuh", line 12
        /*0680*/                   STL [R1+0x29c], R0          (*"SpillRefill"*);
        /*0690*/                   LDS.128 R4, [R2] ;
	//## File "/x/csrc/mk_common.cuh", line 7
        /*06a0*/                   LDL R3, [R1+0x298]          (*"SpillRefill"*);
        /*06b0*/                   LDL R5, [R1+0x2a0]          (*"SpillRefill"*);
        /*06c0*/                   STL.64 [R1+0x10], R6 ;
'''

# Inner-loop lines, found by their text (a rewrite that drops one fails the test).
HOT_LINES = {
    "mk_common.cuh": ["u[i][j] = k < m.kend ? ldg_w(", "acc[j][b] += f[e] * xv[e]"],   # CUDA-core matvec
    "mk_mma.cuh": ["const uint4 bx = ", "asm(\"mma.sync.aligned", "ua[j * U + u] = ok ? ldg_w<true>("],   # tensor cores (bf16)
    # residual's batch-1 loop: it once carried v's unwritten slots across iterations, and
    # the build with two m-tiles per warp spilled them there (2026-12-07)
    "ops/residual.cuh": ["const size_t off = (size_t)(idx / n4)", "v[r] = r < a.tp ? __ldcg("],
}


def test_spills_are_counted_per_source_line():
    # the STL.64 without SpillRefill is a call frame's save, not a spill
    assert sass.spills_by_line(SNIPPET) == {("attention.cuh", 12): 1, ("mk_common.cuh", 7): 2}


# The default builds, and the tensor-core matvec's knobs set back (mk_mma.cuh: one m-tile per
# warp, two activation chunk buffers, the default before 2026-12-07) so that they keep
# compiling spill-free.
BUILDS = [("bfloat16", ()), ("float32", ()), ("bfloat16", ("MMA_MT=1", "MMA_XD=2")),
          ("bfloat16", ("MK_GU_SPLIT",))]   # the build of schedules that split gate_up over K


@pytest.fixture(scope="module", params=BUILDS, ids=lambda b: "-".join((b[0],) + b[1]))
def compiled(request, tmp_path_factory):
    """(dtype, SASS text with line info) of the whole megakernel."""
    try:
        sass.nvdisasm_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    dtype, defines = request.param
    cubin = compile_or_skip(dtype, tmp_path_factory.mktemp("cubin"), defines)
    return dtype, sass.disassemble(cubin)


def test_attention_has_no_register_spills(compiled):
    dtype, text = compiled
    assert 'ops/attention.cuh", line' in text   # line info present, attention compiled in
    spills = {k: n for k, n in sass.spills_by_line(text).items() if k[0] == "attention.cuh"}
    assert not spills, f"register spills in attention ({dtype}): {spills}"


def test_matvec_inner_loops_have_no_register_spills(compiled):
    dtype, text = compiled
    spills = sass.spills_by_line(text)
    for name, markers in HOT_LINES.items():
        if name == "mk_mma.cuh" and dtype == "float32":
            continue   # the tensor-core path is bf16 only
        src = (CSRC / name).read_text().splitlines()
        base = name.rsplit("/", 1)[-1]   # spills_by_line keys by file name
        for marker in markers:
            starts = [i for i, s in enumerate(src) if marker in s]
            assert starts, f"{name}: no line contains {marker!r} (update HOT_LINES)"
            lines = []   # each marked statement, to the line that ends it (the SASS may name any)
            for i in starts:
                end = next(j for j in range(i, len(src)) if src[j].rstrip().endswith(";"))
                lines += range(i + 1, end + 2)
            assert any(f'{name}", line {n}' in text for n in lines), f"{name}:{lines} not in the SASS"
            hot = {n: spills[(base, n)] for n in lines if spills[(base, n)]}
            assert not hot, f"register spills on {name} lines {hot} ({marker!r}, {dtype})"


# The entry's stack frame is the whole call tree's, per thread (ptxas -v; NVRTC 13.0): 216 bytes
# in the bf16 build, 96 in the f32 one. It shares L1 with what shared memory leaves (256
# threads x 216 bytes = 54 KB): the 512-thread build's 456-byte frames were a 15 % slower step
# at batch 1 (isa.NTHREADS), and a 64-bit division in linear_tile (2026-12-07) took it to 288.
FRAME_MAX = {"bfloat16": 224, "float32": 128}


@pytest.mark.parametrize("dtype,defines", [("bfloat16", ()), ("float32", ()), ("bfloat16", ("MK_GU_SPLIT",))])
def test_megakernel_stack_frame_stays_small(dtype, defines):
    import torch
    frames = nvrtc_or_skip(sass.megakernel_frames, getattr(torch, dtype), defines)
    frame = frames["megakernel"][0]
    assert 0 < frame <= FRAME_MAX[dtype], (f"the {dtype} {defines} megakernel's stack frame is {frame} bytes per "
                                           f"thread (at most {FRAME_MAX[dtype]}): {frames}")


def test_stack_frames_are_read_from_the_ptxas_report():
    report = ("ptxas info    : Function properties for megakernel\n"
              "ptxas         .     288 bytes stack frame, 24 bytes spill stores, 44 bytes spill loads\n"
              "ptxas info    : Used 255 registers, used 1 barriers, 288 bytes cumulative stack size\n"
              "ptxas info    : Function properties for _Z6linearRK10KernelArgs\n"
              "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert sass.stack_frames(report) == {"megakernel": (288, 24, 44), "_Z6linearRK10KernelArgs": (0, 0, 0)}


def test_only_the_split_build_carries_the_k_split_code(compiled, request):
    """The default builds compile gate_up's K split out (MK_GU_SPLIT), so they keep the SASS
    that was timed; only schedules that split gate_up get that build (Megakernel). (The split's
    first version, compiled in with a KernelArgs member of its own, ran the unsplit path 7 % /
    25 % slower at batch 32 / 128; today's MK_GU_SPLIT build ran level with the default on the
    default schedule: H100, 2026-12-07.)"""
    _, text = compiled
    split = "MK_GU_SPLIT" in request.node.callspec.params["compiled"][1]
    assert ('ops/act.cuh", line' in text) == split
