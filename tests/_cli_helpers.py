"""Shared by test_cli and test_launcher: run `python -m tpmk`, and an independent
greedy reference (Hugging Face transformers LlamaForCausalLM, float32, full recompute)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = str(Path(__file__).resolve().parents[1])
PROMPTS = [[1, 5, 9, 200], [3], [7, *range(8, 24), 30]]  # 3 lengths: 4, 1, 18


def tpmk_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **extra)
    return env


def prompt_args(prompts=PROMPTS) -> list[str]:
    return [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]


def run_tpmk(args: list[str], timeout=240, prefix=(), **kw) -> subprocess.CompletedProcess:
    cmd = [*prefix, sys.executable, "-m", "tpmk", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=tpmk_env(), **kw)


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def hf_greedy(model_dir: str, prompts, max_new_tokens: int) -> list[list[int]]:
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(p):])
    return out
