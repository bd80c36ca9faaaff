"""The Triton sampler's consumers with a top-k/top-p cut (kernels/triton/topp.py filter_cut): the draw, the
draw-and-logprob and the logprob apply each row's cut as they read the logits, and give the bits they give on
the filtered fp32 copy (conftest.triton_filtered): tokens, logprobs, NaN rows refused; kernels.tempered hands the cut to
them (Tempered.cut); the trainer's scoring under top-p keeps its gradient through the cut's `where`. Twins: a
cut one key higher moves logprobs; no cut draws other tokens. CPU: the Triton interpreter; on CUDA:
tests/gpu/test_sampling_gpu.py."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from conftest import triton_filtered  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.kernels import sampling  # noqa: E402
from rlalign.kernels.triton.logprob import log_softmax_gather, tempered_logprobs  # noqa: E402
from rlalign.kernels.triton.sampling import DRAW_BLOCK, gumbel_argmax, gumbel_argmax_logprobs  # noqa: E402
from rlalign.kernels.triton.topp import KEEP_ALL, filter_cut  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FILTERS = [(7, 1.0), (0, 0.9), (40, 0.8)]
SEED = 2**63 + 5


def _logits(dtype, temperature, vocab=1500):
    """[6, vocab] logits: a NaN entry (row 0), -inf entries (row 1), +inf (row 2), a peaked row (3), flat
    ones (the noise decides among many kept tokens); fp32 rows not bf16-valued (no ties), bf16 rows with
    ties; the fp32 factor of the temperature."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, vocab, generator=g) * torch.tensor([1.0, 1.0, 1.0, 6.0, 0.3, 2.0])[:, None]).to(dtype)
    logits[0, 11] = float("nan")
    logits[1, ::3] = float("-inf")
    logits[2, 40] = float("inf")
    scale = 1.0 if temperature == 1.0 else kernels.inverse_temperature(temperature)
    return logits.to(DEV), scale


def _bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def _ids(n):
    return torch.arange(n, device=DEV) * 5 + 1, torch.arange(n, device=DEV) + 9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("top_k,top_p", FILTERS)
def test_the_cut_path_gives_the_filtered_copys_bits(dtype, temperature, top_k, top_p):
    """filter_cut's cut applied to the tempered logits is the torch filter's output; the draw, the draw with its
    logprob and the logprob applying it in registers give the bits they give reading that output."""
    logits, scale = _logits(dtype, temperature)
    copy = sampling.filter_logits(kernels.temper(logits, scale), top_k, top_p)
    cut = filter_cut(logits, top_k, top_p, scale)
    assert cut.dtype == torch.long and cut.shape == (6,)
    assert torch.equal(_bits(sampling.apply_cut(kernels.temper(logits, scale), cut)), _bits(copy))
    assert torch.isfinite(copy).sum() < torch.isfinite(kernels.temper(logits, scale)).sum()  # it filters
    ids, pos = _ids(5)
    tok = gumbel_argmax(logits[1:], SEED, ids, pos, scale, cut=cut[1:])  # row 0 (NaN) is an error to draw from
    assert torch.equal(tok, gumbel_argmax(copy[1:], SEED, ids, pos))
    tok1, lp1 = gumbel_argmax_logprobs(logits[1:], SEED, ids, pos, scale, cut=cut[1:])
    tok0, lp0 = gumbel_argmax_logprobs(copy[1:], SEED, ids, pos)
    assert torch.equal(tok1, tok0) and torch.equal(tok1, tok) and torch.equal(_bits(lp1), _bits(lp0))
    tok = torch.cat([tok[:1], tok])
    lp = tempered_logprobs(logits, scale, tok, cut)
    assert torch.equal(_bits(lp), _bits(log_softmax_gather(copy, tok)))
    assert torch.isnan(lp[0]) and torch.equal(_bits(lp[1:]), _bits(lp1))


def test_without_a_filter_the_cut_keeps_every_value():
    logits, scale = _logits(torch.bfloat16, 0.8)
    cut = filter_cut(logits, 0, 1.0, scale)
    assert torch.equal(cut, torch.full((6,), KEEP_ALL, device=DEV))
    z = kernels.temper(logits, scale)
    assert torch.equal(_bits(sampling.apply_cut(z, cut)), _bits(z))
    assert filter_cut(logits[:0], 7, 0.9).shape == (0,)


