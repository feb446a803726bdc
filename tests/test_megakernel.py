"""CUDA megakernel (virtual TP on one GPU) vs the CPU interpreter running the same
instruction stream on the same bf16 weights and bf16 KV cache, and vs HF transformers."""
import dataclasses

import pytest
import torch

from _mk_helpers import (empty_caches, random_shards, shards_for, stable_topk, tie_lm_head,
                         tie_topk_ids, topk_near_ties, with_lm_head)
from tpmk.config import ModelConfig
from tpmk.kernels.interpreter import VM
from tpmk.kernels.isa import MAX_SPLITS, MMA_MIN_BATCH, NTHREADS, TOPK
from tpmk.kernels.schedule import build_schedule

PROMPTS = [[5, 17, 300, 42, 7, 99], [3, 8, 11], [200, 201, 202, 203, 204, 205, 206, 207, 208]]
PAGE, PAGES_PER_SEQ = 16, 8


def _tol(batch: int) -> float:
    """Relative logit tolerance (of the largest |logit|) against the interpreter. CUDA-core
    steps (batch < MMA_MIN_BATCH) take f32 inputs on both sides: only the summation order
    differs (measured <= 4.5e-4). Tensor-core steps round their inputs to bf16 on both sides,
    so an f32-level difference can move an input by one bf16 ulp: the interpreter against
    itself with 1e-7 relative noise on its matvec inputs differs by 3.2e-3 to 4.0e-3
    (tiny-gqa tp4, batch 70; 2026-12-04)."""
    return 2e-3 if batch < MMA_MIN_BATCH else 1e-2


def _pair(cfg, tp, bucket, shards_cpu, sms=None, splits=0, reduce="oneshot", gu_splits=1):
    from tpmk.kernels.megakernel import Megakernel
    sms = sms or min(16, torch.cuda.get_device_properties(0).multi_processor_count // tp)
    sched = build_schedule(cfg, tp, bucket, sms, num_splits=splits, reduce=reduce, gu_splits=gu_splits)
    n_pages = bucket * PAGES_PER_SEQ
    kc, vc = empty_caches(cfg, tp, n_pages, PAGE, dtype=torch.bfloat16)
    vm = VM(cfg, sched, shards_cpu, kc, vc)
    kg, vg = empty_caches(cfg, tp, n_pages, PAGE, dtype=torch.bfloat16)
    mk = Megakernel(cfg, sched, [s.to("cuda") for s in shards_cpu], [k.cuda() for k in kg],
                    [v.cuda() for v in vg], timeout_s=2.0, max_pages_per_seq=PAGES_PER_SEQ)
    return vm, mk


def _pages(b):
    return list(range(b * PAGES_PER_SEQ, (b + 1) * PAGES_PER_SEQ))


def _compare_run(vm, mk, prompts, steps, tag):
    """Lockstep prompts then `steps` greedy steps on both; returns max relative logit error."""
    worst = 0.0
    n = len(prompts)
    seqs = [list(p) for p in prompts]
    longest = max(map(len, prompts))
    for pos in range(longest + steps):
        live = [b for b in range(n) if pos < len(seqs[b])]
        toks, poss, pages = [seqs[b][pos] for b in live], [pos] * len(live), [_pages(b) for b in live]
        want = vm.step(toks, poss, pages)
        got = mk.step(toks, poss, pages).cpu().long()
        wl, gl = vm.logits(), mk.logits().cpu()
        err, tol = float((gl - wl).abs().max() / wl.abs().max()), _tol(len(live))
        worst = max(worst, err)
        assert err < tol, f"{tag} pos {pos}: logits rel err {err:.2e}"
        for i, b in enumerate(live):
            if got[i] != want[i]:
                top = wl[i].topk(2).values
                gap = float(top[0] - top[1])
                assert gap < tol / 2 * float(top[0].abs()), (
                    f"{tag} seq {b} pos {pos}: megakernel token {int(got[i])} != interpreter "
                    f"{int(want[i])}, top-2 logit gap {gap:.3e}")
                print(f"{tag}: near-tie at seq {b} pos {pos} (gap {gap:.2e}); stopping comparison")
                return worst
            if pos == len(seqs[b]) - 1 and len(seqs[b]) < len(prompts[b]) + steps:
                seqs[b].append(int(want[i]))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["tiny", "tiny-gqa"])
