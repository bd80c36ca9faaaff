"""GPU: the sampler's consumers (the Gumbel draw, the top-k/top-p filter, the logprob) read bf16 logits in
place and give the bits of the fp32 copy they read before (kernels.temper: torch's CUDA division by a
Python scalar is the same product by the fp32 inverse), NaN and inf rows included; the generator's step
and the trainer's scoring agree. Twins: the neighbouring fp32 factor gives other bits."""

import pytest
import torch
from conftest import triton_filtered

from rlalign import kernels
from rlalign.kernels.triton.logprob import log_softmax_gather, tempered_logprobs
from rlalign.kernels.triton.sampling import gumbel_argmax, gumbel_argmax_logprobs
from rlalign.rollout.sampling import sample_next
from rlalign.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _int_bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def _logits(rows, vocab, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 2.0).bfloat16()
    logits[0, 11] = float("nan")
    logits[1, ::3] = float("-inf")
    logits[2, 40] = float("inf")
    logits[3] *= 4
    return logits


@pytest.mark.parametrize("temperature", [0.8, 0.7, 1.3, 0.6])
def test_temper_is_torchs_cuda_division(temperature):
    x = torch.randn(512, 4096, device="cuda")
    s = kernels.inverse_temperature(temperature)
    assert torch.equal(_int_bits(kernels.temper(x, s)), _int_bits(x / temperature))
    up = torch.nextafter(torch.tensor(s), torch.tensor(2.0)).item()
    assert not torch.equal(_int_bits(kernels.temper(x, up)), _int_bits(x / temperature))  # twin


@pytest.mark.parametrize("rows,vocab", [(2048, 32000), (256, 151936), (64, 1000)])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_consumers_read_bf16_logits_as_their_fp32_copy(rows, vocab, temperature):
    logits = _logits(rows, vocab, rows + vocab)
    s = 1.0 if temperature == 1.0 else kernels.inverse_temperature(temperature)
    z = logits.float() / temperature if temperature != 1.0 else logits.float()
    ids = torch.arange(rows, device="cuda") * 7 + 3
    pos = torch.arange(rows, device="cuda") % 4096
    tok = gumbel_argmax(logits[1:], 2**63 + 11, ids[1:], pos[1:], s)  # the NaN row is an error to draw from
    assert torch.equal(tok, gumbel_argmax(z[1:], 2**63 + 11, ids[1:], pos[1:]))
    tok = torch.cat([tok[:1], tok])
    lp = tempered_logprobs(logits, s, tok)
    assert torch.equal(_int_bits(lp), _int_bits(log_softmax_gather(z, tok)))
    assert torch.isnan(lp[[0, 2]]).all() and not torch.isnan(lp[[1, *range(3, rows)]]).any()  # NaN, +inf rows
    tok1, lp1 = gumbel_argmax_logprobs(logits[1:], 2**63 + 11, ids[1:], pos[1:], s)  # the draw and its logprob
    assert torch.equal(tok1, tok[1:]) and torch.equal(_int_bits(lp1), _int_bits(lp[1:]))
    for top_k, top_p in ((0, 0.95), (50, 0.9), (20, 1.0)):
        got = triton_filtered(logits, top_k, top_p, s)
        assert torch.equal(_int_bits(got), _int_bits(triton_filtered(z, top_k, top_p)))
        assert torch.isnan(got[0, 11])
    if s != 1.0:  # twins: the next fp32 factor
        up = torch.nextafter(torch.tensor(s), torch.tensor(2.0)).item()
        assert not torch.equal(_int_bits(tempered_logprobs(logits, up, tok)), _int_bits(lp))
        assert not torch.equal(_int_bits(triton_filtered(logits, 0, 0.95, up)), _int_bits(triton_filtered(z, 0, 0.95)))


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8), dict(temperature=0.8, top_p=0.95),
                                dict(temperature=0.7, top_k=50, top_p=0.9)])
def test_generator_step_and_trainer_scoring_agree(kw):
    logits = _logits(512, 32000, 5)[4:]
    ids, pos = torch.arange(508, device="cuda") + 100, torch.arange(508, device="cuda") + 7
    params = SamplingParams(seed=9, max_new_tokens=4, **kw)
    with kernels.use(mode="deterministic", backend="triton"):
        tok, lp = sample_next(logits, params, ids, pos)
        rows = torch.arange(1, 508, 2, device="cuda")
        lk = params.logprob_kwargs()
        assert torch.equal(_int_bits(kernels.token_logprobs_rows(logits, rows, tok[rows], **lk)), _int_bits(lp[rows]))
        assert torch.equal(_int_bits(kernels.token_logprobs(logits, tok, **lk)), _int_bits(lp))
        twin = kernels.token_logprobs(logits, tok, **{**lk, "temperature": lk["temperature"] * 1.01})
        assert not torch.equal(_int_bits(twin), _int_bits(lp))


def test_negative_twin_the_draw_scores_another_seeds_tokens_otherwise():
    logits = _logits(256, 32000, 3)[3:]
    ids, pos = torch.arange(253, device="cuda"), torch.arange(253, device="cuda") + 1
    tok, lp = gumbel_argmax_logprobs(logits, 1, ids, pos, 1.25)
    tok2, lp2 = gumbel_argmax_logprobs(logits, 2, ids, pos, 1.25)
    assert (tok2 != tok).sum() > 100 and not torch.equal(_int_bits(lp2), _int_bits(lp))
    assert torch.equal(_int_bits(tempered_logprobs(logits, 1.25, tok2)), _int_bits(lp2))
