"""The offline generation loop against a scripted EngineClient: positions, pages, EOS,
batching by max_batch, errors."""
from __future__ import annotations

import pytest

from tpmk.config import RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams, StepResult
from tpmk.engine.generate import generate

EOS = 2


class ScriptedClient:
    """Next token = (last token + position) % 50 + 10, except sequences whose prompt starts
    with 99 emit EOS at position 5. Records every command."""
    world_size = 1

    def __init__(self):
        self.cmds = []

    def _next(self, first: int, last: int, pos: int) -> int:
        return EOS if first == 99 and pos == 5 else (last + pos) % 50 + 10

    def execute(self, cmd):
        self.cmds.append(cmd)
        if isinstance(cmd, Prefill):  # which prompt owns which pages, for the decode steps
            self.first_of = {tuple(pg): p[0] for p, pg in zip(cmd.tokens, cmd.pages)}
            return StepResult([self._next(p[0], p[-1], len(p)) for p in cmd.tokens])
        firsts = [self.first_of[tuple(pg)] for pg in cmd.pages]
        return StepResult([self._next(f, t, pos + 1)
                           for f, t, pos in zip(firsts, cmd.tokens, cmd.positions)])

    def close(self):
        pass


def expected(prompt: list[int], n: int) -> list[int]:
    out, last, pos = [], prompt[-1], len(prompt)
    for _ in range(n):
        t = EOS if prompt[0] == 99 and pos == 5 else (last + pos) % 50 + 10
        out.append(t)
        if t == EOS:
            break
        last, pos = t, pos + 1
    return out


def run(prompts, n, max_batch=2, page_size=4, eos=(EOS,)):
    rt = RuntimeConfig(max_batch=max_batch, page_size=page_size, max_seq_len=64)
    client = ScriptedClient()
    gens = generate(client, rt, prompts, n, [SamplingParams()] * len(prompts), eos)
    return gens, client.cmds, rt


def test_tokens_positions_and_eos():
    prompts = [[1, 2, 3], [99, 4], [7], [5, 6, 7, 8, 9]]
    gens, cmds, rt = run(prompts, 6)
    assert [g.token_ids for g in gens] == [expected(p, 6) for p in prompts]
    assert [g.finish_reason for g in gens] == ["length", "stop", "length", "length"]
    assert gens[1].token_ids[-1] == EOS
    # batches of max_batch=2: prefill, decodes..., prefill, decodes...
    prefills = [i for i, c in enumerate(cmds) if isinstance(c, Prefill)]
    assert len(prefills) == 2 and [len(cmds[i].tokens) for i in prefills] == [2, 2]
    for c in cmds:
        if isinstance(c, Prefill):
            for p, pg in zip(c.tokens, c.pages):
                assert len(pg) * rt.page_size >= len(p) + 6  # room for every new token
                assert len(set(pg)) == len(pg)
            assert not set(c.pages[0]) & set(c.pages[1])
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
