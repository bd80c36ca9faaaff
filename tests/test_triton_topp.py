"""kernels/triton/topp.py filter_cut: the torch filter's cut (sampling.filter_cut), key for key, and its
kept set, under the Triton interpreter on tiny rows: flat and peaked bf16 rows, top-k, top-p and both,
two temperatures, NaN / +-inf / all-equal / one-peak rows, a cut on a histogram bin's edge, V of 1, 7,
1000 and 5000; NaNs of either sign at the k-th place (sampling.NAN_CUT); seeded adversarial rows (bin edges
and their neighbours at 64 and 512 bins, tails of mass 0 to 3, ties at the k-th value, +-0, subnormals, +-1e30);
a bound exactly a tie block's mass; the window floor's spacing of the input dtype's values (bf16 rows at +20, 0.125
apart, keep the first window). Each under the estimated window's settings and under tiny windows (the cut
found by adjacent windows, or by the exact bins), the paths taken counted. Negative twins: a wrong mass bound
moves the cut; batch invariance; a negative NaN's own key as the cut keeps every value; a window of no width
never holds the cut; spikes far above a flat row keep the first window only with the lane maxima's own masses;
coarse bf16 rows keep it only with the dtype's spacing in the floor."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from rlalign.kernels import inverse_temperature, sampling
from rlalign.kernels.triton import topp
from rlalign.model.model import PAD_LOGIT

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (EST_RANK, EST_DMIN, EST_DTYPE_FLOOR, EST_RETRIES, PAIR_MAX): the product's window and key search; windows of no
# width (each retry's window is its estimate alone: adjacent windows, then the exact bins); windows of no width and
# no retry (the exact bins every time); the key search by levels alone, and by comparing every pair of the window's
# values
PRODUCT = (topp.EST_RANK, topp.EST_DMIN, topp.EST_DTYPE_FLOOR)
WINDOWS = {"estimated": (*PRODUCT, topp.EST_RETRIES, topp.PAIR_MAX),
           "tiny": (0, 0.0, False, 2, topp.PAIR_MAX), "exact_bins": (0, 0.0, False, 0, topp.PAIR_MAX),
           "levels": (*PRODUCT, topp.EST_RETRIES, 0), "pairs": (*PRODUCT, topp.EST_RETRIES, 1 << 20)}
WINDOW_NAMES = ("EST_RANK", "EST_DMIN", "EST_DTYPE_FLOOR", "EST_RETRIES", "PAIR_MAX")


@pytest.fixture(params=list(WINDOWS))
def window(request, monkeypatch):
    for name, v in zip(WINDOW_NAMES, WINDOWS[request.param]):
        monkeypatch.setattr(topp, name, v)
    return request.param


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


PASSES: list[torch.Tensor] = []  # each _check's window passes per row


def _check(z: torch.Tensor, top_k: int, top_p: float, scale: float) -> None:
    zt = sampling.temper(z, scale)
    want = sampling.filter_cut(zt, top_k, top_p)
    passes = torch.empty(len(z), dtype=torch.int32, device=z.device)
    got = topp.filter_cut(z, top_k, top_p, scale, passes=passes)
    PASSES.append(passes.cpu())
    assert got.dtype == torch.long and torch.equal(got, want), (got, want)
    ref = sampling.filter_logits(zt, top_k, top_p)  # its kept set: the values it did not set to -inf
    seen = zt != float("-inf")
    assert torch.equal(_kept(zt, got)[seen], (ref != float("-inf"))[seen])


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (20, 1.0), (20, 0.9), (1, 1.0), (0, 1e-9), (0, 0.999999)])
@pytest.mark.parametrize("scale", [1.0, 1.25])
def test_the_cut_is_the_torch_filters(top_k, top_p, scale, window):
    _check(_rows(4, 1000, 0), top_k, top_p, scale)


@pytest.mark.parametrize("window", ["estimated", "tiny", "exact_bins"], indirect=True)
def test_each_window_setting_takes_its_paths(window):
    """The paths behind the cuts above: the estimated window holds the cut on these rows; windows of no width
    never do (twin: the window's exact check refuses them), and the adjacent windows or the exact bins find it."""
    PASSES.clear()
    for top_p in (0.5, 0.9, 0.99):
        _check(_rows(8, 3000, 1), 0, top_p, 1.25)
    got = torch.cat(PASSES)
    retries = topp.EST_RETRIES
    if window == "estimated":
        assert (got == 1).all(), got
    else:
        assert (got >= 2).all(), got  # the first window (no width) is refused every time
        assert (got == retries + 2).any() or retries > 0
        assert ((got > 1) & (got < retries + 2)).any() == (retries > 0), got


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (5, 0.5), (0, 0.3)])
@triton.jit
def _spread_only(pts_row, zl, zc, every, anchor, zm, hist, off, ESCALE: tl.constexpr, NE: tl.constexpr):
    """The estimate with every bin's counted values spread evenly (no lane maxima at their own masses)."""
    return topp.est_spread(hist * every, off, NE, ESCALE), hist * every