@pytest.mark.skipif(DEV == "cuda", reason="a device-side assert would end the CUDA context")
def test_a_nan_row_is_still_refused_through_the_cut():
    logits, scale = _logits(torch.bfloat16, 0.8)
    empty = logits.clone()
    empty[1] = float("-inf")  # nothing to keep
    ids, pos = _ids(6)
    for y in (logits, empty):
        cut = filter_cut(y, 7, 0.9, scale)
        for draw in (gumbel_argmax, gumbel_argmax_logprobs):
            with pytest.raises(RuntimeError, match="no finite maximum"):
                draw(y, SEED, ids, pos, scale, cut=cut)
    cut = filter_cut(logits[1:], 7, 0.9, scale)
    gumbel_argmax(logits[1:], SEED, ids[1:], pos[1:], scale, cut=cut)  # twin: the other rows draw


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 7, 1.0), (0.8, 0, 0.9), (0.8, 40, 0.8)])
def test_kernels_tempered_hands_the_cut_to_every_consumer(temperature, top_k, top_p):
    """Under the Triton backend kernels.tempered returns the logits with a cut; sample_tempered,
    sample_tempered_logprobs, tempered_logprobs and values() give the filtered copy's bits (greedy too)."""
    logits, _ = _logits(torch.bfloat16, temperature)
    logits = logits[1:]
    ids, pos = _ids(5)
    with kernels.use(backend="triton"):
        z = kernels.tempered(logits, temperature, top_k, top_p)
        assert z.logits is logits and z.cut is not None
        copy = kernels.Tempered(triton_filtered(logits, top_k, top_p, z.scale))
        assert torch.equal(_bits(z.values()), _bits(copy.values()))
        tok, lp = kernels.sample_tempered_logprobs(z, 3, ids, pos)
        tok0, lp0 = kernels.sample_tempered_logprobs(copy, 3, ids, pos)
        assert torch.equal(tok, tok0) and torch.equal(_bits(lp), _bits(lp0))
        assert torch.equal(kernels.sample_tempered(z, 3, ids, pos), tok)
        assert torch.equal(_bits(kernels.tempered_logprobs(z, tok)), _bits(lp))
        greedy = kernels.tempered(logits, 1.0, top_k, top_p)
        assert torch.equal(kernels.sample_tempered(greedy, 3, ids, pos, greedy=True),
                           sampling.first_argmax(triton_filtered(logits, top_k, top_p)))
    with kernels.use(backend="torch"):  # the torch backend reads a Tempered with a cut through values()
        assert torch.equal(kernels.sample_tempered(z, 3, ids, pos), tok)


def test_the_trainers_scoring_under_top_p_keeps_its_gradient():
    """token_logprobs_rows with a gradient under top-p on the Triton backend: the values of the scoring
    without one, and a gradient through the cut's where: log_softmax_gather's over the filtered values, zero
    on the filtered columns and the rows not scored (the torch backend's, to fp32 rounding)."""
    logits, _ = _logits(torch.bfloat16, 0.8, vocab=300)
    logits = logits[1:].clone().requires_grad_()
    rows, tok = torch.tensor([0, 2, 3], device=DEV), torch.tensor([0, 5, 9], device=DEV)
    kw = dict(temperature=0.8, top_p=0.9)
    with kernels.use(backend="triton"):
        with torch.no_grad():
            want = kernels.token_logprobs_rows(logits, rows, tok, **kw)
        lp = kernels.token_logprobs_rows(logits, rows, tok, **kw)
        (grad,) = torch.autograd.grad(lp.sum(), logits)
        copy = triton_filtered(logits.detach()[rows], 0, 0.9, kernels.inverse_temperature(0.8))
    assert torch.equal(_bits(lp.detach()), _bits(want))
    v = kernels.temper(logits[rows], kernels.inverse_temperature(0.8))
    ref_lp = log_softmax_gather(torch.where(copy == float("-inf"), float("-inf"), v), tok)
    (ref,) = torch.autograd.grad(ref_lp.sum(), logits)
    assert torch.equal(grad, ref)
    kept = torch.zeros_like(grad, dtype=torch.bool)
    kept[rows] = copy > float("-inf")
    assert (grad[~kept] == 0).all() and (grad[kept] != 0).sum() > kept.sum() // 2
    assert (~kept[rows]).sum() > 0  # the filter dropped columns of the scored rows
    with kernels.use(backend="torch"):
        (torch_grad,) = torch.autograd.grad(kernels.token_logprobs_rows(logits, rows, tok, **kw).sum(), logits)
    torch.testing.assert_close(grad.float(), torch_grad.float(), rtol=1e-2, atol=1e-3)


