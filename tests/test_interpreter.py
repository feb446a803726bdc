"""CPU interpreter of the instruction stream vs independent references (HF transformers
float32, and the reference engine when present); adversarial orders; mutation test."""
import random

import pytest
import torch

from _mk_helpers import (TIE_GROUPS, empty_caches, shards_for, stable_topk, tie_lm_head,
                         tie_topk_ids, topk_near_ties, with_lm_head)
from tpmk.config import ModelConfig, RuntimeConfig
from tpmk.engine.api import Decode, Prefill, SamplingParams
from tpmk.engine.interpreter_engine import InterpreterEngine
from tpmk.kernels.interpreter import VM
from tpmk.kernels.isa import MMA_MIN_BATCH, TOPK
from tpmk.kernels.schedule import build_schedule

PROMPTS = [[5, 17, 300, 42, 7, 99], [3, 8, 11], [200, 201, 202, 203, 204, 205, 206, 207, 208]]
PAGE = 4


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        logits = model(out).logits[0]
    return out[0, len(prompt):].tolist(), logits[len(prompt) - 1:]


# hidden 100: the megakernel's 16-byte loads need a multiple of 8, the stream does not
CONFIGS = {"hidden-100": ModelConfig.from_name("tiny-gqa").replace(
    name="hidden-100", hidden_size=100, num_attention_heads=4, num_key_value_heads=2, head_dim=32)}


@pytest.mark.parametrize("name,tp,reduce", [(n, t, "oneshot") for n in ("tiny", "tiny-gqa")
                                             for t in (1, 2, 4, 8)]
                         + [("tiny-gqa", 4, "rsag"), ("tiny", 8, "rsag"),
                            ("hidden-100", 4, "oneshot"), ("hidden-100", 4, "rsag")])
def test_engine_matches_hf_greedy(name, tp, reduce):
    """Prefill through the stream itself (tp 1, 4) or the reference engine (tp 2, 8)."""
    cfg = CONFIGS.get(name) or ModelConfig.from_name(name)
    model, shards = shards_for(cfg, tp, seed=tp)
    rt = RuntimeConfig(tp=tp, device="cpu", dtype="float32", max_batch=2, max_seq_len=32,
                       page_size=PAGE, num_pages=24, reduce=reduce)
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



def test_each_step_runs_the_smallest_bucket_that_holds_it():
    """max_batch 8: one schedule per bucket 1 / 2 / 4 / 8 on the same caches. Three sequences
    run bucket 4, then sequence 0 alone bucket 1 (whose schedule differs: more attention
    splits); every sequence's tokens are HF's greedy ones."""
    cfg = ModelConfig.from_name("tiny-gqa")
    model, shards = shards_for(cfg, 2, seed=5)
    rt = RuntimeConfig(tp=2, device="cpu", dtype="float32", max_batch=8, max_seq_len=32,
                       page_size=PAGE, num_pages=24)
    eng = InterpreterEngine(cfg, rt, shards)
    assert {b: vm.sched.bucket for b, vm in eng.vms.items()} == {1: 1, 2: 2, 4: 4, 8: 8}
    assert eng.vms[1].sched.num_splits > eng.vms[8].sched.num_splits
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    greedy = [SamplingParams()] * 3
    got = [[t] for t in eng.prefill(Prefill(PROMPTS, pages, greedy)).tokens]
    res = eng.decode(Decode([g[-1] for g in got], [len(p) for p in PROMPTS], pages, greedy))
    assert eng.vm.sched.bucket == 4
    for b in range(3):
        got[b].append(res.tokens[b])
    for s in range(3):
        res = eng.decode(Decode([got[0][-1]], [len(PROMPTS[0]) + 1 + s], pages[:1], greedy[:1]))
        assert eng.vm.sched.bucket == 1
        got[0].append(res.tokens[0])
    assert got[0] == hf_greedy(model, PROMPTS[0], 5)[0]
    for b in (1, 2):
        assert got[b] == hf_greedy(model, PROMPTS[b], 2)[0]


