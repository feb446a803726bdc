"""CPU interpreter of the instruction stream vs independent references (HF transformers
float32, and the reference engine when present); adversarial orders; mutation test."""
import random

import pytest
import torch

from _mk_helpers import empty_caches, shards_for
from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams
from tpmk.engine.interpreter_engine import InterpreterEngine
from tpmk.kernels.interpreter import VM
from tpmk.kernels.schedule import build_schedule

PROMPTS = [[5, 17, 300, 42, 7, 99], [3, 8, 11], [200, 201, 202, 203, 204, 205, 206, 207, 208]]
PAGE = 4


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        logits = model(out).logits[0]
    return out[0, len(prompt):].tolist(), logits[len(prompt) - 1:]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["tiny", "tiny-gqa"])
def test_engine_matches_hf_greedy(name, tp):
    """Prefill through the stream itself (tp 1, 4) or the reference engine (tp 2, 8)."""
    cfg = ModelConfig.from_name(name)
    model, shards = shards_for(cfg, tp, seed=tp)
    rt = RuntimeConfig(tp=tp, device="cpu", dtype="float32", max_batch=2, max_seq_len=32,
                       page_size=PAGE, num_pages=24)
    eng = InterpreterEngine(cfg, rt, shards, prefill="stream" if tp in (1, 4) else "reference")
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]  # batch 3 > bucket 2: two chunks
    greedy = [SamplingParams()] * 3
    res = eng.prefill(Prefill(PROMPTS, pages, greedy, return_logits=True))
    steps = 4
    got = [[t] for t in res.tokens]
    logits = [[torch.tensor(r)] for r in res.logits]
    for s in range(steps - 1):
        pos = [len(p) + s for p in PROMPTS]
        res = eng.decode(Decode([g[-1] for g in got], pos, pages, greedy, return_logits=True))
        for b in range(3):
            got[b].append(res.tokens[b])
            logits[b].append(torch.tensor(res.logits[b]))
    for b, p in enumerate(PROMPTS):
        want, want_logits = hf_greedy(model, p, steps)
        assert got[b] == want, f"seq {b}: interpreter {got[b]} != HF {want}"
        torch.testing.assert_close(torch.stack(logits[b]), want_logits[:steps], atol=2e-4, rtol=1e-4)


def _vm(name, tp, bucket, num_sms, seed=0):
    cfg = ModelConfig.from_name(name)
    _, shards = shards_for(cfg, tp, seed=seed)
    kc, vc = empty_caches(cfg, tp, num_pages=24, page_size=PAGE)
    return VM(cfg, build_schedule(cfg, tp, bucket, num_sms), shards, kc, vc)


def _run_prompts(vm, order, seed):
    """Lockstep over PROMPTS[:2] (batch 2, full bucket); every step's [logits | token]."""
    out = []
    for pos in range(len(PROMPTS[1])):
        toks = [PROMPTS[b][pos] for b in range(2)]
        got = vm.step(toks, [pos, pos], [[0, 1, 2], [3, 4, 5]], order=order, seed=seed, poison=True)
        out.append(torch.cat([vm.logits(), got[:, None].float()], dim=1))
    return torch.stack(out)


@pytest.mark.parametrize("name,tp", [("tiny", 2), ("tiny-gqa", 4), ("tiny", 8)])
def test_adversarial_orders_are_bit_identical(name, tp):
    base = _run_prompts(_vm(name, tp, 2, 3), "program", 0)
    assert torch.isfinite(base).all()
    for order, seed in [("queue", 1), ("queue", 2), ("adversarial", 3), ("adversarial", 4)]:
        got = _run_prompts(_vm(name, tp, 2, 3), order, seed)
        assert torch.equal(got, base), f"{order} seed {seed} differs from program order"


