"""GPU: the fused Triton Gumbel-max draw equals the torch formulation's draw on the device (every
row, real vocabularies, seeds past 2**63, filtered logits) and draws from the claimed
distribution (chi-square, fixed seeds; the twin: a temperature 5 % off is rejected); the Triton
top-k/top-p filter keeps the torch threshold search's set with the same bits (twin: another p), under the
estimated window, tiny windows and the exact bins alone, and gives the same cut when run again (its window's
values are compacted in an order the atomics choose); the draw,
the draw-and-logprob and the logprob applying the filter's cut as they read bf16 logits give the filtered
copy's bits (twin: a cut one key higher), and the trainer's top-p scoring keeps its gradient."""

import pytest
import torch
from conftest import triton_filtered

from rlalign import kernels
from rlalign.kernels import sampling
from rlalign.kernels.triton import topp
from rlalign.kernels.triton.sampling import gumbel_argmax

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("rows,vocab,scale,seed", [(4096, 32000, 0.01, 3), (256, 151936, 0.05, 2**63 + 11),
                                                   (1000, 4097, 1.0, 0), (64, 1000, 0.01, 1)])  # 1: not a constant
def test_fused_draw_equals_the_torch_draw_on_the_device(rows, vocab, scale, seed):
    g = torch.Generator().manual_seed(rows)
    z = (torch.randn(rows, vocab, generator=g) * scale).cuda()
    z[::3, ::2] = float("-inf")
    ids = torch.randint(0, 2**40, (rows,), generator=g).cuda()
    pos = torch.randint(0, 4096, (rows,), generator=g).cuda()
    ref = sampling.first_argmax(z + sampling.gumbel(seed, ids, pos, vocab))
    assert torch.equal(gumbel_argmax(z, seed, ids, pos), ref)


def test_fused_draw_matches_the_claimed_distribution():
    from tests.test_sampling_stats import ALPHA, chi2_pvalue, claimed, small_logits

    z = small_logits().cuda()
    counts = {}
    for t in (1.0, 1.05):
        ids = torch.arange(200_000, device="cuda")
        with kernels.use(backend="triton"):
            toks = kernels.sample(z[None].expand(len(ids), -1), 3, ids, (ids * 7919) % 4096, t)
        counts[t] = torch.bincount(toks, minlength=z.numel()).cpu()
    assert chi2_pvalue(counts[1.0], claimed(z.cpu(), 1.0, 0, 1.0)) > ALPHA
    assert chi2_pvalue(counts[1.05], claimed(z.cpu(), 1.0, 0, 1.0)) < 1e-6  # twin: 5 % off is seen


@pytest.mark.parametrize("rows,vocab,scale,top_k,top_p", [(2048, 32000, 1.0, 0, 0.95), (512, 32000, 4.0, 20, 0.9),
                                                         (64, 151936, 1.0, 20, 0.9), (64, 151936, 3.0, 0, 0.95)])
@pytest.mark.parametrize("window", [(topp.EST_RANK, topp.EST_DMIN, topp.EST_DTYPE_FLOOR, topp.EST_RETRIES),
                                    (0, 0.0, False, 2), (0, 0.0, False, 0)])
def test_the_filter_kernel_keeps_the_torch_searchs_set_on_the_device(rows, vocab, scale, top_k, top_p, window,
                                                                     monkeypatch):
    for name, v in zip(("EST_RANK", "EST_DMIN", "EST_DTYPE_FLOOR", "EST_RETRIES"), window):
        monkeypatch.setattr(topp, name, v)
    g = torch.Generator().manual_seed(rows + vocab)
    z = ((torch.randn(rows, vocab, generator=g) * scale).bfloat16().float() / 0.8).cuda()  # bf16: ties
    z[0] = 1.25
    z[1, ::2] = float("-inf")
    want = sampling.filter_logits(z, top_k, top_p)
    assert torch.equal(triton_filtered(z, top_k, top_p).view(torch.int32), want.view(torch.int32))
    assert not torch.equal(triton_filtered(z, top_k, top_p * 0.9), want)
    cut = topp.filter_cut(z, top_k, top_p)
    assert all(torch.equal(topp.filter_cut(z, top_k, top_p), cut) for _ in range(3))