@triton.jit
def _clamped(pts_row, zl, zc, every, anchor, zm, hist, off, ESCALE: tl.constexpr, NE: tl.constexpr):
    """The estimate with each bin's other values taken as its counts times `every` less all its lane maxima,
    clamped at 0 (not less the lane maxima met in the counted chunks)."""
    idx = tl.arange(0, NE)
    b, inb = topp._anchor_bin(zl, anchor, ESCALE, NE)
    tl.atomic_add(pts_row + b, (tl.exp(tl.minimum(zl - zm, 0.0)) * 1048576.0).to(tl.int32), mask=inb, sem="relaxed")
    tl.atomic_add(pts_row + NE + b, 1, mask=inb, sem="relaxed")
    tl.debug_barrier()
    pm = tl.atomic_add(pts_row + idx, tl.zeros((NE,), tl.int32), sem="relaxed").to(tl.float32) * (1.0 / 1048576.0)
    pn = tl.atomic_add(pts_row + NE + idx, tl.zeros((NE,), tl.int32), sem="relaxed")
    return topp.est_spread(tl.maximum(hist * every - pn, 0), off, NE, ESCALE) + pm, hist * every


def test_spikes_far_above_the_row_keep_the_first_window(monkeypatch):
    """Three values 4-10 above a flat row of 60,000 at T 0.6 (most of the mass, far above the estimate's anchor):
    the lane maxima at their own masses keep the cut in the first window. The twin: with every bin's values spread
    evenly the estimate misses in some rows (the adjacent window finds the cut)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, 60000, generator=g)
    z.scatter_(1, torch.randint(0, 60000, (5, 3), generator=g), 4 + 6 * torch.rand(5, 3, generator=g))
    z = z.bfloat16().to(DEV)
    PASSES.clear()
    _check(z, 0, 0.9, 1 / 0.6)
    assert (PASSES[-1] == 1).all(), PASSES[-1]
    monkeypatch.setattr(topp, "est_points", _spread_only)
    _check(z, 0, 0.9, 1 / 0.6)
    assert (PASSES[-1] > 1).any(), PASSES[-1]


def test_counts_over_every_sth_chunk_keep_the_first_window(monkeypatch):
    """Pass A counts the estimate's bins over every 7th chunk (EST_CHUNKS 8 of 59 chunks): the others in a bin,
    its counts less the lane maxima met in those chunks, times 7, keep every row's cut in the first window
    (normal(0, 2) rows, T 0.8, p 0.95). The twin: the counts times 7 less all the lane maxima, clamped at 0,
    overstate the top bins' mass and miss in some rows."""
    monkeypatch.setattr(topp, "EST_CHUNKS", 8)
    z = (torch.randn(8, 60000, generator=torch.Generator().manual_seed(1)) * 2.0).bfloat16().to(DEV)
    PASSES.clear()
    _check(z, 0, 0.95, 1.25)
    assert (PASSES[-1] == 1).all(), PASSES[-1]
    monkeypatch.setattr(topp, "est_points", _clamped)
    _check(z, 0, 0.95, 1.25)
    assert (PASSES[-1] > 1).any(), PASSES[-1]