def test_steps_above_megakernel_max_batch_decode_through_the_reference_engine(monkeypatch):
    """max_batch 4, megakernel_max_batch 2: schedules for buckets 1 and 2 only; a step of three
    sequences decodes through the reference engine, on the same KV caches (no second
    allocation), and the stream's later steps read the KV it wrote: HF's greedy tokens
    throughout."""
    from tpmk.engine.kv_cache import KVCache
    allocated = []
    real = KVCache.allocate.__func__
    monkeypatch.setattr(KVCache, "allocate", classmethod(
        lambda cls, *a, **k: allocated.append(1) or real(cls, *a, **k)))
    cfg = ModelConfig.from_name("tiny-gqa")
    model, shards = shards_for(cfg, 2, seed=6)
    rt = RuntimeConfig(tp=2, device="cpu", dtype="float32", max_batch=4, max_seq_len=32,
                       page_size=PAGE, num_pages=24, megakernel_max_batch=2)
    assert rt.stream_max_batch == 2
    eng = InterpreterEngine(cfg, rt, shards)
    assert sorted(eng.vms) == [1, 2]
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    greedy = [SamplingParams()] * 3
    got = [[t] for t in eng.prefill(Prefill(PROMPTS, pages, greedy)).tokens]
    for s in range(2):   # all three: the reference engine
        res = eng.decode(Decode([g[-1] for g in got], [len(p) + s for p in PROMPTS], pages, greedy))
        assert res.extra.get("decoded_by") == "reference"
        for b in range(3):
            got[b].append(res.tokens[b])
    for s in range(2):   # sequences 0 and 1: the stream's bucket 2
        live = [0, 1]
        res = eng.decode(Decode([got[b][-1] for b in live], [len(PROMPTS[b]) + 2 + s for b in live],
                                pages[:2], greedy[:2]))
        assert "decoded_by" not in res.extra and eng.vm.sched.bucket == 2
        for b in live:
            got[b].append(res.tokens[b])
    assert eng._reference_engine().caches is eng.caches
    assert len(allocated) == 2   # one KV cache per rank, the engine's
    for b in range(3):
        assert got[b] == hf_greedy(model, PROMPTS[b], 5 if b < 2 else 3)[0], f"seq {b}"


def test_buckets_stop_at_the_first_that_does_not_fit_shared_memory(capsys):
    """An engine whose buckets above 2 need more shared memory than an SM has (as the
    megakernel's do for Llama-3.1-8B at tp 1 from bucket 4) keeps buckets 1 and 2, says so,
    and decodes larger steps through the reference engine: HF's greedy tokens. A model whose
    bucket 1 does not fit is refused."""
    from tpmk.kernels.megakernel import SharedMemoryError

    class Narrow(InterpreterEngine):
        limit = 2

        def build_vm(self, bucket):
            if bucket > self.limit:
                raise SharedMemoryError(f"megakernel needs 300000 B of shared memory at batch bucket {bucket}")
            return super().build_vm(bucket)
    cfg = ModelConfig.from_name("tiny-gqa")
    model, shards = shards_for(cfg, 2, seed=8)
    rt = RuntimeConfig(tp=2, device="cpu", dtype="float32", max_batch=8, max_seq_len=32,
                       page_size=PAGE, num_pages=24)
    eng = Narrow(cfg, rt, shards)
    assert eng.buckets == [1, 2]
    assert "bucket 4; steps of more than 2 sequences decode through the reference engine" in \
        capsys.readouterr().err
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    greedy = [SamplingParams()] * 3
    got = [[t] for t in eng.prefill(Prefill(PROMPTS, pages, greedy)).tokens]
    res = eng.decode(Decode([g[-1] for g in got], [len(p) for p in PROMPTS], pages, greedy))
    assert res.extra.get("decoded_by") == "reference"
    for b in range(3):
        got[b].append(res.tokens[b])
    res = eng.decode(Decode([g[-1] for g in got[:2]], [len(p) + 1 for p in PROMPTS[:2]], pages[:2],
                            greedy[:2]))
    assert "decoded_by" not in res.extra and eng.vm.sched.bucket == 2
    for b in range(2):
        got[b].append(res.tokens[b])
    for b in range(3):
        assert got[b] == hf_greedy(model, PROMPTS[b], 3 if b < 2 else 2)[0], f"seq {b}"
    Narrow.limit = 0
    with pytest.raises(SharedMemoryError, match="bucket 1"):
        Narrow(cfg, rt, shards)


