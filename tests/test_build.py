"""NVRTC build: every kernel source of the project compiles for sm_90a (no GPU needed)."""
from pathlib import Path

import pytest

from tpmk.kernels import build   # CI must install the cuda extra + NVRTC wheels: no skip here

SOURCES = sorted(build.CSRC.glob("*.cu"))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TPMK_CACHE", str(tmp_path / "cache"))


def _is_cubin(blob: bytes) -> bool:
    return blob[:4] == b"\x7fELF" and len(blob) > 1000


@pytest.mark.parametrize("variant", [(s, v) for s in SOURCES for v in build.source_variants(s)],
                         ids=lambda sv: f"{sv[0].name}[{' '.join(sv[1]) or 'default'}]")
def test_every_kernel_source_compiles_for_sm90a(variant):
    path, options = variant
    assert _is_cubin(build.compile_to_cubin(path, options=options, arch="sm_90a", use_cache=False))


def test_sources_found():
    names = {p.name for p in SOURCES}
    assert "allreduce.cu" in names, names


def test_compile_error_carries_nvrtc_log():
    src = 'extern "C" __global__ void k(int* p) { p[0] = undefined_symbol_xyz; }\n'
    with pytest.raises(build.CompileError, match="undefined_symbol_xyz"):
        build.compile_to_cubin(src, "broken.cu")


def test_cache_hit_and_key(tmp_path):
    src = 'extern "C" __global__ void k(int* p) { p[threadIdx.x] = 1; }\n'
    a = build.compile_to_cubin(src, "k.cu")
    files = list(build.cache_dir().glob("k_sm_90a_*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == a
    files[0].write_bytes(b"sentinel")                  # a hit returns the cached bytes
    assert build.compile_to_cubin(src, "k.cu") == b"sentinel"
    b = build.compile_to_cubin(src, "k.cu", options=("-DX=1",))  # new options: new entry
    assert _is_cubin(b) and len(list(build.cache_dir().glob("k_sm_90a_*.cubin"))) == 2


def test_cache_key_tracks_included_headers(tmp_path):
    (tmp_path / "h.cuh").write_text("#define V 1\n")
    cu = tmp_path / "main.cu"
    cu.write_text('#include "h.cuh"\nextern "C" __global__ void k(int* p) { p[0] = V; }\n')
    key = build._cache_key(cu.read_text(), [], "sm_90a", [tmp_path])
    (tmp_path / "h.cuh").write_text("#define V 2\n")
    assert build._cache_key(cu.read_text(), [], "sm_90a", [tmp_path]) != key


def test_cache_key_tracks_headers_under_the_callers_include_folders(tmp_path):
    """A header reached through an -I option: changing it compiles anew (it returned the old
    cubin, whose constant was the old one)."""
    inc = tmp_path / "inc"
    inc.mkdir()
    src = '#include "val.cuh"\nextern "C" __global__ void k(int* p) { p[0] = VAL; }\n'
    (inc / "val.cuh").write_text("#define VAL 1111\n")
    a = build.compile_to_cubin(src, "k.cu", options=(f"-I{inc}",))
    (inc / "val.cuh").write_text("#define VAL 2222\n")
    b = build.compile_to_cubin(src, "k.cu", options=(f"-I{inc}",))
    assert b != a and b == build.compile_to_cubin(src, "k.cu", options=(f"-I{inc}",), use_cache=False)
    assert build._include_roots(["-I", str(inc), "-DX", f"-I{tmp_path}"]) == [inc, tmp_path]


def test_source_variants(tmp_path):
    f = tmp_path / "x.cu"
    f.write_text("// nvrtc-variants: <default> ; -DA -DB ; -DC\n")
    assert build.source_variants(f) == [(), ("-DA", "-DB"), ("-DC",)]
    f.write_text("// nothing\n")
    assert build.source_variants(f) == [()]


def test_missing_source_path_is_clear():
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        build.compile_to_cubin(Path("/nonexistent/nope.cu"))


@pytest.mark.gpu
def test_compile_module_loads_on_this_gpu():
    import torch
    mod = build.compile_module(build.CSRC / "allreduce.cu", "allreduce.cu",
                               ("-DTPMK_COMM_GPU_SCOPE",), device=torch.cuda.current_device())
    assert mod.function("tpmk_allreduce_bf16") is not None