@triton.jit
def _spacing_kernel(x_ptr, out_ptr, scale, ULP: tl.constexpr):
    """topp._spacing_at of each value x (tempered: x * scale) at distance 0 below it."""
    i = tl.program_id(0)
    zm = tl.load(x_ptr + i) * scale
    tl.store(out_ptr + i, topp._spacing_at(0.0, zm, scale, ULP))


def _spacing_of(x: torch.Tensor, ulp: float, scale: float) -> torch.Tensor:
    out = torch.empty(len(x), dtype=torch.float32, device=DEV)
    _spacing_kernel[(len(x),)](x.float().to(DEV), out, scale, ULP=ulp)
    return out.cpu()


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, torch.int16), (torch.float16, torch.int16),
                                        (torch.float32, torch.int32)])
def test_the_window_floor_is_the_distance_to_the_next_value(dtype, bits):
    """_spacing_at of a value of the dtype (scale 1 and 2: the tempered value's raw one exact) is its distance to
    the next value away from 0 (its bits + 1), times scale; 0 at 0 and at +-inf. The twin: the spacing of a
    dtype with other mantissa bits differs."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, generator=g) * torch.logspace(-3, 4, 64)).to(dtype)
    x = torch.cat([x, torch.tensor([1.0, -2.0, 16.0, 15.99, 20.0, -20.0], dtype=dtype)])
    nxt = (x.view(bits) + 1).view(dtype).float()
    for scale in (1.0, 2.0):
        got = _spacing_of(x, topp.value_spacing(dtype), scale)
        assert torch.equal(got, (nxt - x.float()).abs() * scale), (x, got)
    assert torch.equal(_spacing_of(torch.tensor([0.0, float("inf"), float("-inf")]), 2 ** -7, 1.0), torch.zeros(3))
    other = torch.float16 if dtype != torch.float16 else torch.bfloat16
    assert not torch.equal(_spacing_of(x, topp.value_spacing(other), 1.0), (nxt - x.float()).abs())


def _coarse_rows() -> torch.Tensor:
    """bf16 normal(0, 1) + 20: values in [16, 32) are 0.125 apart, in [8, 16) 0.0625, both above EST_DMIN."""
    g = torch.Generator().manual_seed(7)
    return (torch.randn(8, 4000, generator=g) + 20.0).bfloat16().to(DEV)


def _coarse_passes(monkeypatch) -> torch.Tensor:
    """The window passes over _coarse_rows at T 1 and 0.8, top-p 0.9 and 0.95, the window's estimated ranks
    scaled to the rows (EST_RANK 1024 of 151,936 columns: 27 of 4,000)."""
    monkeypatch.setattr(topp, "EST_RANK", 27)
    PASSES.clear()
    for scale in (1.0, 1.25):
        for top_p in (0.9, 0.95):
            _check(_coarse_rows(), 0, top_p, scale)
    return torch.cat(PASSES)


def test_bf16_values_coarser_than_the_floor_keep_the_first_window(monkeypatch):
    """The window's floor grows by the spacing of bf16's values at the estimate: every row's first window holds
    its cut."""
    got = _coarse_passes(monkeypatch)
    assert (got == 1).all(), got


def test_negative_twin_without_the_dtypes_spacing_coarse_rows_miss_the_first_window(monkeypatch):
    """With the floor at EST_DMIN alone the window around the estimate can hold no value near the cut: some rows
    take an adjacent window (the cut still the torch one)."""
    monkeypatch.setattr(topp, "EST_DTYPE_FLOOR", False)
    got = _coarse_passes(monkeypatch)
    assert (got > 1).any(), got


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (5, 0.5), (0, 0.3)])
def test_edge_rows(top_k, top_p, window):
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


def test_a_passes_tensor_of_the_wrong_kind_is_refused_by_name():
    z = _rows(3, 700, 2)
    topp.filter_cut(z, 0, 0.9, passes=torch.empty(3, dtype=torch.int32))  # the twin: the right kind is taken
    for bad in (torch.empty(3, dtype=torch.int64), torch.empty(4, dtype=torch.int32)):
        with pytest.raises(ValueError, match="passes must be a \\[3\\] int32"):
            topp.filter_cut(z, 0, 0.9, passes=bad)


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
    small, so the cut's bin is never compacted: the cut differs from the torch one on some row (the exact bins
    forced: windows of no width and no retry)."""
    for name, v in zip(WINDOW_NAMES, WINDOWS["exact_bins"]):
        monkeypatch.setattr(topp, name, v)
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