def test_vm_refuses_a_bad_header_or_shards():
    """Each check of VM.set_header / VM(): a position on the first token past its pages, a page
    id == num_pages, one sequence past the bucket, one shard short."""
    vm = _vm("tiny", 2, 2, 4)
    cfg = ModelConfig.from_name("tiny")
    _, shards = shards_for(cfg, 2)
    with pytest.raises(ValueError, match="position 12 is past its 3 pages"):
        vm.set_header([1], [3 * PAGE], [[0, 1, 2]])
    with pytest.raises(ValueError, match="page ids .* outside 0..23"):
        vm.set_header([1], [0], [[24]])
    with pytest.raises(ValueError, match="batch=3 must be in 1..bucket=2"):
        vm.set_header([1, 1, 1], [0] * 3, [[0]] * 3)
    kc, vc = empty_caches(cfg, 2, num_pages=24, page_size=PAGE)
    with pytest.raises(ValueError, match="1 shards for a tp=2 schedule"):
        VM(cfg, build_schedule(cfg, 2, 2, 4), shards[:1], kc[:1], vc[:1])


@pytest.mark.parametrize("what", ["tokens", "top-k"])
def test_ranks_that_disagree_are_an_error(monkeypatch, what):
    """Every rank merges the same candidates into the same tokens and top-k; a rank whose
    argmax differs (a corrupted copy) makes the step fail, naming the rank."""
    from tpmk.kernels.ops import Argmax
    real = Argmax.execute

    def skewed(self, vm, rank):
        real(self, vm, rank)
        if rank == 1:
            st = vm.ranks[rank]
            if what == "tokens":
                st.tokens_out[:vm.batch] += 1
            else:
                st.topk_values[:vm.batch, -1] -= 1.0
    monkeypatch.setattr(Argmax, "execute", skewed)
    vm = _vm("tiny", 2, 2, 4)
    with pytest.raises(RuntimeError, match=f"rank 1 {'tokens' if what == 'tokens' else 'top-'}"):
        vm.step([1, 2], [0, 0], [[0], [1]])


def test_each_rank_s_first_embedding_row_and_the_padded_vocab():
    """Token 0 and token vp (the first row of rank 1's vocab slice: tiny-gqa's 500 ids pad to
    2 x 256 at tp 2) against HF; at a bf16-free float32 step no padded id (>= 500) is ever
    among the top-k candidates, even where every real logit is negative."""
    from tpmk.partition.weights import padded_vocab
    cfg, tp = ModelConfig.from_name("tiny-gqa"), 2
    vp = padded_vocab(cfg, tp) // tp
    model, shards = shards_for(cfg, tp, seed=11)
    prompts = [[0, vp, 7], [vp, 0, vp + 1]]
    with torch.no_grad():
        hidden = model.model(torch.tensor(prompts)).last_hidden_state[:, -1]   # final-normed
    # every lm_head row a positive multiple of -(h0 / |h0| + h1 / |h1|): all real logits < 0,
    # so a padded id left at logit 0 would top the candidates
    v = -(hidden / hidden.norm(dim=-1, keepdim=True)).sum(0)
    w = v * (1 + torch.rand(cfg.vocab_size, 1, generator=torch.Generator().manual_seed(0)))
    kc, vc = empty_caches(cfg, tp, num_pages=24, page_size=PAGE)
    vm = VM(cfg, build_schedule(cfg, tp, 2, 8), with_lm_head(shards, cfg, w), kc, vc)
    for pos in range(3):
        vm.step([p[pos] for p in prompts], [pos, pos], [[0, 1, 2], [3, 4, 5]])
    want = hidden @ w.T
    assert want.max() < 0
    torch.testing.assert_close(vm.logits(), want, atol=2e-4, rtol=1e-4)
    _, ids = vm.topk()
    assert (ids < cfg.vocab_size).all()
    assert ids.tolist() == stable_topk(want, TOPK)[1].tolist()


def test_megakernel_max_batch_is_validated():
    with pytest.raises(ValueError, match="megakernel_max_batch=-1 must be >= 0"):
        RuntimeConfig(megakernel_max_batch=-1)
    assert RuntimeConfig(max_batch=8, megakernel_max_batch=0).stream_max_batch == 8
    assert RuntimeConfig(max_batch=8, megakernel_max_batch=32).stream_max_batch == 8
    assert RuntimeConfig(max_batch=128).stream_max_batch == 32


