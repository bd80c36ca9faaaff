"""The product's draw (kernels/triton/sampling.py) computes the noise's logs only for values that may reach the row's
best so far (may_reach); a value it rules out has z + noise below that best, so the tokens are the full draw's. What
that rests on: the noise of every one of the 2**23 uniforms lies within 1e-6 of -log(-log u) and below NOISE_BOUND;
may_reach keeps every value whose z + noise reaches the best (values placed within a hundredth of it, both sides),
and rules out most of those further below; the draw computes few chunks exactly and draws the full draw's tokens,
also where every chunk holds a new maximum. Negative twins: a negative margin rules out values that reach the best,
and the draw then takes other tokens. On CUDA the same checks run with the device's exp (tl.exp: ex2.approx); else
the Triton interpreter."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rlalign.kernels import fixed_order as fo  # noqa: E402
from rlalign.kernels import sampling  # noqa: E402
from rlalign.kernels.triton import sampling as tsampling  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _noise(k: torch.Tensor) -> torch.Tensor:
    """The sampler's noise of the uniform u = (k + 0.5) / 2**23 (kernels.sampling.gumbel's formula)."""
    return -fo.log(-fo.log((k.float() + 0.5) * (1.0 / 8388608.0)))


def test_the_noise_is_within_1e_6_of_gumbel_and_below_the_bound_at_every_uniform():
    k = torch.arange(1 << 23)
    g = _noise(k)
    u = (k.double() + 0.5) / 8388608.0
    assert (g.double() - (-torch.log(-torch.log(u)))).abs().max() < 1e-6
    assert g.max() < tsampling.NOISE_BOUND.value and g.max() > 16.6  # the bound is near the greatest noise


@triton.jit
def _may_reach_kernel(z_ptr, k_ptr, best_ptr, out_ptr, MARGIN: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    out = tsampling.may_reach(tl.load(z_ptr + i), tl.load(k_ptr + i).to(tl.float32), tl.load(best_ptr), MARGIN)
    tl.store(out_ptr + i, out.to(tl.int32))


def _margin(best: float) -> float:
    return tsampling.DRAW_MARGIN * (1.0 + 2e-3 * abs(best))


def _cases(best: float, n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniforms' k over the whole range (both ends included) and z placed so that z + noise lies at best (a quarter:
    z = best - noise, rounded), within a few ulps of it (a quarter) or within 4 margins of it; (z, k, x = fl(z +
    noise))."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 1 << 23, (n,), generator=gen)
    k[:4] = torch.tensor([0, 1, (1 << 23) - 2, (1 << 23) - 1])
    g = _noise(k)
    delta = (torch.rand(n, generator=gen) - 0.5) * 8 * _margin(best)
    delta[: n // 4] = 0.0
    delta[n // 4: n // 2] *= 1e-4
    z = (best - g) + delta
    return z, k, z + g


def _may_reach(z, k, best, margin):
    out = torch.empty(len(z), dtype=torch.int32, device=DEV)
    _may_reach_kernel[(1,)](z.to(DEV), k.to(DEV, torch.int32), torch.tensor([best], device=DEV), out, MARGIN=margin,
                            N=len(z))
    return out.cpu().bool()


@pytest.mark.parametrize("best", [0.0, 5.3, -20.25, 1.0e4, 3.0e6])
def test_may_reach_keeps_every_value_that_reaches_the_best_and_rules_out_most_below(best):
    z, k, x = _cases(best)
    keep = _may_reach(z, k, best, tsampling.DRAW_MARGIN)
    reaches = x >= best
    assert reaches.any() and keep[reaches].all()
    far = x < best - 2 * _margin(best)
    assert far.sum() > 300 and keep[far].float().mean() < 0.05, keep[far].float().mean()


def test_negative_twin_a_negative_margin_rules_out_values_that_reach_the_best():
    z, k, x = _cases(5.3)
    keep = _may_reach(z, k, 5.3, -0.005)
    assert not keep[x >= 5.3].all()


def test_may_reach_at_the_edges():
    """Nothing found yet: every value above -inf may reach; -inf never; NaN and +inf always; a best of +inf
    rules out every finite value; the greatest noise (16.64) lifts 2 past 18 and not 1."""
    z = torch.tensor([0.0, -1e30, float("-inf"), float("nan"), float("inf"), 1e30, 2.0, 1.0])
    k = torch.tensor([0, 4194304, 8388607, 0, 0, 8388607, 8388607, 8388607])
    assert _may_reach(z, k, float("-inf"), 1e-3).tolist() == [True, True, False, True, True, True, True, True]
    assert _may_reach(z, k, float("inf"), 1e-3).tolist() == [False, False, False, True, True, False, False, False]
    assert _may_reach(z, k, 0.0, 1e-3).tolist() == [False, False, False, True, True, True, True, True]
    assert _may_reach(z, k, 18.0, 1e-3).tolist() == [False, False, False, True, True, True, True, False]


def _rows(rows: int, vocab: int, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=g) * scale).bfloat16()
    ids = torch.randint(0, 2**40, (rows,), generator=g)
    pos = torch.randint(0, 4096, (rows,), generator=g)
    return z, ids, pos


def _full_draw(z, seed, ids, pos, scale):
    return sampling.first_argmax(sampling.temper(z, scale) + sampling.gumbel(seed, ids, pos, z.shape[1]))


def test_the_draw_computes_few_chunks_exactly_and_takes_the_full_draws_tokens():
    """Rows of 20,000 bf16 logits (40 chunks) where the noise decides (scale 0.01), at T 0.8 (scale 2) and
    peaked (scale 8); then rows where every chunk holds a new maximum (ascending) or the maximum is the last
    value: every chunk computed exactly there, the same tokens."""
    chunks = -(-20000 // tsampling.DRAW_BLOCK)
    for scale, seed in ((0.01, 1), (2.0, 2), (8.0, 3)):
        z, ids, pos = _rows(6, 20000, scale, seed)
        exact = torch.zeros(6, dtype=torch.int32, device=DEV)
        tok = tsampling.gumbel_argmax(z.to(DEV), 11, ids.to(DEV), pos.to(DEV), 1.25, exact=exact).cpu()
        assert torch.equal(tok, _full_draw(z, 11, ids, pos, 1.25)), scale
        assert exact.min() >= 1 and exact.float().mean() < chunks / 4, (scale, exact.tolist())
    z = torch.stack([torch.linspace(-400.0, 400.0, 20000), torch.full((20000,), -4.0)]).bfloat16()
    z[1, -1] = 30.0
    ids, pos = torch.tensor([5, 6]), torch.tensor([0, 9])
    exact = torch.zeros(2, dtype=torch.int32, device=DEV)
    tok = tsampling.gumbel_argmax(z.to(DEV), 3, ids.to(DEV), pos.to(DEV), 1.25, exact=exact).cpu()
    assert torch.equal(tok, _full_draw(z, 3, ids, pos, 1.25)) and tok[1] == 19999
    assert exact[0] == chunks, exact.tolist()  # rising 25 a chunk, more than the noise spans: each may hold the max


def test_negative_twin_a_negative_margin_draws_other_tokens(monkeypatch):
    z, ids, pos = _rows(16, 4000, 0.01, 4)
    ref = _full_draw(z, 11, ids, pos, 1.0)
    assert torch.equal(tsampling.gumbel_argmax(z.to(DEV), 11, ids.to(DEV), pos.to(DEV)).cpu(), ref)
    monkeypatch.setattr(tsampling, "DRAW_MARGIN", -1.0)
    assert not torch.equal(tsampling.gumbel_argmax(z.to(DEV), 11, ids.to(DEV), pos.to(DEV)).cpu(), ref)
