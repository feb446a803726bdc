"""Offline generation on the driver: Prefill, then one Decode per new token.

The driver owns the KV pages (PageAllocator); every sequence gets, up front,
the pages for its prompt plus max_new_tokens, and gives them back when the
batch ends. Prompts run in batches of at most runtime.max_batch; a sequence
leaves the decode batch when it samples an end-of-sequence token (kept in its
output, like transformers) or reaches max_new_tokens. `tpmk serve` builds
continuous batching on the same two commands.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.api import Decode, EngineClient, Prefill, SamplingParams


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]       # generated tokens, the end-of-sequence token included
    finish_reason: str         # "stop" (end-of-sequence token) | "length" (max_new_tokens)


@dataclass
class GenerateStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    new_tokens: int = 0


def load_tokenizer(model_dir: str):
    """The checkpoint's Hugging Face tokenizer (tokenizer.json + tokenizer_config.json)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def stop_token_ids(cfg: ModelConfig, model_dir: str | Path) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's: Llama-3 chat models list their
    end-of-turn token (<|eot_id|>) only there, and transformers' generate stops on both."""
    ids = set(cfg.eos_token_ids)
    gc = Path(model_dir) / "generation_config.json"
    if gc.exists():
        eos = json.loads(gc.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return tuple(sorted(ids))


def check_lengths(prompts: list[list[int]], max_new_tokens: int, runtime: RuntimeConfig) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        if len(p) + max_new_tokens > runtime.max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens + max_new_tokens={max_new_tokens} > "
                f"max_seq_len={runtime.max_seq_len}; shorten it or raise --max-seq-len")


def generate(client: EngineClient, runtime: RuntimeConfig, prompts: list[list[int]],
             max_new_tokens: int, sampling: list[SamplingParams],
             eos_token_ids: tuple[int, ...] = (),
             stats: GenerateStats | None = None) -> list[Generation]:
    from tpmk.engine.kv_cache import PageAllocator
    check_lengths(prompts, max_new_tokens, runtime)
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} SamplingParams for {len(prompts)} prompts")
    stats = stats if stats is not None else GenerateStats()
    allocator = PageAllocator(runtime.num_pages, runtime.page_size)
    eos = set(eos_token_ids)
    out: list[Generation] = []
    for start in range(0, len(prompts), runtime.max_batch):
        batch = list(range(start, min(len(prompts), start + runtime.max_batch)))
        pages = [allocator.allocate(len(prompts[i]) + max_new_tokens) for i in batch]
        try:
            t0 = time.perf_counter()
            first = client.execute(Prefill(tokens=[prompts[i] for i in batch], pages=pages,
                                           sampling=[sampling[i] for i in batch]))
            stats.prefill_s += time.perf_counter() - t0
            gens = [Generation(prompts[i], [t], "stop" if t in eos else "length")
                    for i, t in zip(batch, first.tokens)]
            live = [j for j, g in enumerate(gens) if g.finish_reason != "stop"]
            t0 = time.perf_counter()
            for _ in range(max_new_tokens - 1):
                if not live:
                    break
                res = client.execute(Decode(
                    tokens=[gens[j].token_ids[-1] for j in live],
                    positions=[len(gens[j].prompt_ids) + len(gens[j].token_ids) - 1 for j in live],
                    pages=[pages[j] for j in live],
                    sampling=[sampling[batch[j]] for j in live]))
                stats.decode_steps += 1
                for j, t in zip(live, res.tokens):
                    gens[j].token_ids.append(t)
                    if t in eos:
                        gens[j].finish_reason = "stop"
                live = [j for j in live if gens[j].finish_reason != "stop"]
            stats.decode_s += time.perf_counter() - t0
        finally:
            for p in pages:
                allocator.free(p)
        stats.new_tokens += sum(len(g.token_ids) for g in gens)
        out.extend(gens)
    return out
