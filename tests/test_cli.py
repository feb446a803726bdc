"""`tpmk generate` end to end, greedy tokens vs Hugging Face transformers: tp=1 (inline) and
tp=2 (two local processes) as real subprocesses; the rest in-process through cli.main.
--help; errors that name the bad value."""
from __future__ import annotations

import pytest

from _cli_helpers import PROMPTS, hf_greedy, json_lines, prompt_args, run_tpmk
from tpmk.cli import main
from tpmk.launcher import resolve_model

NEW_TOKENS = 12
TEXT = "Hello, tpmk"


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-gqa"
    assert main(["make-checkpoint", "--config", "tiny-gqa", str(out)]) == 0
    return str(out)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import AutoTokenizer
    text_ids = AutoTokenizer.from_pretrained(tiny_dir)(TEXT)["input_ids"]
    return text_ids, hf_greedy(tiny_dir, [text_ids, *PROMPTS], NEW_TOKENS)


def _run_main(capsys, args: list[str]) -> list[dict]:
    assert main(args) == 0
    return json_lines(capsys.readouterr().out)


def test_generate_tp1_subprocess_matches_hf(tiny_dir, hf_tiny):
    """tp=1: inline launcher; a text prompt (checkpoint tokenizer) and id prompts."""
    text_ids, expected = hf_tiny
    r = run_tpmk(["generate", "--model", tiny_dir, "--device", "cpu", "--prompt", TEXT,
                  *prompt_args(), "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"])
    assert r.returncode == 0, r.stderr[-4000:]
    out = json_lines(r.stdout)
    assert [g["token_ids"] for g in out] == expected
    assert all(isinstance(g["text"], str) for g in out) and out[0]["text"]


def test_generate_tp2_local_subprocess_matches_hf(gqa_dir):
    """tp=2: two local worker processes (the default launcher), GQA checkpoint."""
    r = run_tpmk(["generate", "--model", gqa_dir, "--device", "cpu", "--tp", "2", *prompt_args(),
                  "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert [g["token_ids"] for g in json_lines(r.stdout)] == hf_greedy(gqa_dir, PROMPTS,
                                                                        NEW_TOKENS)


@pytest.mark.parametrize("extra", [[], ["--max-batch", "2", "--megakernel-max-batch", "1"]])
def test_generate_interpreter_engine_matches_hf(capsys, tiny_dir, hf_tiny, extra):
    """A virtual-TP engine: both ranks in one process (inline launcher by default). With
    --max-batch 2 --megakernel-max-batch 1, the first batch's two sequences decode through the
    reference engine and the last prompt alone through the stream."""
    out = _run_main(capsys, ["generate", "--model", tiny_dir, "--device", "cpu", "--tp", "2",
                             "--engine", "interpreter", *prompt_args(), "--max-new-tokens",
                             str(NEW_TOKENS), "--ignore-eos", "--json", *extra])
    assert [g["token_ids"] for g in out] == hf_tiny[1][1:]


def test_generate_sampling_flags_and_seed(capsys, tiny_dir):
    args = ["generate", "--model", tiny_dir, "--device", "cpu", "--prompt-ids", "1,2,3",
            "--max-new-tokens", "10", "--ignore-eos", "--json", "--temperature", "1.5",
            "--top-k", "50", "--top-p", "0.95"]
    a = _run_main(capsys, args + ["--seed", "7"])
    b = _run_main(capsys, args + ["--seed", "7"])
    c = _run_main(capsys, args + ["--seed", "8"])
    assert a == b and len(a[0]["token_ids"]) == 10
    assert a != c  # 10 tokens at temperature 1.5: a clash of two seeds is vanishingly rare


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_generate_stops_at_eos_unless_ignored(capsys, tiny_dir, hf_tiny, tmp_path, where):
    """A copy of tiny whose eos_token_id is HF's 4th greedy token for the first id prompt:
    generation must end right there (EOS kept), and run on with --ignore-eos. Llama-3 chat
    checkpoints list their end-of-turn id in generation_config.json only (as a list)."""
    import json
    import shutil
    expected = hf_tiny[1][1]
    eos = expected[3]
    stop_at = expected.index(eos) + 1
    ckpt = tmp_path / "tiny-eos"
    shutil.copytree(tiny_dir, ckpt)
    cfg = json.loads((ckpt / where).read_text())
    (ckpt / where).write_text(json.dumps({**cfg, "eos_token_id": eos if where == "config.json"
                                          else [cfg["eos_token_id"], eos]}))
    args = ["generate", "--model", str(ckpt), "--device", "cpu", *prompt_args(PROMPTS[:1]),
            "--max-new-tokens", str(NEW_TOKENS), "--json"]
    assert _run_main(capsys, args)[0]["token_ids"] == expected[:stop_at]
    assert _run_main(capsys, args + ["--ignore-eos"])[0]["token_ids"] == expected


def test_help_lists_commands_and_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    top = capsys.readouterr().out
    for cmd in ("generate", "make-checkpoint", "serve"):
        assert cmd in top
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    gen = capsys.readouterr().out
    for flag in ("--model", "--tp", "--engine", "--device", "--prompt", "--prompt-ids",
                 "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--json",
                 "--launcher", "--reduce", "--megakernel-max-batch"):
        assert flag in gen


@pytest.mark.parametrize("args, expected", [
    (["--tp", "3"], "tp=3"),
    (["--prompt-ids", "1,x"], "'1,x'"),
    (["--engine", "warp"], "'warp'"),
    (["--device", "tpu"], "'tpu'"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
    (["--model", "llama-3.1-8b"], "make-checkpoint"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "2000"], "max_seq_len=1024"),
    (["--prompt-ids", "100000"], "vocab_size"),
    (["--profile", "t.json"], "--profile needs --engine megakernel"),
    (["--reduce", "rsag"], "--reduce rsag needs --engine interpreter or megakernel"),
    (["--reduce", "ring"], "'ring'"),
    (["--megakernel-max-batch", "-1"], "megakernel_max_batch=-1"),
    (["--max-batch", "0"], "max_batch=0 must be >= 1 (--max-batch)"),
    (["--max-seq-len", "-5"], "max_seq_len=-5"),
    (["--engine", "megakernel"], "needs a CUDA GPU"),   # refused by the rank, no traceback
])
def test_errors_name_the_bad_value(capsys, args, expected):
    try:
        rc = main(["generate", "--device", "cpu", *args])
    except SystemExit as e:  # argparse rejects a malformed value itself
        rc = e.code
    assert rc != 0
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_device_cuda_without_a_gpu_is_a_clear_error(capsys):
    """Inline launcher (tp 1): the same one-line refusal as the local launcher's."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["generate", "--device", "cuda", "--prompt-ids", "5"]) != 0
    err = capsys.readouterr().err
    assert "no CUDA device is visible; use --device cpu" in err and "Traceback" not in err
