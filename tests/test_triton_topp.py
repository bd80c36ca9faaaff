"""kernels/triton/topp.py filter_cut: the torch filter's cut (sampling.filter_cut), key for key, and its
kept set, under the Triton interpreter on tiny rows: flat and peaked bf16 rows, top-k, top-p and both,
two temperatures, NaN / +-inf / all-equal / one-peak rows, a cut on a histogram bin's edge, V of 1, 7,
1000 and 5000. Negative twins: a wrong mass bound moves the cut; batch invariance."""

from __future__ import annotations

import pytest
import torch

from rlalign.kernels import sampling
from rlalign.kernels.triton import topp

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(n: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.tensor([1.0, 4.0] * n)[:n, None]
    return (torch.randn(n, V, generator=g) * s).bfloat16().to(DEV)


def _edge_rows(V: int = 600) -> torch.Tensor:
    z = _rows(8, V, 5).float()
    z[0, 7] = float("nan")
    z[1, ::3] = float("-inf")
    z[2, 40] = float("inf")
    z[3] = 0.75  # all equal
    z[4] = -30.0
    z[4, 9] = 0.0  # every mass but the max's is 0
    z[5] = float("-inf")
    z[6, :] = torch.linspace(-3.0, 3.0, V)
    z[6, 100:110] = 3.0  # ties at the top
    return z.bfloat16()


def _kept(zt: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    return (sampling.order_keys(zt) >= cut[:, None]) | (zt != zt)


def _check(z: torch.Tensor, top_k: int, top_p: float, scale: float) -> None:
    zt = sampling.temper(z, scale)
    want = sampling.filter_cut(zt, top_k, top_p)
    got = topp.filter_cut(z, top_k, top_p, scale)
    assert got.dtype == torch.long and torch.equal(got, want), (got, want)
    ref = sampling.filter_logits(zt, top_k, top_p)  # its kept set: the values it did not set to -inf
    seen = zt != float("-inf")
    assert torch.equal(_kept(zt, got)[seen], (ref != float("-inf"))[seen])


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (20, 1.0), (20, 0.9), (1, 1.0), (0, 1e-9), (0, 0.999999)])
@pytest.mark.parametrize("scale", [1.0, 1.25])
def test_the_cut_is_the_torch_filters(top_k, top_p, scale):
    _check(_rows(4, 1000, 0), top_k, top_p, scale)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (5, 0.5), (0, 0.3)])
def test_edge_rows(top_k, top_p):
    _check(_edge_rows(), top_k, top_p, 1.25)


@pytest.mark.parametrize("V", [1, 7, 5000])
def test_vocabulary_sizes(V):
    z = _rows(2, V, 1)
    for top_k, top_p in [(0, 0.8), (3, 1.0), (3, 0.8), (V, 1.0)]:
        _check(z, top_k, top_p, 1.0)


def test_fp32_unscaled_and_no_filter_and_empty():
    z = _rows(3, 700, 2).float()
    _check(z, 10, 0.9, 1.0)
    assert (topp.filter_cut(z, 0, 1.0) == sampling.KEEP_ALL).all()
    assert topp.filter_cut(z[:0], 5, 0.9).shape == (0,)


def test_a_cut_on_a_bin_edge():
    """Values on the d-bins' edges (d = j * 24 / NB exactly in fp32 steps): the cut lands on one."""
    w = topp.D_RANGE / topp.CUT_BINS
    d = torch.arange(0, 300, dtype=torch.float32) * w
    z = torch.stack([-d, -d.flip(0)]).to(DEV)
    for p in (0.5, 0.9, 0.99):
        _check(z, 0, p, 1.0)
        cut = topp.filter_cut(z, 0, p)
        assert (sampling.order_keys(z) == cut[:, None]).any(-1).all()


def test_negative_twin_a_wrong_mass_bound_moves_the_cut(monkeypatch):
    """Lower bounds above the true masses (every bin's low bound raised to its high one) make jb too
    small, so the cut's bin is never compacted: the cut differs from the torch one on some row."""
    z = _rows(4, 1000, 0)
    want = sampling.filter_cut(sampling.temper(z, 1.0), 0, 0.9)
    lo, hi = topp.mass_bounds(topp.CUT_BINS)
    monkeypatch.setattr(topp, "mass_bounds", lambda nb: ([h * 2 for h in hi], hi))
    from rlalign.kernels.triton import common
    common._CACHE.clear()
    try:
        assert not torch.equal(topp.filter_cut(z, 0, 0.9), want)
    finally:
        common._CACHE.clear()


def test_batch_invariance():
    z = _edge_rows(300)
    for top_k, top_p in [(0, 0.9), (7, 0.8)]:
        batch = topp.filter_cut(z, top_k, top_p, 1.25)
        alone = torch.cat([topp.filter_cut(z[r:r + 1], top_k, top_p, 1.25) for r in range(len(z))])
        assert torch.equal(batch, alone)
        assert not torch.equal(topp.filter_cut(z, top_k, 0.5, 1.25), batch)  # twin: the cut does depend on p


def _bound_violations(lo: list[int], hi: list[int]) -> int:
    """Values d = zm - z over [0, 24) (a grid through every bin and its edges, in fp32): how many masses
    fall outside their bin's [lo, hi], the bin and the mass computed as the kernel does."""
    nb = topp.CUT_BINS
    edges = torch.arange(nb, dtype=torch.float64) * topp.D_RANGE / nb
    d = torch.cat([torch.rand(200_000, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 24,
                   edges, edges.nextafter(torch.tensor(-1.0, dtype=torch.float64))]).float().clamp(0, 23.999)
    d = torch.cat([d, d.nextafter(torch.tensor(0.0)), d.nextafter(torch.tensor(30.0))])
    b = (d * torch.tensor(topp.bin_scale(nb), dtype=torch.float32)).long().clamp(max=nb - 1)
    mass = sampling.top_p_mass(-d[:, None], torch.zeros(1, 1))[:, 0]
    return int(((mass < torch.tensor(lo)[b]) | (mass > torch.tensor(hi)[b])).sum())


def test_the_mass_bounds_hold_and_a_tight_one_fails():
    lo, hi = topp.mass_bounds()
    assert _bound_violations(lo, hi) == 0
    assert _bound_violations(lo, hi[1:] + [0]) > 0  # twin: each bin's upper bound from the bin below it