def test_negative_twin_an_unfiltered_scoring_has_another_gradient():
    logits, _ = _logits(torch.bfloat16, 0.8, vocab=300)
    logits = logits[1:].clone().requires_grad_()
    rows, tok = torch.tensor([0, 2, 3], device=DEV), torch.tensor([0, 5, 9], device=DEV)
    grads = []
    with kernels.use(backend="triton"):
        for top_p in (0.9, 1.0):
            lp = kernels.token_logprobs_rows(logits, rows, tok, temperature=0.8, top_p=top_p)
            grads.append(torch.autograd.grad(lp.sum(), logits)[0])
    assert ((grads[0] == 0) & (grads[1] != 0)).any()


def test_negative_twin_a_cut_one_key_higher_or_no_cut_gives_other_bits():
    """A cut one above filter_cut's drops each row's least kept value (top-k 40: each row keeps 40): every
    row's logprob moves; the draw without the cut picks filtered tokens on flat rows."""
    logits, scale = _logits(torch.float32, 0.8)
    logits = logits[[1, 3, 4, 5]]  # finite maxima: a row keeping only +inf would keep nothing one key higher
    ids, pos = _ids(4)
    cut = filter_cut(logits, 40, 1.0, scale)
    tok, lp = gumbel_argmax_logprobs(logits, SEED, ids, pos, scale, cut=cut)
    assert (_bits(tempered_logprobs(logits, scale, tok, cut + 1)) != _bits(lp)).all()
    assert (_bits(gumbel_argmax_logprobs(logits, SEED, ids, pos, scale, cut=cut + 1)[1]) != _bits(lp)).any()
    assert torch.equal(_bits(tempered_logprobs(logits, scale, tok, cut)), _bits(lp))  # the cut itself: equal
    assert not torch.equal(gumbel_argmax(logits, SEED, ids, pos, scale), tok)


def _chunked_rows(vocab: int) -> torch.Tensor:
    """bf16 rows over several draw chunks whose top lies in one chunk each (the first, a middle one, the last,
    partial) or two far apart, and a row whose only NaN sits in a chunk of filtered values."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(5, vocab, generator=g)
    for r, cols in enumerate(([3, 40, 500], [1500, 1700], [vocab - 2, vocab - 30], [10, vocab - 5], [2100, 2300])):
        z[r, cols] += 12.0
    z[4, 700] = float("nan")
    return z.bfloat16().to(DEV)


def test_chunks_the_cut_filtered_whole_draw_the_filtered_copys_bits():
    """The draw skips the noise of chunks (DRAW_BLOCK columns) whose values the cut filtered whole; top-k 3 over
    rows whose top lies in one or two chunks of seven: the tokens and logprobs of the filtered copy; the row whose
    NaN sits among filtered values is still refused (a chunk holding a NaN is never skipped)."""
    vocab = 3 * DRAW_BLOCK + 1700
    z = _chunked_rows(vocab)
    scale = kernels.inverse_temperature(0.8)
    cut = filter_cut(z[:4], 3, 1.0, scale)
    copy = sampling.filter_logits(kernels.temper(z[:4], scale), 3, 1.0)
    ids, pos = _ids(4)
    tok, lp = gumbel_argmax_logprobs(z[:4], SEED, ids, pos, scale, cut=cut)
    tok0, lp0 = gumbel_argmax_logprobs(copy, SEED, ids, pos)
    assert torch.equal(tok, tok0) and torch.equal(_bits(lp), _bits(lp0))
    assert torch.equal(gumbel_argmax(z[:4], SEED, ids, pos, scale, cut=cut), tok0)
    kept = torch.nn.functional.pad(torch.isfinite(copy), (0, -vocab % DRAW_BLOCK)).view(4, -1, DRAW_BLOCK)
    assert kept.shape[1] == 7 and (kept.any(-1).sum(-1) <= 3).all()  # 4 to 6 of 7 chunks filtered whole
    # twins: another seed draws other tokens among the kept ones; the NaN row is refused
    assert not torch.equal(gumbel_argmax(z[:4], SEED + 1, ids, pos, scale, cut=cut), tok)
    if DEV == "cpu":
        with pytest.raises(RuntimeError, match="no finite maximum"):
            gumbel_argmax(z[4:], SEED, ids[:1], pos[:1], scale, cut=filter_cut(z[4:], 3, 1.0, scale))