def _bf16_batch_against_hf(seed: int, B: int, steps: int, order: str = "program", **sched_kw):
    """tiny-gqa tp 2 with bf16 weights, B lockstep sequences of `steps` tokens (batch >=
    MMA_MIN_BATCH: bf16 matvec inputs) on the interpreter, against HF float32 on the same
    bf16-rounded weights: within bf16 tolerance, same argmax."""
    cfg = ModelConfig.from_name("tiny-gqa").replace(dtype="bfloat16")
    model, shards = shards_for(cfg, 2, seed=seed, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    prompts = [[5 + 7 * b, 17, 300 - b, 42, 9][:steps] for b in range(B)]
    kc, vc = empty_caches(cfg, 2, num_pages=2 * B, page_size=PAGE, dtype=torch.bfloat16)
    vm = VM(cfg, build_schedule(cfg, 2, B, 8, **sched_kw), shards, kc, vc)
    for pos in range(steps):
        vm.step([p[pos] for p in prompts], [pos] * B, [[2 * b, 2 * b + 1] for b in range(B)],
                order=order, seed=pos, poison=order != "program")
    assert vm.tensor_cores
    with torch.no_grad():
        want = model(torch.tensor(prompts)).logits[:, -1]
    got = vm.logits()
    assert float((got - want).abs().max() / want.abs().max()) < 3e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_tensor_core_batch_takes_bf16_inputs_within_bf16_tolerance_of_hf():
    """bf16 weights at batch >= MMA_MIN_BATCH: the interpreter rounds every matvec input to
    bf16 as the megakernel's tensor cores do (the RMSNorm's 1 / rms applied after the dot);
    HF float32 on the same bf16-rounded weights still agrees within bf16 tolerance."""
    _bf16_batch_against_hf(seed=3, B=MMA_MIN_BATCH + 1, steps=5)


@pytest.mark.parametrize("batch", [MMA_MIN_BATCH, MMA_MIN_BATCH + 3])
def test_tensor_core_matvecs_round_their_inputs_to_bf16_from_mma_min_batch(batch):
    """From batch MMA_MIN_BATCH on (bf16 weights) the matvecs take bf16 inputs, the fused
    RMSNorm's 1 / rms applied after the dot products, as the megakernel's tensor cores: a
    float64 computation with that rounding, tighter than the rounding's own effect."""
    cfg = ModelConfig.from_name("tiny-gqa").replace(dtype="bfloat16")
    _, shards = shards_for(cfg, 2, seed=12, dtype=torch.bfloat16)
    kc, vc = empty_caches(cfg, 2, num_pages=8, page_size=PAGE, dtype=torch.bfloat16)
    vm = VM(cfg, build_schedule(cfg, 2, 8, 8), shards, kc, vc)
    vm.batch = batch
    assert vm.tensor_cores
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, cfg.hidden_size, generator=g)
    nw = (torch.rand(cfg.hidden_size, generator=g) + 0.5).to(torch.bfloat16).float()   # a bf16 weight
    w = (torch.randn(40, cfg.hidden_size, generator=g) * 0.05).to(torch.bfloat16)
    r = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    xr = (x * nw).to(torch.bfloat16).double()
    for got, want, plain in ((vm.norm_matvec(x, nw, w), xr @ w.double().T * r,
                              (x.double() * nw.double()) @ w.double().T * r),
                             (vm.matvec(x, w), x.to(torch.bfloat16).double() @ w.double().T,
                              x.double() @ w.double().T)):
        err, effect = (got.double() - want).abs().max(), (plain - want).abs().max()
        assert err < effect / 20, (float(err), float(effect))
    vm.batch = MMA_MIN_BATCH - 1
    assert not vm.tensor_cores


