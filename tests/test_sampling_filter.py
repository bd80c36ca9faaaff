"""top-k / top-p by the threshold search (kernels/sampling.py filter_logits) keep exactly the set a
full sort defines: values >= the k-th largest; then, with the integer masses, the shortest
descending prefix whose mass reaches top_p (ties at its end kept). Rows with heavy ties (bf16
values), all-equal rows, -inf entries, signed zeros, k = 1, k >= V, p = 1 and tiny p. Negative twin:
one search pass fewer leaves the interval open and keeps another set."""

import pytest
import torch

from rlalign.kernels import sampling


def sort_reference(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The kept set by sorting each row: the k-th largest value, then the masses' exact prefix sums."""
    out = z.clone()
    for r in range(z.shape[0]):
        zr = z[r]
        if top_k and top_k < zr.numel():
            kth = torch.sort(zr, descending=True).values[top_k - 1]
            zr = torch.where(zr >= kth, zr, float("-inf"))
        if top_p < 1.0:
            zs = torch.sort(zr + 0.0, descending=True, stable=True).values
            mass = sampling.top_p_mass(zs[None], zs[:1][None])[0]
            before = torch.cumsum(mass, 0) - mass  # exact: int64
            first = torch.ones_like(zs, dtype=torch.bool)
            first[1:] = zs[1:] != zs[:-1]
            group_start = torch.cummax(torch.where(first, torch.arange(zs.numel()), 0), 0).values
            above = before[group_start]  # the mass strictly above each value
            kept = above.double() < float(mass.sum()) * top_p
            zr = torch.where(zr >= zs[kept].min(), zr, float("-inf"))
        out[r] = torch.where(torch.isinf(zr) & (zr < 0), float("-inf"), z[r])
    return out


def _rows(seed: int, rows: int, vocab: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).bfloat16().float()  # bf16: many ties


def _special(vocab: int = 40) -> torch.Tensor:
    z = _rows(1, 6, vocab, 1.0)
    z[0] = 0.75  # all equal
    z[1, ::2] = float("-inf")  # half filtered already
    z[2, :10] = 0.0
    z[2, 10:20] = -0.0  # signed zeros tie
    z[3] = torch.linspace(-60.0, 3.0, vocab)  # a tail far below the mass floor
    z[4, 5] = 1e30  # one value carries all the mass
    z[5, :] = z[5, :4].repeat(vocab // 4 + 1)[:vocab]  # four distinct values
    return z


CASES = [(0, 0.9), (0, 0.5), (0, 1e-9), (0, 0.999999), (1, 1.0), (3, 1.0), (7, 0.8), (1, 0.5), (20, 0.95)]


@pytest.mark.parametrize("top_k,top_p", CASES)
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_the_search_keeps_the_sorted_set(top_k, top_p, scale):
    z = torch.cat([_rows(7, 10, 97, scale), _special(97)])
    got = sampling.filter_logits(z, top_k, top_p)
    assert torch.equal(got.view(torch.int32), sort_reference(z, top_k, top_p).view(torch.int32))


def test_edge_cases():
    z = _special()
    V = z.shape[1]
    assert sampling.filter_logits(z, 0, 1.0) is z  # nothing to filter
    for k in (V, V + 5):
        assert torch.equal(sampling.filter_logits(z, k, 1.0), z)
    k1 = sampling.filter_logits(z, 1, 1.0)
    assert torch.equal(torch.isfinite(k1), z == z.amax(-1, keepdim=True))  # the max and its ties
    assert torch.equal(sampling.filter_logits(z[:1], 3, 0.1), z[:1])  # all equal: everything kept
    signed = sampling.filter_logits(z[2:3], 12, 1.0)
    assert torch.isfinite(signed).sum() >= 20 and torch.equal(signed[0, 10:20].view(torch.int32),
                                                               z[2, 10:20].view(torch.int32))  # -0.0 kept as is
    assert torch.isfinite(sampling.filter_logits(z[4:5], 0, 0.999999)).sum() == 1
    nan = z[:2].clone()
    nan[:, 3] = float("nan")
    assert torch.isnan(sampling.filter_logits(nan, 2, 0.5)[:, 3]).all()  # the sampler still refuses the row


def test_negative_twin_one_pass_fewer_keeps_another_set(monkeypatch):
    z = _rows(5, 8, 97, 3.0)  # values of both signs: the widest key intervals
    ref = sort_reference(z, 0, 0.9)
    assert torch.equal(sampling.filter_logits(z, 0, 0.9), ref)
    monkeypatch.setattr(sampling, "SEARCH_PASSES", sampling.SEARCH_PASSES - 1)
    assert not torch.equal(sampling.filter_logits(z, 0, 0.9), ref)