def test_tiny_matches_interpreter_64_steps(name, tp):
    cfg = ModelConfig.from_name(name).replace(dtype="bfloat16")
    _, shards = shards_for(cfg, tp, seed=tp, dtype=torch.bfloat16)
    vm, mk = _pair(cfg, tp, 4, shards)
    worst = _compare_run(vm, mk, PROMPTS, 64, f"{name} tp{tp}")        # batch 3 of bucket 4
    worst = max(worst, _compare_run(vm, mk, [[9, 10, 11, 12]], 4, f"{name} tp{tp} b1"))
    worst = max(worst, _compare_run(vm, mk, PROMPTS + [[1, 2]], 4, f"{name} tp{tp} b4"))
    print(f"{name} tp{tp}: max rel logit err {worst:.2e} over batch 3 x 64 steps, batch 1, batch 4")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 32, MAX_SPLITS])
def test_attention_split_extremes(splits):
    """One split (no merge), 32 (one per lane of the merge's warp) and MAX_SPLITS (four per
    lane); most splits see one or no token of these short prompts."""
    cfg = ModelConfig.from_name("llama-3.2-1b").replace(num_hidden_layers=2)
    shards = random_shards(cfg, 8, seed=3)
    vm, mk = _pair(cfg, 8, 2, shards, splits=splits)
    worst = _compare_run(vm, mk, [[1, 2, 3, 128000], [77, 66]], 40, f"1b tp8 splits {splits}")
    print(f"llama-3.2-1b shapes tp8, {splits} attention splits: max rel logit err {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,heads,kv_heads,tp,splits,batch,dtype", [
    (128, 64, 8, 8, 1, 3, "bfloat16"),   # Llama-3-70B's per-rank group (G = 8, D = 128), up to 12 chunks of 64
    (128, 64, 8, 8, 3, 6, "bfloat16"),   # 3 splits, tensor-core batch
    (64, 16, 4, 1, 0, 2, "bfloat16"),    # G = 4, D = 64, splits chosen by the scheduler
    (64, 32, 8, 2, 2, 5, "bfloat16"),
    (128, 64, 8, 8, 1, 3, "float32"),    # the f32 build: 64-token chunks
    (128, 64, 8, 8, 96, 1, "bfloat16"),  # 96 splits of ~3 tokens: the merge's lanes take three each
])
def test_attention_long_context(head_dim, heads, kv_heads, tp, splits, batch, dtype):
    """Contexts of 300-727 tokens over random K/V caches on shuffled pages: several
    shared-memory chunks per split (the double-buffered cp.async path, the online softmax
    across chunks, last chunks of every length). The attention output and the logits are
    compared with the interpreter's, which reads the same caches."""
    cfg = ModelConfig.from_name("tiny-gqa").replace(
        dtype=dtype, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    shards = random_shards(cfg, tp, seed=head_dim + tp, dtype=getattr(torch, dtype))
    ctxs = [300, 727, 512, 385, 129, 640][:batch]
    per_seq = (max(ctxs) + PAGE - 1) // PAGE
    n_pages = batch * per_seq
    g = torch.Generator().manual_seed(11)
    kc, vc = empty_caches(cfg, tp, n_pages, PAGE, dtype=getattr(torch, dtype))
    for t in kc + vc:
        t.copy_(torch.randn(t.shape, generator=g))
    order = torch.randperm(n_pages, generator=g).tolist()   # non-contiguous page tables
    pages = [order[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
    sms = min(16, torch.cuda.get_device_properties(0).multi_processor_count // tp)
    sched = build_schedule(cfg, tp, batch, sms, num_splits=splits)
    vm = VM(cfg, sched, shards, kc, vc)
    from tpmk.kernels.megakernel import Megakernel
    mk = Megakernel(cfg, sched, [s.to("cuda") for s in shards], [k.cuda() for k in kc],
                    [v.cuda() for v in vc], timeout_s=2.0, max_pages_per_seq=per_seq)
    tokens, positions = [3 + 5 * b for b in range(batch)], [c - 1 for c in ctxs]
    vm.step(tokens, positions, pages)
    mk.step(tokens, positions, pages)
    for r in range(tp):
        want, got = vm.ranks[r].attn_out[:batch], mk.bufs[r]["attn_out"][:batch].cpu()
        err = float((got - want).abs().max() / want.abs().max())
        assert err < _tol(batch), f"rank {r}: attention output rel err {err:.2e}"
    wl, gl = vm.logits(), mk.logits().cpu()
    err = float((gl - wl).abs().max() / wl.abs().max())
    print(f"D={head_dim} G={heads // kv_heads} tp{tp} splits {sched.num_splits} batch {batch}: "
          f"logits rel err {err:.2e}")
    assert err < _tol(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("name,tp,bucket", [("tiny-gqa", 2, 4), ("tiny", 8, 4), ("tiny-gqa", 4, 72)])
def test_reduce_scatter_all_gather(name, tp, bucket):
    """reduce="rsag": o_proj/down partials to the tile's owner only, the owner's residual
    writes every rank's x. Same instruction stream on the interpreter (itself checked
    bit-identical to one-shot, tests/test_interpreter.py)."""
    cfg = ModelConfig.from_name(name).replace(dtype="bfloat16")
    _, shards = shards_for(cfg, tp, seed=7, dtype=torch.bfloat16)
    vm, mk = _pair(cfg, tp, bucket, shards, reduce="rsag")
    prompts = PROMPTS if bucket == 4 else [[b % 200 + 1, 7, 9] for b in range(70)]
    worst = _compare_run(vm, mk, prompts, 16, f"{name} tp{tp} rsag")
    print(f"{name} tp{tp} reduce-scatter + all-gather, batch {len(prompts)}: max rel logit err {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
def test_llama_1b_shapes(tp):
    cfg = ModelConfig.from_name("llama-3.2-1b").replace(num_hidden_layers=2)
    shards = random_shards(cfg, tp, seed=1)
    vm, mk = _pair(cfg, tp, 4, shards)
    worst = _compare_run(vm, mk, [[1, 2, 3, 128000], [77, 66]], 6, f"1b tp{tp}")
    print(f"llama-3.2-1b shapes (2 layers) tp{tp}: max rel logit err {worst:.2e}")


def _batch_case(name, tp, batch, seed):
    """(cfg, bf16 shards, `batch` random prompts of 1-4 tokens): tiny-gqa from an HF model, or
    a model's shapes (2 layers) with random weights."""
    if name == "tiny-gqa":
        cfg = ModelConfig.from_name(name).replace(dtype="bfloat16")
        _, shards = shards_for(cfg, tp, seed=seed, dtype=torch.bfloat16)
    else:
        cfg = ModelConfig.from_name(name).replace(num_hidden_layers=2)
        shards = random_shards(cfg, tp, seed=seed)
    g = torch.Generator().manual_seed(batch)
    return cfg, shards, [torch.randint(3, cfg.vocab_size, (1 + b % 4,), generator=g).tolist() for b in range(batch)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,tp,bucket,batch", [("tiny-gqa", 2, 72, 70), ("tiny-gqa", 2, 136, 133),
                                                   ("llama-3.2-1b", 1, 24, 21)])
def test_batched_tensor_core_matvec(name, tp, bucket, batch):
    """batch >= MMA_MIN_BATCH runs the tensor-core matvec (mk_mma.cuh): several batch passes
    (133 rows: a full MMA_PASS of 16 n-tiles, then 5 rows), every n-tile count, several K
    chunks (1b: K = 2048 and 8192), batch shrinking to a quarter at the end (the 4-token
    prompts)."""
    cfg, shards, prompts = _batch_case(name, tp, batch, seed=7 if name == "tiny-gqa" else 4)
    vm, mk = _pair(cfg, tp, bucket, shards)
    worst = _compare_run(vm, mk, prompts, 3, f"{name} tp{tp} batch {batch}")
    print(f"{name} tp{tp} batch {batch}: max rel logit err {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("name,tp,bucket,batch,gu", [("tiny-gqa", 2, 4, 1, 2), ("tiny-gqa", 2, 72, 70, 4),
                                                     ("llama-3.2-1b", 1, 24, 21, 4), ("llama-3.2-1b", 2, 8, 8, 2)])
def test_gate_up_split_over_k(name, tp, bucket, batch, gu):
    """gate_up in `gu` K slices (partials to gu_part, ACT sums them) on both the CUDA-core
    path (batch 1, the norm's sum of squares over the whole row) and the tensor cores; the
    Megakernel builds such schedules with MK_GU_SPLIT."""
    cfg, shards, prompts = _batch_case(name, tp, batch, seed=9 if name == "tiny-gqa" else 5)
    vm, mk = _pair(cfg, tp, bucket, shards, gu_splits=gu)
    assert any(i.name == "act" for i in mk.sched.instructions)
    worst = _compare_run(vm, mk, prompts, 4, f"{name} tp{tp} batch {batch} gate_up / {gu}")
    print(f"{name} tp{tp} batch {batch}, gate_up in {gu} K slices: max rel logit err {worst:.2e}")


def _compare_topk(vm, mk, prompts, tag):
    """Lockstep prompts on both. The megakernel's top-TOPK must equal the stable top-k of its
    own logits bit for bit (tokens = its first ids) and the interpreter's top-TOPK up to bf16
    near-ties (ids may swap only where the interpreter's logits of the two ids are within
    tolerance). Returns (live rows, megakernel ids [batch, TOPK], interpreter logits) per
    step, and the near-ties."""
    steps, near = [], []
    for pos in range(max(map(len, prompts))):
        live = [b for b, p in enumerate(prompts) if pos < len(p)]
        args = ([prompts[b][pos] for b in live], [pos] * len(live), [_pages(b) for b in live])
        vm.step(*args)
        toks = mk.step(*args).cpu().long()
        values, ids = (t.cpu() for t in mk.topk())
        want_v, want_i = stable_topk(mk.logits().cpu(), TOPK)
        assert torch.equal(ids, want_i) and torch.equal(values, want_v), f"{tag} pos {pos}"
        assert torch.equal(toks, ids[:, 0]), f"{tag} pos {pos}: tokens are not the top-1"
        wl = vm.logits()
        vi, ii = vm.topk()
        assert torch.equal(ii, stable_topk(wl, TOPK)[1])
        near += [f"{tag} pos {pos} {n}"
                 for n in topk_near_ties(values, ids, wl, atol=_tol(len(live)) * float(wl.abs().max()))]
        steps.append((live, ids, wl))
    for n in near:
        print("top-k near-tie (megakernel vs interpreter):", n)
    return steps, near


@pytest.mark.gpu
@pytest.mark.parametrize("name,tp,bucket,batch", [
    ("tiny", 1, 4, 3), ("tiny", 2, 4, 1), ("tiny-gqa", 4, 4, 3), ("tiny-gqa", 8, 4, 4),
    ("tiny-gqa", 2, 72, 70), ("llama-3.2-1b", 1, 4, 2), ("llama-3.2-1b", 8, 24, 21)])
def test_topk_matches_own_logits_and_interpreter(name, tp, bucket, batch):
    """LM-head tile top-TOPK + ARGMAX merge: batch 1 (16 warps per row), 3-4 (4 per row),
    21 and 70 (tensor-core LM head, one warp per row, several passes), Llama-1B vocab
    (~500 tiles of candidates per row)."""
    if name == "llama-3.2-1b":
        cfg = ModelConfig.from_name(name).replace(num_hidden_layers=2)
        shards = random_shards(cfg, tp, seed=6)
    else:
        cfg = ModelConfig.from_name(name).replace(dtype="bfloat16")
        _, shards = shards_for(cfg, tp, seed=tp, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, cfg.vocab_size, (2 + b % 3,), generator=g).tolist() for b in range(batch)]
    vm, mk = _pair(cfg, tp, bucket, shards)
    _, near = _compare_topk(vm, mk, prompts, f"{name} tp{tp} batch {batch}")
    print(f"{name} tp{tp} batch {batch}: {len(near)} top-{TOPK} near-ties vs the interpreter")


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch", [(2, 3), (8, 3), (2, 8)])
def test_topk_exact_ties_go_to_the_lowest_id(tp, batch):
    """Crafted head (_mk_helpers.TIE_GROUPS): bit-exact ties across ranks and tiles, the TOPK
    boundary inside a tie group; CUDA-core (batch 3) and tensor-core (batch 8) LM head."""
    cfg = ModelConfig.from_name("tiny").replace(dtype="bfloat16")
    _, shards = shards_for(cfg, tp, seed=tp, dtype=torch.bfloat16)
    vm, mk = _pair(cfg, tp, batch, with_lm_head(shards, cfg, tie_lm_head(cfg)))
    prompts = [[5 + b, 40 + b, 77] for b in range(batch)]
    steps, _ = _compare_topk(vm, mk, prompts, f"ties tp{tp} batch {batch}")
    for live, ids, wl in steps:   # logit of id 11 = 3 * xn[0]: its sign picks the tie groups
        for i in range(len(live)):
            assert ids[i].tolist() == tie_topk_ids(float(wl[i, 11]), TOPK), ids[i].tolist()


@pytest.mark.gpu
def test_tiny_matches_hf_float32_logits():
    """Independent oracle: HF float32 on the bf16-rounded weights, within bf16 tolerance."""
    cfg = ModelConfig.from_name("tiny-gqa").replace(dtype="bfloat16")
    model, shards = shards_for(cfg, 2, seed=3, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    _, mk = _pair(cfg, 2, 4, shards)
    p = PROMPTS[2]
    for pos, t in enumerate(p):
        mk.step([t], [pos], [_pages(0)])
    with torch.no_grad():
        want = model(torch.tensor([p])).logits[0, -1]
    got = mk.logits()[0].cpu()
    assert float((got - want).abs().max() / want.abs().max()) < 3e-2
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.gpu
def test_timeout_names_rank_sm_opcode_layer():
    cfg = ModelConfig.from_name("tiny").replace(dtype="bfloat16")
    _, shards = shards_for(cfg, 2, dtype=torch.bfloat16)
    sched = build_schedule(cfg, 2, 2, 4)
    bad = next(i for i in sched.instructions if i.name == "gate_up" and i.layer == 1)
    bad.waits = [(bad.waits[0][0], 10_000)]   # can never be reached
    from tpmk.kernels.megakernel import Megakernel
    kg, vg = empty_caches(cfg, 2, 16, PAGE, dtype=torch.bfloat16)
    mk = Megakernel(cfg, sched, [s.to("cuda") for s in shards], [k.cuda() for k in kg],
                    [v.cuda() for v in vg], timeout_s=0.2)
    # Whichever waiter times out first is named first (a down tile downstream of the stuck
    # gate_up may); the message then names the stuck tile itself, from the counters.
    with pytest.raises(RuntimeError, match=rf"timed out waiting: rank \d, SM \d+, opcode [A-Z_]+, layer \d+.*"
                                           rf"first unmet wait: stage \d+ \(gate_up\[layer 1\]\): "
                                           rf"gate_up\(layer=1, tile={bad.tile},"):
        mk.step([1], [0], [[0]])


@pytest.mark.gpu
def test_op_by_op_diff_tool():
    from tpmk.kernels.opdiff import diff_stages
    cfg = ModelConfig.from_name("tiny-gqa").replace(dtype="bfloat16")
    _, shards = shards_for(cfg, 2, seed=5, dtype=torch.bfloat16)
    vm, mk = _pair(cfg, 2, 2, shards)
    rows = list(diff_stages(vm, mk, [7, 8], [0, 0], [_pages(0), _pages(1)]))
    assert len(rows) == len(mk.sched.stage_names)
    for s, name, errs in rows:
        assert max(errs.values()) < 1e-3, f"stage {s} {name}: {errs}"


def test_loopback_refuses_reduce_scatter_schedule():
    """One rank alone cannot run an all-gather schedule (other ranks own most tiles): a
    clear error before anything touches a GPU, not a timeout."""
    pytest.importorskip("cuda.bindings")
    from tpmk.kernels.megakernel import Megakernel
    cfg = ModelConfig.from_name("tiny")
    sched = build_schedule(cfg, 2, 1, 3, reduce="rsag")
    _, shards = shards_for(cfg, 2)
    kc, vc = empty_caches(cfg, 2, 4, 16)
    with pytest.raises(ValueError, match="reduce='oneshot'"):
        Megakernel(cfg, sched, shards[:1], kc[:1], vc[:1], loopback=True)


@pytest.mark.parametrize("change,splits,message", [
    (dict(head_dim=96), 0, "head_dim=96 is not supported"),
    (dict(intermediate_size=392), 0, "intermediate/tp=196 must be a multiple of 8"),
    ({}, 129, "num_splits=129 > 128"),
    # G x D = 32 x 256 = 8192 > 8 * NTHREADS while NTHREADS < 1024
    (dict(num_attention_heads=64, num_key_value_heads=2, head_dim=256), 0,
     f"32 query heads per kv head x head_dim=256 > {8 * NTHREADS}"),
])
def test_unsupported_shapes_are_refused_before_the_device(change, splits, message):
    """A model or schedule the kernel cannot run is refused with its value named before any
    device work: here the caches are on the CPU, and the shape error still comes first."""
    pytest.importorskip("cuda.bindings")
    from tpmk.kernels.megakernel import Megakernel
    cfg = ModelConfig.from_name("tiny").replace(**change)
    sched = build_schedule(cfg, 2, 4, 4, num_splits=splits)
    _, shards = shards_for(cfg, 2)
    kc, vc = empty_caches(cfg, 2, 4, 16)
    with pytest.raises(ValueError, match=message):
        Megakernel(cfg, sched, shards, kc, vc)


def test_llama_70b_rank_fits_the_h200_shared_memory():
    """The benchmark's shape (one Llama-3-70B tp=8 rank, bucket 128, 132 SMs) passes the
    checks; its shared memory is what the tensor-core matvec needs (isa.MMA_SMEM_WORDS) plus
    the CUDA-core matvec's reduction scratch, under the 227 KiB an H200 CTA can opt into."""
    from tpmk.kernels import isa
    from tpmk.kernels.megakernel import SMEM_LIMIT, check_shapes
    cfg = ModelConfig.from_name("llama-3-70b")
    kmax, smem = check_shapes(cfg, build_schedule(cfg, 8, 128, 132), torch.bfloat16)
    assert kmax == cfg.hidden_size == 8192
    assert smem == 4 * (isa.NWARPS * isa.BATCH_CHUNK + isa.MMA_SMEM_WORDS) <= SMEM_LIMIT


def test_small_buckets_leave_shared_memory_to_l1():
    """The 70B rank's shared memory is sized to the bucket. Below MMA_MIN_BATCH: no tensor-core
    words (linear() inputs of min(BATCH_CHUNK, bucket) rows of K = 8192 f32), and attention
    takes 64-token chunks, so at batch 1 at least 128 KB of the SM's 228 KB stay L1 for the
    stack frames (the carve-out hint). Batch 1 at ctx 1024 on an H200: 9.36 ms sized by
    bucket, 9.84 with the tensor-core words at every bucket (bench/decode.py, 2026-12-06).
    Written for any MMA_MIN_BATCH >= 2 (5 until 2026-12-07, 2 since)."""
    from tpmk.kernels import isa
    from tpmk.kernels.megakernel import check_shapes
    cfg = ModelConfig.from_name("llama-3-70b")
    mn, top = isa.MMA_MIN_BATCH, isa.MMA_MIN_BATCH - 1   # the first tensor-core bucket, the last below
    smem = {b: check_shapes(cfg, build_schedule(cfg, 8, b, 132), torch.bfloat16)[1]
            for b in (1, top, mn, 128)}
    assert smem[1] <= 100 * 1024 and 228 * 1024 - smem[1] >= 128 * 1024
    assert smem[1] >= 4 * 8192 * 1   # at least the one input row
    assert smem[top] >= 4 * 8192 * top and smem[top] < smem[mn] < smem[128]
    # Tensor-core buckets: the chunk buffers plus one pass's outputs, bucket rows of the
    # tallest tile (2 x 64 rows of gate_up at tp 8, 132 SMs), and residual.cuh's two passes
    # of 9 planes x 64 columns; the attention's 128-token K/V ring is a little larger at the
    # smallest, and bucket 128 needs all of MMA_SMEM_WORDS.
    scratch = 4 * isa.NWARPS * isa.BATCH_CHUNK
    assert scratch + 4 * (isa.MMA_OUT_AT + mn * 128) <= smem[mn] <= 150 * 1024
    assert smem[128] == scratch + 4 * isa.MMA_SMEM_WORDS
    s32 = build_schedule(cfg, 8, 32, 132)
    assert max(i.nrows for i in s32.instructions if i.name == "residual") == 64
    assert check_shapes(cfg, s32, torch.bfloat16)[1] >= scratch + 4 * 2 * 32 * 9 * 64
    assert [isa.attn_chunk(128, 2, b) for b in (1, top, mn, 128)] == [64, 64, 128, 128]
    assert isa.attn_chunk(256, 2, 128) == 64 and isa.attn_chunk(256, 4, 1) == 32   # ATTN_KV_BYTES


def test_kernel_macros_from_argument_and_environment(monkeypatch):
    """compile_megakernel passes --define macros and TPMK_MK_DEFINES (so the GPU tests can run
    on a tuning variant) to NVRTC as -D options, and names a malformed one."""
    import tpmk.kernels.build as build
    from tpmk.kernels.megakernel import compile_megakernel
    seen = []
    monkeypatch.setattr(build, "compile_to_cubin", lambda src, options, arch: seen.append(options) or b"")
    monkeypatch.setenv("TPMK_MK_DEFINES", " PREFETCH_CAP=65536  MK_PROF_MARK=8 ")
    compile_megakernel(torch.float32, defines=("MK_SYS_SCOPE",))
    assert seen == [["-DMK_FLOAT32", "-DMK_SYS_SCOPE", "-DPREFETCH_CAP=65536", "-DMK_PROF_MARK=8"]]
    monkeypatch.setenv("TPMK_MK_DEFINES", "")
    compile_megakernel(torch.bfloat16)
    assert seen[-1] == []
    monkeypatch.setenv("TPMK_MK_DEFINES", "-O0")
    with pytest.raises(ValueError, match="'-O0' is not NAME or NAME=VALUE"):
        compile_megakernel(torch.bfloat16)


def test_profile_trace_events_without_gpu():
    """Host-side formatting of --profile timestamps into Chrome-trace events."""
    from tpmk.kernels.megakernel import Megakernel
    cfg = ModelConfig.from_name("tiny")
    sched = build_schedule(cfg, 2, 1, 3)
    mk = Megakernel.__new__(Megakernel)
    mk.sched = sched
    n = len(sched.instructions)
    ts = torch.zeros(n, 2, dtype=torch.int64)
    ts[:, 0] = 1000 + torch.arange(n) * 10
    ts[:, 1] = ts[:, 0] + 5
    mk.bufs = [{"profile": ts.flatten()} for _ in range(2)]
    ev = mk.profile_trace()
    assert len(ev) == 2 * n
    assert {e["pid"] for e in ev} == {0, 1} and {e["tid"] for e in ev} == {0, 1, 2}
    assert all(e["dur"] == 0.005 and e["ph"] == "X" for e in ev)
    assert ev[0]["name"].startswith(sched.instructions[0].name)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,mk_max,inter", [(1, 32, 0), (4, 32, 0), (4, 2, 0), (1, 32, 16384)])
def test_megakernel_engine_vs_reference_engine(tp, mk_max, inter):
    """Engine level: reference prefill into the shared paged cache, megakernel decode,
    against the reference engine (CUDA graphs) on the same bf16 shards. mk_max 2: the steps of
    three sequences decode through the engine's own reference engine (CUDA graphs, the same
    KV cache), the later ones of one or two through the megakernel. inter 16384: bucket 4's
    schedule needs more shared memory than an SM has, so the engine keeps buckets 1 and 2 and
    the three-sequence steps take the reference engine too."""
    from tpmk.config import RuntimeConfig
    from tpmk.engine.api import Decode, Prefill, SamplingParams
    from tpmk.engine.megakernel_engine import MegakernelEngine
    from tpmk.engine.reference import ReferenceEngine
    cfg = ModelConfig.from_name("tiny-gqa").replace(dtype="bfloat16")
    if inter:
        cfg = cfg.replace(intermediate_size=inter)
    _, shards = shards_for(cfg, tp, seed=2, dtype=torch.bfloat16)
    rt = RuntimeConfig(tp=tp, device="cuda", dtype="bfloat16", max_batch=4, max_seq_len=128)
    ref = ReferenceEngine(cfg, rt, [s.to("cuda") for s in shards])
    mk = MegakernelEngine(cfg, dataclasses.replace(rt, megakernel_max_batch=mk_max), shards)
    assert mk.buckets == ([1, 2] if inter or mk_max == 2 else [1, 2, 4])
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    greedy = [SamplingParams()] * 3
    a = ref.prefill(Prefill(PROMPTS, pages, greedy))
    b = mk.prefill(Prefill(PROMPTS, pages, greedy))
    assert a.tokens == b.tokens
    toks, pos = list(a.tokens), [len(p) for p in PROMPTS]
    for s in range(24):   # 12 steps of all three (bucket 4), then sequence 0 alone (bucket 1)
        live = [0, 1, 2] if s < 12 else [0] if s % 2 else [0, 1]   # and with 1 (bucket 2)
        args = ([toks[i] for i in live], [pos[i] for i in live], [pages[i] for i in live], greedy[:len(live)])
        a = ref.decode(Decode(*args, return_logits=True))
        b = mk.decode(Decode(*args, return_logits=True))
        if len(live) > mk.buckets[-1]:
            assert b.extra.get("decoded_by") == "reference"
        else:
            assert "decoded_by" not in b.extra and mk.vm.sched.bucket == {3: 4, 2: 2, 1: 1}[len(live)]
        la, lb = torch.tensor(a.logits), torch.tensor(b.logits)
        assert float((lb - la).abs().max() / la.abs().max()) < 3e-2, f"step {s}"
        for j, i in enumerate(live):
            if a.tokens[j] != b.tokens[j]:
                top = la[j].topk(2).values
                gap = float(top[0] - top[1])
                assert gap < 2e-2 * float(top[0].abs()), (
                    f"step {s} seq {i}: megakernel {b.tokens[j]} != reference {a.tokens[j]}, gap {gap:.3e}")
            toks[i], pos[i] = a.tokens[j], pos[i] + 1


@pytest.mark.gpu
def test_megakernel_engine_profile_trace(tmp_path):
    """--profile: the trace holds complete events (at most one per instruction of each rank)
    from both ranks, each with a positive duration, named after its op."""
    from tpmk.config import RuntimeConfig
    from tpmk.engine.api import Decode, Prefill, SamplingParams
    from tpmk.engine.megakernel_engine import MegakernelEngine
    import json
    cfg = ModelConfig.from_name("tiny-gqa").replace(dtype="bfloat16")
    _, shards = shards_for(cfg, 2, seed=3, dtype=torch.bfloat16)
    trace = tmp_path / "trace.json"
    rt = RuntimeConfig(tp=2, device="cuda", dtype="bfloat16", max_batch=4, max_seq_len=128,
                       profile=str(trace))
    mk = MegakernelEngine(cfg, rt, shards)
    pages = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    greedy = [SamplingParams()] * 3
    toks = mk.prefill(Prefill(PROMPTS, pages, greedy)).tokens
    mk.decode(Decode(toks, [len(p) for p in PROMPTS], pages, greedy))
    events = json.loads(trace.read_text())["traceEvents"]
    assert 0 < len(events) <= 2 * len(mk.vm.sched.instructions)
    assert {e["pid"] for e in events} == {0, 1}
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in events)
    assert {e["name"].split()[0] for e in events} >= {"qkv", "attention", "down"}


def test_a_bucket_over_shared_memory_names_the_flags_that_avoid_it():
    """Llama-3.1-8B at tp 1: buckets up to 3 fit, bucket 4's CUDA-core rows do not (14336-wide
    rows); the refusal names the bucket and what the user can change."""
    from tpmk.kernels.megakernel import check_shapes
    cfg = ModelConfig.from_name("llama-3.1-8b")
    check_shapes(cfg, build_schedule(cfg, 1, 3, 132), torch.bfloat16)
    with pytest.raises(ValueError, match=r"at batch bucket 4 .*--megakernel-max-batch or --max-batch "
                                         r"below 4\) or a larger --tp"):
        check_shapes(cfg, build_schedule(cfg, 1, 4, 132), torch.bfloat16)