def test_mutation_removing_any_dependency_is_detected():
    """Remove one declared wait at a time (one instruction per (opcode, layer, wait) group)
    and run adversarial orders; a detected mutation changes logits or tokens.

    Every wait guards a read of a buffer that is NaN-poisoned before the step or
    rewritten earlier in the same step (x, q, KV, attn_part, act, slots, cand), and
    the mutated instruction becomes ready at once, so random priorities run it
    before its producer in most orders: we expect every mutation to be caught and
    require >= 90 % so a regression in the adversarial runner fails loudly."""
    name, tp, bucket, sms, seeds = "tiny-gqa", 2, 2, 3, 3
    base = _run_prompts(_vm(name, tp, bucket, sms), "program", 0)
    vm = _vm(name, tp, bucket, sms)
    groups = {}
    for idx, ins in enumerate(vm.sched.instructions):
        for w in range(len(ins.waits)):
            stage = ins.arg0 if ins.name == "residual" else -1
            groups.setdefault((ins.name, ins.layer, stage, w), []).append(idx)
    rng = random.Random(0)
    detected, missed = 0, []
    for key, idxs in sorted(groups.items()):
        vm = _vm(name, tp, bucket, sms)
        victim = vm.sched.instructions[rng.choice(idxs)]
        victim.waits = [wt for i, wt in enumerate(victim.waits) if i != key[3]]
        caught = False
        for seed in range(seeds):
            try:
                got = _run_prompts(vm, "adversarial", seed)
            except RuntimeError:
                caught = True
                break
            if not torch.equal(got, base):
                caught = True
                break
            vm = _vm(name, tp, bucket, sms)
            victim = vm.sched.instructions[rng.choice(idxs)]
            victim.waits = [wt for i, wt in enumerate(victim.waits) if i != key[3]]
        detected += caught
        if not caught:
            missed.append(key)
    frac = detected / len(groups)
    print(f"mutation test: {detected}/{len(groups)} dependency removals detected "
          f"({frac:.0%}); missed: {missed}")
    assert frac >= 0.9, f"only {frac:.0%} of removed dependencies detected; missed {missed}"


def test_queue_order_has_no_deadlock_with_one_sm():
    vm = _vm("tiny-gqa", 4, 2, 1)
    _run_prompts(vm, "queue", 0)


def test_reference_engine_agrees():
    ref_mod = pytest.importorskip("tpmk.engine.reference")
    cfg = ModelConfig.from_name("tiny-gqa")
    tp = 2
    _, shards = shards_for(cfg, tp, seed=7)
    rt = RuntimeConfig(tp=tp, device="cpu", dtype="float32", max_batch=3, max_seq_len=32,
                       page_size=PAGE, num_pages=24)
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    greedy = [SamplingParams()] * 3
    ref = ref_mod.ReferenceEngine(cfg, rt, shards)
    eng = InterpreterEngine(cfg, rt, shards, prefill="stream")
    a = ref.prefill(Prefill(PROMPTS, pages, greedy, return_logits=True))
    b = eng.prefill(Prefill(PROMPTS, pages, greedy, return_logits=True))
    assert a.tokens == b.tokens
    torch.testing.assert_close(torch.tensor(b.logits), torch.tensor(a.logits), atol=2e-4, rtol=1e-4)
    toks = a.tokens
    for s in range(3):
        pos = [len(p) + s for p in PROMPTS]
        a = ref.decode(Decode(toks, pos, pages, greedy, return_logits=True))
        b = eng.decode(Decode(toks, pos, pages, greedy, return_logits=True))
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(b.logits), torch.tensor(a.logits), atol=2e-4,
                                   rtol=1e-4)
        toks = a.tokens


@pytest.mark.parametrize("name,tp", [("tiny", 4), ("tiny-gqa", 8)])
def test_partition_plan_shards_match_test_sharder(name, tp):
    """The interpreter tests' sharder and tpmk.partition.plan must lay weights out the same."""
    plan = pytest.importorskip("tpmk.partition.plan")
    cfg = ModelConfig.from_name(name)
    model, mine = shards_for(cfg, tp)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    for r in range(tp):
        theirs = plan.shard_state_dict(sd, cfg, tp, r)
        for f in ("embed", "lm_head", "final_norm", "input_norm", "qkv", "o_proj", "post_norm",
                  "gate_up", "down"):
            assert torch.equal(getattr(theirs, f).float(), getattr(mine[r], f)), f"rank {r} {f}"


def test_queue_mode_reports_a_deadlock():
    """A wait on a counter that a later instruction of the same SM signals can never be met."""
    vm = _vm("tiny", 2, 1, 1)
    first = vm.sched.instructions[0]                       # embed tile 0, SM 0's first entry
    later = next(i for i in vm.sched.instructions if i.name == "argmax")
    first.waits = [(later.signal, 1)]
    with pytest.raises(RuntimeError, match="deadlock"):
        vm.step([1], [0], [[0]], order="queue")


def test_sampled_tokens_match_sampler_on_hf_logits():
    from tpmk.engine.sampling import sample
    cfg = ModelConfig.from_name("tiny-gqa")
    model, shards = shards_for(cfg, 2, seed=11)
    rt = RuntimeConfig(tp=2, device="cpu", dtype="float32", max_batch=3, max_seq_len=32,
                       page_size=PAGE, num_pages=24)
    eng = InterpreterEngine(cfg, rt, shards)
    params = [SamplingParams(temperature=0.9, seed=5), SamplingParams(),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=6)]
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    got = eng.prefill(Prefill(PROMPTS, pages, params)).tokens
    with torch.no_grad():
        last = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    want = sample(last, [len(p) - 1 for p in PROMPTS], params).tolist()
    assert got == want
