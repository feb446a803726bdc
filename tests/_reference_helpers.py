"""Shared by tests/test_reference.py and its gloo worker processes (importable by name)."""
from __future__ import annotations

import random

import torch

from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams
from tpmk.engine.kv_cache import PageAllocator

PROMPTS = [[5, 6, 7, 8, 9], [3, 100, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
NEW_TOKENS = 32
PAGE_SIZE = 4


def hf_model(cfg: ModelConfig, seed: int = 0):
    """A float32 HF LlamaForCausalLM with random weights, norm weights perturbed away from 1."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg.to_hf_dict())).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def hf_greedy(model, prompts, n_new: int):
    """HF greedy by full recompute: (new tokens per prompt, logits of the last step [B, vocab])."""
    outs, last = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(n_new):
                logits = model(ids).logits[0, -1]
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            outs.append(ids[0, len(p):].tolist())
            last.append(logits)
    return outs, torch.stack(last)


def runtime(tp: int, **kw) -> RuntimeConfig:
    base = dict(tp=tp, device="cpu", dtype="float32", max_batch=8, max_seq_len=64,
                page_size=PAGE_SIZE, cuda_graphs=False)
    base.update(kw)
    return RuntimeConfig(**base)


def scattered_pages(rt: RuntimeConfig, prompts, n_new: int, seed: int = 1):
    """Page lists from an allocator whose free pages were shuffled: pages of different
    sequences interleave and are out of order, so the page table really matters."""
    alloc = PageAllocator(rt.num_pages, rt.page_size)
    taken = alloc.allocate(rt.num_pages * rt.page_size)
    random.Random(seed).shuffle(taken)
    pages = []
    for p in prompts:
        need = alloc.pages_for(len(p) + n_new)
        pages.append(taken[:need])
        taken = taken[need:]
    return pages


def generate(engine, rt, prompts, n_new: int, sampling: list[SamplingParams]):
    """Prefill + (n_new - 1) decodes: (new tokens per prompt, last step logits [B, vocab])."""
    pages = scattered_pages(rt, prompts, n_new)
    res = engine.prefill(Prefill(prompts, pages, sampling, return_logits=True))
    outs = [[t] for t in res.tokens]
    for _ in range(n_new - 1):
        res = engine.decode(Decode([o[-1] for o in outs],
                                   [len(p) + len(o) - 1 for p, o in zip(prompts, outs)],
                                   pages, sampling, return_logits=True))
        for o, t in zip(outs, res.tokens):
            o.append(t)
    return outs, torch.tensor(res.logits)


def forced_last_logits(engine, rt, prompts, forced: list[list[int]]):
    """Prefill, then decode feeding `forced` tokens (teacher forcing): logits of the last step,
    which predict token len(forced[b]) of each continuation. [B, vocab]."""
    n_new = len(forced[0])
    greedy = [SamplingParams()] * len(prompts)
    pages = scattered_pages(rt, prompts, n_new)
    engine.prefill(Prefill(prompts, pages, greedy))
    for s in range(n_new - 1):
        res = engine.decode(Decode([f[s] for f in forced], [len(p) + s for p in prompts], pages,
                                   greedy, return_logits=True))
    return torch.tensor(res.logits)


def gloo_worker(rank: int, world: int, port: int, name: str, state_dict, prompts, sampling,
                queue):
    """One process = one rank of tp=world over gloo; rank 0 reports its tokens."""
    import torch.distributed as dist

    from tpmk.engine.reference import ReferenceEngine
    from tpmk.partition.plan import shard_state_dict
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        cfg = ModelConfig.from_name(name)
        rt = runtime(world)
        engine = ReferenceEngine(cfg, rt, [shard_state_dict(state_dict, cfg, world, rank)],
                                 group=dist.group.WORLD)
        outs, logits = generate(engine, rt, prompts, NEW_TOKENS, sampling)
        queue.put((rank, outs, logits.tolist()))  # plain data: this process exits next
        dist.destroy_process_group()
    except Exception as e:  # surface the failure in the parent instead of a hang
        queue.put((rank, repr(e), None))