def _nan_rows() -> torch.Tensor:
    """fp32 rows with NaNs of either sign and a payload: one negative NaN, one NaN with payload 1, both a
    negative and a positive one."""
    z = torch.tensor([[1.0, 2.0, 0.0, 3.0, -1.0]] * 3)
    bits = z.view(torch.int32)
    bits[0, 2] = bits[2, 1] = -0x400000  # 0xFFC00000: the quiet NaN with its sign bit set
    bits[1, 2] = 0x7FC00001
    bits[2, 4] = 0x7FC00000
    return z.to(DEV)


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (2, 1.0), (2, 0.9), (0, 0.5)])
def test_a_nan_of_either_sign_at_the_kth_place_keeps_only_the_nans(top_k, top_p):
    """torch.topk ranks a NaN above every value, whatever its sign: a k-th largest NaN gives sampling.NAN_CUT on
    both sides (the NaNs alone kept), and top-p over a row with a NaN the same."""
    z = _nan_rows()
    _check(z, top_k, top_p, 1.0)
    got = topp.filter_cut(z, top_k, top_p)
    kth = torch.topk(z, max(top_k, 1), -1).values[:, -1]
    assert (got[(kth != kth) | (top_p < 1.0)] == sampling.NAN_CUT).all()


def test_negative_twin_a_negative_nans_own_key_as_the_cut_keeps_every_value():
    """The order key of the negative NaN ranked first (below -inf's) as row 0's top-1 cut keeps all five values,
    not the NaN alone: the kept-set check tells it from NAN_CUT."""
    z = _nan_rows()
    own = sampling.order_keys(torch.topk(z, 1, -1).values[:, -1]).long()
    assert _kept(z, own)[0].all()
    assert not torch.equal(_kept(z, own), _kept(z, topp.filter_cut(z, 1, 1.0)))


