"""The offline generation loop against a scripted EngineClient: positions, pages, EOS,
batching by max_batch, errors."""
from __future__ import annotations

import pytest

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams, StepResult
from tpmk.engine.generate import generate

EOS = 2


def _next(first: int, last: int, pos: int, seed: int) -> int:
    """Next token = (last token + position + the row's seed) % 50 + 10, except sequences whose
    prompt starts with 99 emit EOS at position 5."""
    return EOS if first == 99 and pos == 5 else (last + pos + seed) % 50 + 10


class ScriptedClient:
    """Emits _next for every row (so a row's SamplingParams must be its own); records every
    command."""
    world_size = 1

    def __init__(self):
        self.cmds = []

    def execute(self, cmd):
        self.cmds.append(cmd)
        if isinstance(cmd, Prefill):  # which prompt owns which pages, for the decode steps
            self.first_of = {tuple(pg): p[0] for p, pg in zip(cmd.tokens, cmd.pages)}
            return StepResult([_next(p[0], p[-1], len(p), s.seed) for p, s in zip(cmd.tokens, cmd.sampling)])
        firsts = [self.first_of[tuple(pg)] for pg in cmd.pages]
        return StepResult([_next(f, t, pos + 1, s.seed)
                           for f, t, pos, s in zip(firsts, cmd.tokens, cmd.positions, cmd.sampling)])

    def close(self):
        pass


def expected(prompt: list[int], n: int, seed: int = 0) -> list[int]:
    out, last, pos = [], prompt[-1], len(prompt)
    for _ in range(n):
        t = _next(prompt[0], last, pos, seed)
        out.append(t)
        if t == EOS:
            break
        last, pos = t, pos + 1
    return out


def run(prompts, n, max_batch=2, page_size=4, eos=(EOS,)):
    """Prompt i samples with seed i (the scripted tokens depend on it)."""
    rt = RuntimeConfig(max_batch=max_batch, page_size=page_size, max_seq_len=64)
    client = ScriptedClient()
    gens = generate(client, rt, prompts, n, [SamplingParams(seed=i) for i in range(len(prompts))], eos)
    return gens, client.cmds, rt


def test_tokens_positions_and_eos():
    """Every sequence's own tokens (its own seed, in the later batches too); EOS from a decode
    step and from the prefill itself (prompt 4: position 5 is its first new token), after
    which that sequence is in no Decode command."""
    prompts = [[1, 2, 3], [99, 4], [7], [5, 6, 7, 8, 9], [99, 1, 2, 3, 4]]
    gens, cmds, rt = run(prompts, 6)
    assert [g.token_ids for g in gens] == [expected(p, 6, i) for i, p in enumerate(prompts)]
    assert [g.finish_reason for g in gens] == ["length", "stop", "length", "length", "stop"]
    assert gens[1].token_ids[-1] == EOS and gens[4].token_ids == [EOS]
    # batches of max_batch=2: prefill, decodes..., prefill, decodes..., prefill
    prefills = [i for i, c in enumerate(cmds) if isinstance(c, Prefill)]
    assert len(prefills) == 3 and [len(cmds[i].tokens) for i in prefills] == [2, 2, 1]
    assert prefills[-1] == len(cmds) - 1   # the last prompt ended in its prefill: no decode
    for c in cmds:
        if isinstance(c, Prefill):
            for p, pg in zip(c.tokens, c.pages):
                assert len(pg) * rt.page_size >= len(p) + 6  # room for every new token
                assert len(set(pg)) == len(pg)
            assert len(c.pages) < 2 or not set(c.pages[0]) & set(c.pages[1])
        else:
            assert isinstance(c, Decode) and len(c.tokens) == len(c.positions) == len(c.pages)


def test_decode_positions_follow_the_prompt():
    gens, cmds, _ = run([[4, 5, 6]], 4, max_batch=1)
    decodes = [c for c in cmds if isinstance(c, Decode)]
    assert [c.positions for c in decodes] == [[3], [4], [5]]
    assert [c.tokens[0] for c in decodes] == gens[0].token_ids[:3]


def test_ignore_eos_runs_to_length():
    gens, _, _ = run([[99, 4]], 6, eos=())
    assert len(gens[0].token_ids) == 6 and gens[0].finish_reason == "length"


def test_pages_are_returned_between_batches():
    # 8 prompts, pool of exactly 2 sequences' worth of pages: only works if pages are freed.
    rt = RuntimeConfig(max_batch=2, page_size=4, max_seq_len=16, num_pages=2 * 4)
    prompts = [[i + 3] * 4 for i in range(8)]
    gens = generate(ScriptedClient(), rt, prompts, 12, [SamplingParams()] * 8)
    assert [len(g.token_ids) for g in gens] == [12] * 8


@pytest.mark.parametrize("prompts, n, match", [
    ([[1] * 60], 10, "max_seq_len=64"),
    ([[]], 4, "prompt 0 is empty"),
    ([[1]], 0, "max_new_tokens=0"),
])
def test_errors(prompts, n, match):
    with pytest.raises(ValueError, match=match):
        run(prompts, n)
