"""Vocab-parallel sampling vs float64 references (softmax, top-k / top-p written out here)."""
from __future__ import annotations

import pytest
import torch

from tpmk.engine.api import SamplingParams
from tpmk.engine.sampling import CANDIDATE_CAP, gumbel, row_keys, sample, sample_vocab_parallel

VOCAB = 50



def split(logits: torch.Tensor, tp: int, vocab: int) -> list[torch.Tensor]:
    """Full [B, vocab] logits -> tp slices of the padded vocab (pad rows hold huge values,
    which must never be chosen)."""
    step = tp * 8
    padded = (vocab + step - 1) // step * step
    full = torch.full((logits.shape[0], padded), 1e4)
    full[:, :vocab] = logits
    return list(full.chunk(tp, dim=1))


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, tp: int = 1) -> torch.Tensor:
    """n samples of one logits row: one row per position 0..n-1 (the noise stream changes)."""
    rows = logits_row.expand(n, -1).contiguous()
    toks = sample_vocab_parallel(split(rows, tp, rows.shape[1]), 0, rows.shape[1],
                                 list(range(n)), [params] * n)
    return torch.tensor(toks)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the tokens with expected count >= 5; (statistic, dof)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs * n
    big = expected >= 5
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum().item()
    return stat, int(big.sum()) - 1


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64: softmax(logits / T) restricted to the top_k, then the smallest prefix (by
    descending logit) whose mass reaches top_p, renormalised."""
    z = logits.double() / p.temperature
    order = torch.argsort(-z, stable=True)
    keep = torch.zeros_like(z, dtype=torch.bool)
    k = p.top_k if p.top_k > 0 else z.numel()
    keep[order[:k]] = True
    probs = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=0)
    mass = 0.0
    for j, i in enumerate(order[:k].tolist()):
        if j > 0 and mass >= p.top_p:
            keep[i] = False
        mass += probs[i].item()
    probs = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=0)
    return probs


def chi2_limit(dof: int, tail: float = 1e-5) -> float:
    """x with P(chi2_dof > x) = tail (bisection on the regularized upper incomplete gamma)."""
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        sf = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                     torch.tensor(mid / 2, dtype=torch.float64)).item()
        lo, hi = (mid, hi) if sf > tail else (lo, mid)
    return lo


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.5])
    p = SamplingParams(temperature=0.7, seed=123)
    samples = draw(logits, p, 20000)
    stat, dof = chi_square(samples, torch.softmax(logits.double() / 0.7, dim=0))
    print(f"chi2={stat:.1f} dof={dof}")
    assert stat < chi2_limit(dof), f"chi2={stat:.1f} with {dof} dof"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5, seed=1),
    SamplingParams(temperature=0.8, top_p=0.7, seed=2),
    SamplingParams(temperature=1.3, top_k=10, top_p=0.8, seed=3),
])
def test_top_k_top_p_sample_the_right_set_with_the_right_odds(params):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    want = reference_probs(logits, params)
    samples = draw(logits, params, 20000, tp=2)
    assert set(samples.tolist()) <= set(torch.nonzero(want).flatten().tolist())
    stat, dof = chi_square(samples, want)
    print(f"chi2={stat:.1f} dof={dof}")
    assert stat < chi2_limit(dof), f"chi2={stat:.1f} with {dof} dof"


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_mode_is_tp_invariant(tp):
    g = torch.Generator().manual_seed(0)
    B = 12
    logits = torch.randn(B, VOCAB, generator=g) * 3
    modes = [SamplingParams(), SamplingParams(temperature=0.9, seed=7),
             SamplingParams(temperature=1.0, top_k=3, seed=8),
             SamplingParams(temperature=0.6, top_p=0.5, seed=9)]
    sampling = [modes[b % 4] for b in range(B)]
    positions = list(range(100, 100 + B))
    one = sample(logits, positions, sampling).tolist()
    many = sample_vocab_parallel(split(logits, tp, VOCAB), 0, VOCAB, positions, sampling)
    assert many == one
    greedy_rows = [b for b in range(B) if b % 4 == 0]
    assert [one[b] for b in greedy_rows] == logits.argmax(-1)[greedy_rows].tolist()


def test_greedy_ties_go_to_the_lowest_id_across_ranks():
    logits = torch.zeros(2, VOCAB)
    logits[0, [30, 45]] = 5.0   # tie between two ranks' slices
    logits[1, [7, 3]] = 2.0     # tie inside the first slice
    for tp in (1, 2, 4):
        toks = sample_vocab_parallel(split(logits, tp, VOCAB), 0, VOCAB, [0, 0],
                                     [SamplingParams()] * 2)
        assert toks == [30, 3]


def test_top_k_boundary_ties_keep_the_lowest_ids_whatever_the_tp():
    """Four equal maxima in different ranks' slices, top_k = 2: only the two lowest ids are
    ever drawn (torch.topk alone may keep any two), identically for every tp."""
    logits = torch.zeros(VOCAB)
    logits[[45, 3, 30, 10]] = 5.0
    p = SamplingParams(temperature=50.0, top_k=2, seed=4)
    one = draw(logits, p, 400)
    assert set(one.tolist()) == {3, 10}
    for tp in (2, 4):
        assert torch.equal(draw(logits, p, 400, tp=tp), one)


def test_padding_is_never_chosen():
    logits = torch.full((1, 10), -50.0)
    params = [SamplingParams(), SamplingParams(temperature=5.0, seed=1),
              SamplingParams(temperature=5.0, top_p=0.99, seed=1),
              SamplingParams(temperature=5.0, top_k=500, seed=1)]
    for p in params:
        toks = draw(logits[0], p, 200, tp=4)
        assert int(toks.max()) < 10


def test_chi2_limit():
    assert abs(chi2_limit(4, 0.05) - 9.488) < 1e-2 and abs(chi2_limit(6, 0.001) - 22.458) < 1e-2


def test_noise_depends_on_seed_and_position_only():
    ids = torch.arange(64)
    k = torch.tensor([row_keys(5, 9), row_keys(5, 10), row_keys(6, 9)])
    g = gumbel(k, ids)
    assert torch.equal(g[0, 32:], gumbel(k[:1], ids[32:])[0])  # a slice = the same values
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    assert torch.isfinite(g).all()
    # seeds go up to 2**63 (the server's limit): the high 32 bits count too
    hi = torch.tensor([row_keys(5 + 2 ** 32, 9), row_keys(5 + 2 ** 40, 9)])
    assert not torch.equal(gumbel(hi, ids)[0], g[0]) and not torch.equal(gumbel(hi, ids)[1], g[0])


@pytest.mark.parametrize("tp", [1, 2])
def test_cap_bounds_candidates_for_top_p_only(tp):
    """top_p without top_k gathers CANDIDATE_CAP candidates per rank, the lowest ids among
    ties: over a flat row of 2 x 2000 ids whose top_p 0.9 needs 3600 tokens, every draw is one
    of each rank's first CANDIDATE_CAP ids, and they spread over them; a dominant token past
    the cap still wins."""
    assert CANDIDATE_CAP >= 256
    V = 4000
    rows = torch.zeros(200, V)
    ids = sample_vocab_parallel(list(rows.chunk(tp, dim=1)), 0, V, list(range(200)),
                                [SamplingParams(1.0, top_p=0.9, seed=1)] * 200)
    per = V // tp
    allowed = {r * per + i for r in range(tp) for i in range(CANDIDATE_CAP)}
    assert set(ids) <= allowed and len(set(ids)) > 150
    assert max(i % per for i in ids) > CANDIDATE_CAP // 2
    logits = torch.zeros(1, V)
    logits[0, 3999] = 20.0  # nearly all the mass: top_p keeps one token even past the cap
    toks = sample_vocab_parallel([logits], 0, V, [0], [SamplingParams(1.0, top_p=0.5)])
    assert toks == [3999]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.9)])
def test_temperatures_below_greedy_below_take_the_argmax(top_k, top_p):
    """1e-40 is 0 in float32 (logits / T would be inf or NaN): such temperatures are greedy,
    the argmax of every row, whatever top_k / top_p ask for."""
    from tpmk.engine.api import GREEDY_BELOW
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    for t in (1e-40, 1e-12, GREEDY_BELOW / 2):
        params = [SamplingParams(temperature=t, top_k=top_k, top_p=top_p, seed=s) for s in range(6)]
        assert params[0].greedy
        assert sample(logits, list(range(6)), params).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=float("nan")), "finite"), (dict(temperature=float("inf")), "finite"),
    (dict(temperature=-0.5), "finite number >= 0"), (dict(top_k=2 ** 63), "top_k"),
    (dict(top_k=-1), "top_k"), (dict(top_p=float("nan")), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p")])
def test_sampling_params_refuse_what_would_break_a_step(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)