def _adversarial_rows(V: int, seed: int) -> torch.Tensor:
    """fp32 rows: values on the d-bins' edges of the current CUT_BINS and their fp32 neighbours; a tail 21.7 to
    24.1 below the max (masses 0 to 3, d = 24 and its neighbour) under a few high values; three tied levels
    (ties at the k-th value and at top-p's boundary); +-0, subnormals, +-1e30 and -inf; a flat row (1e-3)."""
    g = torch.Generator().manual_seed(seed)
    nb, inf = topp.CUT_BINS, torch.tensor(float("inf"))
    d = (torch.randint(0, nb + 8, (V,), generator=g).double() * topp.D_RANGE / nb).float()
    step = torch.randint(-1, 2, (V,), generator=g)
    d = torch.where(step > 0, d.nextafter(inf), torch.where(step < 0, d.nextafter(-inf), d)).clamp(min=0)
    tail = -(torch.rand(V, generator=g) * 2.4 + 21.7)
    tail[:6] = torch.tensor([0.0, -0.5, -1.5, -2.0, -24.0, float(torch.tensor(-24.0).nextafter(inf))])
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1e-38, -1e30, float("-inf"), 2.0, -3.0])
    specials = specials[torch.randint(0, len(specials), (V,), generator=g)]
    specials[V // 2] = 1e30
    ladder = torch.tensor([0.0, -0.5, -1.0])[torch.arange(V) % 3]
    flat = 3.0 + torch.rand(V, generator=g) * 1e-3
    return torch.stack([1.5 - d, tail, ladder, specials, flat]).to(DEV)


@pytest.mark.parametrize("nb", [64, 512])
def test_adversarial_rows(nb, monkeypatch, window):
    """The cut on bin edges, tails of mass 0 to 3, ties at the k-th value (top-k 86: level 0 holds 86 of
    256) and at top-p's boundary (p 1/3 and 2/3 of three equal levels), special values; fp32 and fp16."""
    monkeypatch.setattr(topp, "CUT_BINS", nb)
    z = _adversarial_rows(256, nb)
    for top_k, top_p, scale in [(0, 1 - 2 ** -30, 1.0), (0, 0.999999, 1.25), (0, 1 / 3, 1.0), (86, 2 / 3, 3.0),
                                (87, 1.0, 0.5), (255, 0.95, 1.0)]:
        _check(z, top_k, top_p, scale)
    _check(z.half(), 86, 0.9, 3.0)


def _p_on(target: int, q: int) -> float:
    """A top_p whose bound fp64(q) * top_p is exactly target (searched around target / q)."""
    p = target / q
    for _ in range(64):
        if q * p == target:
            return p
        p = math.nextafter(p, 1.0 if q * p < target else 0.0)
    raise AssertionError("no top_p gives the bound exactly")


def test_a_bound_equal_to_a_tie_blocks_mass(window):
    """Three tied levels: top_p * Q exactly the mass of the top block (86 values of 0) keeps that block alone
    (the mass above the next level is not below the bound); the next top_p up keeps the next block too."""
    z = _adversarial_rows(256, 3)[2:3]
    mass = sampling.top_p_mass(z, z.amax(-1, keepdim=True))
    p = _p_on(int(mass[z == 0].sum()), int(mass.sum()))
    for top_p in (p, math.nextafter(p, 1.0)):
        _check(z, 0, top_p, 1.0)
        _check(z, 255, top_p, 1.0)  # top-k first, keeping every value: the same masses
    kept = [int(_kept(z, topp.filter_cut(z, 0, q)).sum()) for q in (p, math.nextafter(p, 1.0))]
    assert kept == [int((z == 0).sum()), int((z >= -0.5).sum())]


@pytest.mark.parametrize("V, top_k, top_p, temperature", [(151936, 0, 0.95, 0.8), (32768, 0, 0.99, 0.05),
                                                          (32768, 20, 0.9, 0.7), (32768, 0, 0.5, 2.0)])
def test_the_pad_row_takes_the_top_p_cuts_first_window_and_keeps_one_value(V, top_k, top_p, temperature):
    """The Triton cut (interpreter) on a pad row (Transformer._head's keep) at a real vocabulary (the estimate's
    counts over every 4th chunk) and at 32,768 columns (every chunk): its cut from its first window (passes 1), one
    value kept, equal to the torch cut. Twin: an all-zero row (every value tied) misses its first window (retries,
    then the exact bins) and keeps the whole row."""
    scale = inverse_temperature(temperature)
    pad = torch.zeros(1, V, dtype=torch.bfloat16)
    pad[:, 0] = PAD_LOGIT
    got = {}
    for name, rows in (("pad", pad), ("tied", torch.zeros_like(pad))):
        passes = torch.empty(1, dtype=torch.int32)
        cut = topp.filter_cut(rows, top_k, top_p, scale, passes=passes)
        assert torch.equal(cut, sampling.filter_cut(sampling.temper(rows, scale), top_k, top_p))
        kept = (sampling.apply_cut(sampling.temper(rows, scale), cut) > float("-inf")).sum(1)
        got[name] = passes.tolist(), kept.tolist()
    assert got["pad"] == ([1], [1])
    if top_k == 0:  # the twin (top-k first cuts a tied row to its k values)
        assert got["tied"][0][0] > 1 and got["tied"][1] == [V]
