"""GPU: the fused Triton Gumbel-max draw equals the torch formulation's draw on the device (every
row, real vocabularies, seeds past 2**63, filtered logits) and draws from the claimed
distribution (chi-square, fixed seeds; the twin: a temperature 5 % off is rejected); the Triton
top-k/top-p filter keeps the torch threshold search's set with the same bits (twin: another p)."""

import pytest
import torch

from rlalign import kernels
from rlalign.kernels import sampling
from rlalign.kernels.triton.sampling import filter_logits, gumbel_argmax

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
def test_the_filter_kernel_keeps_the_torch_searchs_set_on_the_device(rows, vocab, scale, top_k, top_p):
    g = torch.Generator().manual_seed(rows + vocab)
    z = ((torch.randn(rows, vocab, generator=g) * scale).bfloat16().float() / 0.8).cuda()  # bf16: ties
    z[0] = 1.25
    z[1, ::2] = float("-inf")
    want = sampling.filter_logits(z, top_k, top_p)
    assert torch.equal(filter_logits(z, top_k, top_p).view(torch.int32), want.view(torch.int32))
    assert not torch.equal(filter_logits(z, top_k, top_p * 0.9), want)
