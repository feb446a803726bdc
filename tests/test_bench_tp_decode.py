"""bench/tp_decode.py on the CPU: both engines through the local launcher (two processes),
timed rows written with the device name, and the interpreter's greedy tokens equal to
the reference engine's at every decode step (float32, so no near-ties to excuse)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tp_decode_bench_runs_both_engines_and_they_agree(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "tp_decode.py"), "--tp", "2", "--config", "tiny",
           "--device", "cpu", "--engines", "reference", "interpreter", "--batch", "1", "3",
           "--ctx", "12", "--warmup", "1", "--steps", "2", "--out", str(tmp_path / "out"),
           "--ckpt", str(tmp_path / "ckpt")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "tp_decode_cpu_tp2.json").read_text())
    assert result["device"] == "cpu" and result["tp"] == 2
    rows = {(r["engine"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(e, b) for e in ("reference", "interpreter") for b in (1, 3)}
    for (engine, batch), r in rows.items():
        assert r["step_ms"] > 0 and r["tok_s"] == batch * 1e3 / r["step_ms"]
        assert r["same_tokens"] == 1.0, f"{engine} batch {batch}: tokens differ from the reference"
    assert "interpreter     3" in run.stdout   # the printed table


def test_tp_decode_bench_refuses_a_model_that_cannot_fit_the_cpu():
    """The GPU default (an 8-layer Llama-3-70B) on a CPU machine: ~36 GB of float32 shards,
    refused (before any checkpoint is written) on a 24 GB machine, naming the size and a
    shape that fits; the tiny shape passes."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tp_decode", ROOT / "bench" / "tp_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from tpmk.config import ModelConfig
    big = ModelConfig.from_name("llama-3-70b").replace(num_hidden_layers=8)
    with pytest.raises(SystemExit, match=r"llama-3-70b with 8 layers .* needs ~3\d GB, 24 GB are free.*--config tiny"):
        bench.check_fits_cpu(big, 24 * 10**9)
    bench.check_fits_cpu(ModelConfig.from_name("tiny"), 24 * 10**9)
