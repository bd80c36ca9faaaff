"""The sampler draws from the distribution it claims: softmax(filter(logits / T)).

Chi-square goodness of fit at a fixed significance over many (sample id, position) draws of
`kernels.sample` (the one sampling path of every backend and both sides), with fixed seeds so
that each test's outcome is itself deterministic. Bins are tokens in descending probability,
merged until each expects >= 5 draws; at a real vocabulary also on the partition {likely tokens,
rare tokens} (Bonferroni: each at ALPHA / 2). Negative twins: the old uniform mapping (its top hash
value rounded u to 1.0, an infinite noise) and a sampler whose temperature is 5 % off both fail.
"""

import math

import pytest
import torch

from rlalign import kernels
from rlalign.kernels import sampling

ALPHA = 1e-3  # a correct sampler passes with p > ALPHA; the twins must fall far below it
QWEN_VOCAB = 151_936


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    n = float(counts.sum())
    order = torch.argsort(probs.double(), descending=True, stable=True)
    exp_sorted, obs_sorted = probs.double()[order] * n, counts.double()[order]
    assert float(obs_sorted[exp_sorted == 0].sum()) == 0, "a token outside the kept set was drawn"
    bins_e, bins_o, acc_e, acc_o = [], [], 0.0, 0.0
    for e, o in zip(exp_sorted.tolist(), obs_sorted.tolist()):
        if e == 0:
            break
        acc_e, acc_o = acc_e + e, acc_o + o
        if acc_e >= min_expected:
            bins_e.append(acc_e)
            bins_o.append(acc_o)
            acc_e = acc_o = 0.0
    bins_e[-1] += acc_e
    bins_o[-1] += acc_o
    e, o = torch.tensor(bins_e, dtype=torch.float64), torch.tensor(bins_o, dtype=torch.float64)
    x2 = float(((o - e) ** 2 / e).sum())
    df = len(bins_e) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x2 / 2)))


def head_tail_pvalue(counts: torch.Tensor, probs: torch.Tensor, head_min: float = 1e-4) -> float:
    """Exact two-sided binomial test of the number of draws among the rare tokens (p < head_min):
    an excess of rare tokens (the old infinite noise picks a token uniformly) shows here, where
    the fine chi-square bins spread it thin."""
    n, k = int(counts.sum()), int(counts[probs < head_min].sum())
    q = float(probs[probs < head_min].sum())
    if q == 0.0:
        return 1.0 if k == 0 else 0.0
    pmf = [math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(q)
                    + (n - i) * math.log1p(-q)) for i in range(n + 1)]
    return min(1.0, 2 * min(sum(pmf[k:]), sum(pmf[: k + 1])))


def claimed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    z = sampling.filter_logits(logits.float()[None] / temperature, top_k, top_p)[0]
    return torch.softmax(z.double(), -1)


def draw_counts(logits: torch.Tensor, n: int, temperature=1.0, top_k=0, top_p=1.0, seed=0, chunk=256):
    counts = torch.zeros(logits.shape[-1], dtype=torch.long)
    for s in range(0, n, chunk):
        ids = torch.arange(s, min(n, s + chunk))
        rows = logits[None].expand(len(ids), -1)
        toks = kernels.sample(rows, seed, ids, (ids * 7919) % 4096, temperature, top_k, top_p)
        counts += torch.bincount(toks, minlength=logits.shape[-1])
    return counts


def small_logits(vocab=256) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(vocab, generator=g) * 2.0


def large_logits() -> torch.Tensor:
    """A real vocabulary: 32 likely tokens over 151,904 unlikely ones (the rare ones hold 0.04 % of the
    mass at T 1, 1.8 % at T 1.3)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(QWEN_VOCAB, generator=g) * 0.5
    z[:32] = torch.randn(32, generator=g) + 16.0
    return z[torch.randperm(QWEN_VOCAB, generator=g)]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 1.0), (0, 0.9), (50, 0.8)])
def test_sampler_matches_the_claimed_distribution(temperature, top_k, top_p):
    z = small_logits()
    counts = draw_counts(z, 10000, temperature, top_k, top_p, seed=3)
    assert chi2_pvalue(counts, claimed(z, temperature, top_k, top_p)) > ALPHA


def test_negative_twin_a_temperature_five_percent_off_is_rejected():
    z = small_logits()
    counts = draw_counts(z, 10000, 1.05, seed=3)
    assert chi2_pvalue(counts, claimed(z, 1.0, 0, 1.0)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 40, 1.0)])
def test_sampler_matches_at_a_real_vocabulary(temperature, top_k, top_p):
    z = large_logits()
    counts = draw_counts(z, 600, temperature, top_k, top_p, seed=5, chunk=8)
    probs = claimed(z, temperature, top_k, top_p)
    assert chi2_pvalue(counts, probs) > ALPHA / 2 and head_tail_pvalue(counts, probs) > ALPHA / 2


def _old_uniform(seed, sample_ids, positions, vocab):
    """The mapping before the fix: (top 24 bits + 0.5) / 2**24, whose top value rounds to 1.0."""
    h = sampling.mix64(torch.full_like(sample_ids, sampling._s64(seed & sampling._M64)))
    h = sampling.mix64(h ^ sample_ids.long())
    h = sampling.mix64(h ^ positions.long())
    h = sampling.mix64(h[:, None] ^ torch.arange(vocab, dtype=torch.long)[None])
    return (sampling._srl(h, 40).float() + 0.5) * (1.0 / (1 << 24))


@pytest.mark.slow
def test_negative_twin_the_old_uniform_mapping_is_biased_at_a_real_vocabulary(monkeypatch):
    z = large_logits()
    monkeypatch.setattr(sampling, "uniform", _old_uniform)
    counts = draw_counts(z, 600, seed=5, chunk=8)
    assert head_tail_pvalue(counts, claimed(z, 1.0, 0, 1.0)) < ALPHA / 10


def test_noise_is_finite_at_every_hash_value():
    top = torch.tensor([(1 << sampling.UNIFORM_BITS) - 1, 0], dtype=torch.float32)
    u = (top + 0.5) * (1.0 / (1 << sampling.UNIFORM_BITS))
    assert u.tolist() == [1 - 2**-24, 2**-24] and bool((u < 1).all() and (u > 0).all())
    g = -sampling.fo.log(-sampling.fo.log(u))
    assert bool(torch.isfinite(g).all())
    # negative twin: the old mapping's top value is exactly 1.0 and its noise is +inf
    old = (torch.tensor([(1 << 24) - 1], dtype=torch.float32) + 0.5) * (1.0 / (1 << 24))
    assert old.item() == 1.0 and torch.isinf(-sampling.fo.log(-sampling.fo.log(old))).all()


def test_masked_tokens_never_win_and_no_token_is_outside_the_vocabulary():
    z = small_logits(64)
    n = 4096
    toks = kernels.sample(z[None].expand(n, -1), 9, torch.arange(n), torch.zeros(n, dtype=torch.long), top_k=3)
    kept = torch.isfinite(sampling.filter_logits(z[None], top_k=3))[0]
    assert bool(kept[toks].all()) and int(toks.max()) < 64
    with pytest.raises(RuntimeError, match="no finite maximum"):
        kernels.sample(torch.full((2, 8), float("nan")), 1, torch.arange(2), torch.zeros(2, dtype=torch.long))