def _int_bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("top_k,top_p", [(0, 0.95), (50, 0.9), (20, 1.0)])
def test_the_cut_path_gives_the_filtered_copys_bits_on_the_device(temperature, top_k, top_p):
    """bf16 logits [64, 151936]: filter_cut's cut applied to the tempered logits is the torch filter's output; the
    draw, the draw with its logprob and the logprob applying the cut as they read the logits give the bits
    they give reading that output (a NaN row scored, not drawn from; -inf and +inf rows); twin: a cut one key
    higher moves the logprobs."""
    from rlalign.kernels.triton.logprob import log_softmax_gather, tempered_logprobs
    from rlalign.kernels.triton.sampling import gumbel_argmax_logprobs
    from rlalign.kernels.triton.topp import filter_cut

    g = torch.Generator(device="cuda").manual_seed(64)
    logits = (torch.randn(64, 151936, generator=g, device="cuda") * 2.0).bfloat16()
    logits[0, 11] = float("nan")
    logits[1, ::3] = float("-inf")
    logits[2, 40] = float("inf")
    s = 1.0 if temperature == 1.0 else kernels.inverse_temperature(temperature)
    copy = sampling.filter_logits(kernels.temper(logits, s), top_k, top_p)
    cut = filter_cut(logits, top_k, top_p, s)
    assert torch.equal(_int_bits(sampling.apply_cut(kernels.temper(logits, s), cut)), _int_bits(copy))
    ids, pos = torch.arange(64, device="cuda") * 7 + 3, torch.arange(64, device="cuda") % 4096
    tok = gumbel_argmax(logits[1:], 2**63 + 11, ids[1:], pos[1:], s, cut=cut[1:])
    assert torch.equal(tok, gumbel_argmax(copy[1:], 2**63 + 11, ids[1:], pos[1:]))
    tok1, lp1 = gumbel_argmax_logprobs(logits[1:], 2**63 + 11, ids[1:], pos[1:], s, cut=cut[1:])
    tok0, lp0 = gumbel_argmax_logprobs(copy[1:], 2**63 + 11, ids[1:], pos[1:])
    assert torch.equal(tok1, tok) and torch.equal(tok0, tok) and torch.equal(_int_bits(lp1), _int_bits(lp0))
    tok = torch.cat([tok[:1], tok])
    lp = tempered_logprobs(logits, s, tok, cut)
    assert torch.equal(_int_bits(lp), _int_bits(log_softmax_gather(copy, tok)))
    assert torch.isnan(lp[0]) and torch.equal(_int_bits(lp[1:]), _int_bits(lp1))
    with kernels.use(backend="triton"):  # kernels.tempered hands the cut to the consumers
        z = kernels.tempered(logits[1:], temperature, top_k, top_p)
        assert z.cut is not None and torch.equal(z.cut, cut[1:])
        tk, lk = kernels.sample_tempered_logprobs(z, 2**63 + 11, ids[1:], pos[1:])
        assert torch.equal(tk, tok[1:]) and torch.equal(_int_bits(lk), _int_bits(lp1))
    finite = torch.tensor([1, *range(3, 64)], device="cuda")  # a row keeping only +inf keeps nothing above
    higher = tempered_logprobs(logits[finite], s, tok[finite], cut[finite] + 1)
    assert (_int_bits(higher) != _int_bits(lp[finite])).any()  # twin


def test_the_trainers_top_p_scoring_keeps_its_gradient_on_the_device():
    """token_logprobs_rows with a gradient under top-p (Triton): the values of the scoring without one, and a
    gradient zero on the filtered columns and the rows not scored, nonzero on kept ones; twin: top_p 1."""
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(32, 151936, generator=g, device="cuda") * 2.0).bfloat16().requires_grad_()
    rows = torch.arange(1, 32, 2, device="cuda")
    tok = torch.randint(0, 151936, (16,), generator=g, device="cuda")
    grads = []
    with kernels.use(backend="triton"):
        for top_p in (0.9, 1.0):
            with torch.no_grad():
                want = kernels.token_logprobs_rows(logits, rows, tok, temperature=0.8, top_p=top_p)
            lp = kernels.token_logprobs_rows(logits, rows, tok, temperature=0.8, top_p=top_p)
            assert torch.equal(_int_bits(lp.detach()), _int_bits(want))
            grads.append(torch.autograd.grad(lp.sum(), logits)[0])
        kept = triton_filtered(logits.detach()[rows], 0, 0.9, kernels.inverse_temperature(0.8)) > float("-inf")
    grad = grads[0][rows]
    assert (grad[~kept] == 0).all() and (grads[0][::2] == 0).all() and (grad[kept] != 0).any()
    assert ((grads[0] == 0) & (grads[1] != 0)).any()  # twin: without the filter, those columns get gradient