@pytest.mark.parametrize("qkv_pairs", [1, 3, 8])
def test_any_qkv_tile_height_matches_hf(qkv_pairs):
    """build_schedule(qkv_pairs=...): qkv tiles of 1, 3 (the head's last one shorter) and all 8
    of a head's rotary pairs give HF's logits, in adversarial order."""
    cfg = ModelConfig.from_name("tiny-gqa")
    model, shards = shards_for(cfg, 2, seed=4)
    kc, vc = empty_caches(cfg, 2, num_pages=24, page_size=PAGE)
    sched = build_schedule(cfg, 2, 2, 5, qkv_pairs=qkv_pairs)
    assert {i.nrows for i in sched.instructions if i.name == "qkv"} == (
        {qkv_pairs} if 8 % qkv_pairs == 0 else {qkv_pairs, 8 % qkv_pairs})
    vm = VM(cfg, sched, shards, kc, vc)
    prompts = [p[:3] for p in PROMPTS[:2]]
    for pos in range(3):
        vm.step([p[pos] for p in prompts], [pos, pos], [[0, 1, 2], [3, 4, 5]], order="adversarial", seed=pos)
    with torch.no_grad():
        want = model(torch.tensor(prompts)).logits[:, -1]
    torch.testing.assert_close(vm.logits(), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("gu_splits,tp,sms", [(2, 2, 5), (4, 1, 8), (16, 2, 3)])
def test_gate_up_split_over_k_matches_hf(gu_splits, tp, sms):
    """build_schedule(gu_splits=S): gate_up tiles over 1 / S of the hidden size each (the
    RMSNorm still the whole row's), ACT summing the slices, give HF's logits in adversarial
    order (S = 16: slices of 8 columns)."""
    cfg = ModelConfig.from_name("tiny-gqa")
    model, shards = shards_for(cfg, tp, seed=5)
    kc, vc = empty_caches(cfg, tp, num_pages=24, page_size=PAGE)
    sched = build_schedule(cfg, tp, 2, sms, gu_splits=gu_splits)
    assert {i.arg1 for i in sched.instructions if i.name == "gate_up"} == {gu_splits}
    vm = VM(cfg, sched, shards, kc, vc)
    prompts = [p[:3] for p in PROMPTS[:2]]
    for pos in range(3):
        vm.step([p[pos] for p in prompts], [pos, pos], [[0, 1, 2], [3, 4, 5]], order="adversarial",
                seed=pos, poison=True)
    with torch.no_grad():
        want = model(torch.tensor(prompts)).logits[:, -1]
    torch.testing.assert_close(vm.logits(), want, atol=2e-4, rtol=1e-4)


def test_gate_up_split_over_k_on_tensor_cores_within_bf16_tolerance_of_hf():
    """The bf16 path (batch >= MMA_MIN_BATCH) of a K-split gate_up: each slice of x * norm_w
    rounded to bf16, 1 / rms of the whole row after the dot products."""
    _bf16_batch_against_hf(seed=6, B=MMA_MIN_BATCH + 2, steps=4, order="adversarial", gu_splits=4)


def _vm(name, tp, bucket, num_sms, seed=0, reduce="oneshot", splits=0, gu_splits=1):
    cfg = ModelConfig.from_name(name)
    _, shards = shards_for(cfg, tp, seed=seed)
    kc, vc = empty_caches(cfg, tp, num_pages=24, page_size=PAGE)
    sched = build_schedule(cfg, tp, bucket, num_sms, num_splits=splits, reduce=reduce, gu_splits=gu_splits)
    return VM(cfg, sched, shards, kc, vc)


def _run_prompts(vm, order, seed):
    """Lockstep over PROMPTS[:2] (batch 2, full bucket); every step's [logits | token | top-k]."""
    out = []
    for pos in range(len(PROMPTS[1])):
        toks = [PROMPTS[b][pos] for b in range(2)]
        got = vm.step(toks, [pos, pos], [[0, 1, 2], [3, 4, 5]], order=order, seed=seed, poison=True)
        values, ids = vm.topk()
        out.append(torch.cat([vm.logits(), got[:, None].float(), values, ids.float()], dim=1))
    return torch.stack(out)


@pytest.mark.parametrize("name,tp,reduce,splits,gu", [("tiny", 2, "oneshot", 0, 1), ("tiny-gqa", 4, "oneshot", 0, 1),
                                                       ("tiny", 8, "oneshot", 0, 1), ("tiny-gqa", 4, "rsag", 0, 1),
                                                       ("tiny", 8, "rsag", 0, 1), ("tiny-gqa", 2, "oneshot", 3, 1),
                                                       ("tiny", 2, "rsag", 0, 4)])
def test_adversarial_orders_are_bit_identical(name, tp, reduce, splits, gu):
    """splits=3: whichever split of a group runs last merges it (early steps have empty splits).
    gu=4: gate_up in 4 K slices, summed by ACT in slice order whatever order they ran in."""
    kw = dict(reduce=reduce, splits=splits, gu_splits=gu)
    base = _run_prompts(_vm(name, tp, 2, 3, **kw), "program", 0)
    assert torch.isfinite(base).all()
    for order, seed in [("queue", 1), ("queue", 2), ("adversarial", 3), ("adversarial", 4)]:
        got = _run_prompts(_vm(name, tp, 2, 3, **kw), order, seed)
        assert torch.equal(got, base), f"{order} seed {seed} differs from program order"
    if splits > 1 or gu > 1:   # against one split / slice (a float32 re-association)
        one = _run_prompts(_vm(name, tp, 2, 3, reduce=reduce, splits=1), "program", 0)
        torch.testing.assert_close(base, one, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,tp,sms", [("tiny", 2, 3), ("tiny-gqa", 4, 5), ("tiny-gqa", 8, 2)])
def test_reduce_scatter_all_gather_equals_one_shot(name, tp, sms):
    """Both reductions sum the tp partials of a column in rank order: same bits. (One-shot
    itself is checked against HF above.) sms=2 < tp: a rank owns several tiles or none."""
    oneshot = _run_prompts(_vm(name, tp, 2, sms), "program", 0)
    rsag = _run_prompts(_vm(name, tp, 2, sms, reduce="rsag"), "adversarial", 1)
    assert torch.isfinite(rsag).all()
    assert torch.equal(rsag, oneshot)


@pytest.mark.parametrize("reduce,splits,gu_splits", [("oneshot", 0, 1), ("rsag", 0, 1), ("oneshot", 3, 1),
                                                     ("oneshot", 0, 2)])
def test_mutation_removing_any_dependency_is_detected(reduce, splits, gu_splits):
    """Remove one declared wait at a time (one instruction per (opcode, layer, wait) group)
    and run adversarial orders; a detected mutation changes logits or tokens.

    Every wait guards a read of a buffer that is NaN-poisoned before the step or
    rewritten earlier in the same step (x, q, KV, attn_part, act, gu_part, slots, cand), and
    the mutated instruction becomes ready at once, so random priorities run it
    before its producer in most orders: we expect every mutation to be caught and
    require >= 90 % so a regression in the adversarial runner fails loudly."""
    name, tp, bucket, sms, seeds = "tiny-gqa", 2, 2, 3, 3
    base = _run_prompts(_vm(name, tp, bucket, sms, reduce=reduce, splits=splits, gu_splits=gu_splits), "program", 0)
    vm = _vm(name, tp, bucket, sms, reduce=reduce, splits=splits, gu_splits=gu_splits)
    groups = {}
    for idx, ins in enumerate(vm.sched.instructions):
        for w in range(len(ins.waits)):
            stage = ins.arg0 if ins.name == "residual" else -1
            groups.setdefault((ins.name, ins.layer, stage, w), []).append(idx)
    rng = random.Random(0)
    detected, missed = 0, []
    for key, idxs in sorted(groups.items()):
        vm = _vm(name, tp, bucket, sms, reduce=reduce, splits=splits, gu_splits=gu_splits)
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
            vm = _vm(name, tp, bucket, sms, reduce=reduce, splits=splits, gu_splits=gu_splits)
            victim = vm.sched.instructions[rng.choice(idxs)]
            victim.waits = [wt for i, wt in enumerate(victim.waits) if i != key[3]]
        detected += caught
        if not caught:
            missed.append(key)
    frac = detected / len(groups)
    print(f"mutation test ({reduce}, splits {vm.num_splits}, gate_up slices {gu_splits}): {detected}/{len(groups)} dependency removals detected "
          f"({frac:.0%}); missed: {missed}")
    assert frac >= 0.9, f"only {frac:.0%} of removed dependencies detected; missed {missed}"


def test_queue_order_has_no_deadlock_with_one_sm():
    vm = _vm("tiny-gqa", 4, 2, 1)
    _run_prompts(vm, "queue", 0)


def test_reference_engine_agrees():
    from tpmk.engine import reference as ref_mod   # a plain import: a broken module must fail here
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
    from tpmk.partition import plan
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


@pytest.mark.parametrize("order", ["program", "adversarial"])
def test_a_stall_names_the_first_unmet_wait(order):
    """One gate_up tile of layer 1 waits for a count its counter never reaches: everything
    downstream (its down tiles, the residual, layer 2 ...) is stuck too, but the error names
    that tile: the lowest stage with an unmet wait (Schedule.first_unmet_wait, which the GPU
    timeout message uses too)."""
    vm = _vm("tiny-gqa", 2, 2, 4)
    gate_ups = [i for i in vm.sched.instructions if i.name == "gate_up" and i.layer == 1]
    bad = gate_ups[len(gate_ups) // 2]
    bad.waits = [(bad.waits[0][0], 10_000)]
    stage = vm.sched.stage_of("gate_up", 1)
    with pytest.raises(RuntimeError, match=rf"first unmet wait: stage {stage} \(gate_up\[layer 1\]\): "
                                           rf"gate_up\(layer=1, tile={bad.tile},.* on rank 0 SM \d+ waits "
                                           rf"for counter ready\[stage \d+\] = \d+ < 10000"):
        vm.step([1, 2], [0, 0], [[0, 1], [2, 3]], order=order)


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


def _lockstep_topk(vm, prompts):
    """Feed the prompts in lockstep (rows drop out as they end): per step, the live rows and
    the VM's (values, ids, logits)."""
    for pos in range(max(map(len, prompts))):
        live = [b for b, p in enumerate(prompts) if pos < len(p)]
        vm.step([prompts[b][pos] for b in live], [pos] * len(live),
                [list(range(6 * b, 6 * b + 6)) for b in live], order="queue", seed=pos)
        yield pos, live, (*vm.topk(), vm.logits())


@pytest.mark.parametrize("sms", [2, 3])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["tiny", "tiny-gqa"])
def test_topk_matches_torch_sort_of_own_and_hf_logits(name, tp, sms):
    """Global top-TOPK (several tiles per rank, batch 3 then fewer rows; argmax tiles of one
    row each on 3 SMs, of 2 and 1 rows on 2 SMs) == the stable top-k of the interpreter's own
    full logits (bit for bit) and of HF float32 logits (near-ties only)."""
    cfg = ModelConfig.from_name(name)
    model, shards = shards_for(cfg, tp, seed=tp)
    kc, vc = empty_caches(cfg, tp, num_pages=24, page_size=PAGE)
    vm = VM(cfg, build_schedule(cfg, tp, 3, sms), shards, kc, vc)
    assert sorted((i.row0, i.nrows) for i in vm.sched.instructions if i.name == "argmax") == \
        ([(0, 1), (1, 1), (2, 1)] if sms == 3 else [(0, 2), (2, 1)])
    assert vm.sched.n_lm_tiles >= sms
    with torch.no_grad():
        hf = [model(torch.tensor([p])).logits[0] for p in PROMPTS]         # [len, vocab] each
    for pos, live, (values, ids, logits) in _lockstep_topk(vm, PROMPTS):
        assert values.shape == (len(live), TOPK) and ids.dtype == torch.int64
        want_v, want_i = stable_topk(logits, TOPK)
        assert torch.equal(ids, want_i) and torch.equal(values, want_v), f"pos {pos}"
        ties = topk_near_ties(values, ids, torch.stack([hf[b][pos] for b in live]), atol=2e-4)
        assert not ties, f"pos {pos}: near-ties with HF (possible but unexpected here): {ties}"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["tiny", "tiny-gqa"])
def test_topk_exact_ties_go_to_the_lowest_id(name, tp):
    """Crafted head (TIE_GROUPS): logits tie bit for bit across ranks and tiles and the
    TOPK boundary cuts a tie group; the order is ids ascending inside every tie, as in a
    stable sort, and the ids follow from the sign of HF's final normed hidden[0]."""
    cfg = ModelConfig.from_name(name)
    model, shards = shards_for(cfg, tp, seed=tp)
    w = tie_lm_head(cfg)
    kc, vc = empty_caches(cfg, tp, num_pages=24, page_size=PAGE)
    vm = VM(cfg, build_schedule(cfg, tp, 3, 3), with_lm_head(shards, cfg, w), kc, vc)
    with torch.no_grad():
        hidden = [model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    for pos, live, (values, ids, logits) in _lockstep_topk(vm, PROMPTS):
        assert torch.equal(ids, stable_topk(logits, TOPK)[1])
        for i, b in enumerate(live):
            x0 = float(hidden[b][pos, 0])
            want = tie_topk_ids(x0, TOPK)
            assert ids[i].tolist() == want, f"pos {pos} row {b}: {ids[i].tolist()} != {want}"
            s = torch.tensor([next(s for s, g in TIE_GROUPS.items() if j in g) for j in want])
            torch.testing.assert_close(values[i], s * x0, atol=2e-4, rtol=1e-4)
            assert values[i, 0] == values[i, 2] and values[i, 6] == values[i, 7]  # exact ties


def _candidate_params(n: int) -> list[SamplingParams]:
    """Sampled rows of every kind the candidates serve (top_k 1..TOPK, top_p, temperature)."""
    kinds = [dict(temperature=1.0, top_k=TOPK), dict(temperature=0.7, top_k=1),
             dict(temperature=1.5, top_k=3, top_p=0.8), dict(temperature=3.0, top_k=7),
             dict(temperature=2.0, top_k=5, top_p=0.95)]
    return [SamplingParams(seed=100 + b, **kinds[b % len(kinds)]) for b in range(n)]


@pytest.mark.parametrize("ties", [False, True])
def test_sample_tokens_from_candidates_equals_full_logits_sampler(ties):
    """sample_tokens on a row that is -inf but at the top-TOPK (stable top-k of the logits,
    the oracle's candidates) == sample() on the full logits, for many seeds and positions;
    with integer logits, ties at the top_k boundary are everywhere."""
    from tpmk.engine.interpreter_engine import sample_tokens
    from tpmk.engine.sampling import sample
    g = torch.Generator().manual_seed(1)
    B, V = 200, 300
    logits = (torch.randint(-4, 5, (B, V), generator=g).float() if ties
              else torch.randn(B, V, generator=g) * 2)
    params, positions = _candidate_params(B), list(range(7, 7 + B))
    want = sample(logits, positions, params).tolist()
    got = sample_tokens(None, stable_topk(logits, TOPK), V, positions, params, torch.zeros(B))
    assert got == want
    assert len(set(got)) > 20  # really sampled


def test_engine_samples_top_k_from_candidates_without_logits_copy():
    """Decode steps whose sampled rows all have top_k <= TOPK never copy the full logits and
    give the tokens the full-logits sampler gives on the engine's own logits and on HF's
    (teacher-forced; crafted tie head, so the TOPK boundary falls inside exact ties)."""
    from tpmk.engine.sampling import sample
    cfg, tp = ModelConfig.from_name("tiny"), 2
    model, shards = shards_for(cfg, tp, seed=9)
    w = tie_lm_head(cfg)
    free = w[:, 0] == 0                      # rows outside the tie groups: random, no ties
    w[free] = torch.randn(int(free.sum()), cfg.hidden_size,
                          generator=torch.Generator().manual_seed(2)) * 3e-2
    shards = with_lm_head(shards, cfg, w)
    rt = RuntimeConfig(tp=tp, device="cpu", dtype="float32", max_batch=4, max_seq_len=32,
                       page_size=PAGE, num_pages=24)
    eng = InterpreterEngine(cfg, rt, shards, prefill="stream")
    copies = []
    for vm in eng.vms.values():   # every bucket's (the stream prefill's last steps run smaller ones)
        vm.logits = lambda full=vm.logits: copies.append(1) or full()
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    params = _candidate_params(3)[::2] + [SamplingParams()]      # top_k 8, top_k 3 + top_p, greedy
    toks = eng.prefill(Prefill(PROMPTS, pages, params)).tokens
    assert not copies
    seqs = [list(p) + [t] for p, t in zip(PROMPTS, toks)]
    mixed = params[:2] + [SamplingParams(temperature=1.0, seed=3)]   # top_k unset: full logits
    with torch.no_grad():
        hidden = [model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS]
    for s in range(6):
        pos = [len(p) + s for p in PROMPTS]
        use = params if s % 2 else mixed
        res = eng.decode(Decode(toks, pos, pages, use, return_logits=s >= 4))
        assert bool(copies) == (s >= 4 or use is mixed), f"step {s}: logits copied {len(copies)}"
        copies.clear()
        if s >= 4:   # the logits handed back are HF's (the candidate rows' -inf stays inside)
            with torch.no_grad():
                want = torch.stack([model.model(torch.tensor([q])).last_hidden_state[0, -1]
                                    for q in seqs]) @ w.T
            torch.testing.assert_close(torch.tensor(res.logits), want, atol=2e-4, rtol=1e-4)
            assert res.tokens == sample(torch.tensor(res.logits), pos, use).tolist()
        toks = res.tokens
        for q, t in zip(seqs, toks):
            q.append(t)
    # HF oracle: decode each prompt's last token again at its own position (same KV entry)
    res = eng.decode(Decode([p[-1] for p in PROMPTS], [len(p) - 1 for p in PROMPTS], pages, params))
    with torch.no_grad():
        hf_logits = torch.stack(hidden) @ w.T
    assert res.tokens == sample(hf_logits, [len(p) - 1 for p in PROMPTS], params).tolist()
