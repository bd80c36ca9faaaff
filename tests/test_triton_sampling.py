"""The fused Triton Gumbel-max draw (kernels/triton/sampling.py) is the torch formulation's draw,
bit for bit: the same tokens as first_argmax(z + gumbel(seed, ids, positions)) for every row; its
top-k/top-p filter keeps the torch threshold search's set with the same bits
(tests/test_sampling_filter.py checks that set against a full sort). CPU:
the Triton interpreter (its numpy arithmetic rounds every op like torch's CPU kernels); on CUDA:
tests/gpu/test_sampling_gpu.py (the same checks plus the distribution test)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from conftest import triton_filtered  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.kernels import sampling  # noqa: E402
from rlalign.kernels.triton.sampling import gumbel_argmax  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows, vocab, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, vocab, generator=g) * scale).to(DEV)
    ids = torch.randint(0, 2**40, (rows,), generator=g).to(DEV)
    pos = torch.randint(0, 4096, (rows,), generator=g).to(DEV)
    return z, ids, pos


def _torch_draw(z, seed, ids, pos):
    return sampling.first_argmax(z + sampling.gumbel(seed, ids, pos, z.shape[-1]))


@pytest.mark.parametrize("rows,vocab,scale,seed", [(48, 2500, 0.01, 12345), (6, 64, 1.0, 2**63 + 5),
                                                   (3, 1024, 3.0, 0), (5, 1025, 0.5, 2**64 - 1)])
def test_fused_draw_equals_the_torch_draw(rows, vocab, scale, seed):
    """Small logit scales make the noise decide (any noise bit off would move some argmax);
    vocabularies one block, one block + 1, and under a block; seeds past 2**63."""
    z, ids, pos = _case(rows, vocab, scale)
    z[0, : vocab // 2] = float("-inf")  # filtered tokens (top-k / top-p) are never drawn
    assert torch.equal(gumbel_argmax(z, seed, ids, pos), _torch_draw(z, seed, ids, pos))


def test_kernels_sample_uses_it_under_the_triton_backend_with_the_same_tokens():
    z, ids, pos = _case(16, 700, 0.1)
    with kernels.use(backend="torch"):
        ref = kernels.sample(z, 7, ids, pos, temperature=0.8, top_k=50)
    with kernels.use(backend="triton"):
        assert torch.equal(kernels.sample(z, 7, ids, pos, temperature=0.8, top_k=50), ref)


def _filter_rows():
    """bf16-valued rows (ties) at two scales, an all-equal row, -inf entries, a tail past the mass floor."""
    g = torch.Generator().manual_seed(3)
    z = torch.cat([torch.randn(3, 300, generator=g) * 0.3, torch.randn(2, 300, generator=g) * 3.0]).bfloat16().float()
    z[0] = 0.75
    z[1, ::2] = float("-inf")
    z[3] = torch.linspace(-60.0, 3.0, 300)
    return z.to(DEV)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (7, 0.8), (1, 1.0), (0, 1e-9), (40, 0.999999)])
def test_the_filter_kernel_keeps_the_torch_searchs_set(top_k, top_p):
    """A vocabulary of a few FILTER_BLOCK chunks, so the levels compact across chunks; kernels.tempered
    takes the kernel under the Triton backend."""
    z = _filter_rows()
    want = sampling.filter_logits(z, top_k, top_p)
    with kernels.use(backend="triton"):
        got = kernels.tempered(z, 1.0, top_k, top_p).values()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isfinite(want).sum() < torch.isfinite(z).sum()  # something was filtered


def test_negative_twin_the_filter_at_another_k_or_p_keeps_another_set():
    z = _filter_rows()
    want = sampling.filter_logits(z, 7, 0.8)
    assert not torch.equal(triton_filtered(z, 7, 0.5), want)


def test_negative_twin_another_seed_or_position_draws_other_tokens():
    z, ids, pos = _case(48, 2500, 0.01)
    ref = gumbel_argmax(z, 1, ids, pos)
    assert (gumbel_argmax(z, 2, ids, pos) != ref).sum() > 40
    assert (gumbel_argmax(z, 1, ids, pos + 1) != ref).sum() > 40


@pytest.mark.skipif(DEV == "cuda", reason="a device-side assert would end the CUDA context")
def test_a_row_without_a_finite_maximum_is_an_error():
    z, ids, pos = _case(3, 100, 1.0)
    nan_row, inf_row = z.clone(), z.clone()
    nan_row[1, 7] = float("nan")  # one NaN spoils the row
    inf_row[1] = float("-inf")  # nothing kept
    for y in (nan_row, inf_row):
        with pytest.raises(RuntimeError, match="no finite maximum"):
            gumbel_argmax(y, 0, ids, pos)
    gumbel_argmax(z, 0, ids, pos)  # twin: the clean rows draw


def _bf16_logits(temperature):
    """bf16 logits [6, 1500] (a vocabulary past one BLOCK): a NaN entry (row 0), -inf entries (row 1),
    +inf (row 2), a peaked row (3), flat ones; the fp32 factor of the temperature."""
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, 1500, generator=g) * torch.tensor([1.0, 1.0, 1.0, 6.0, 0.3, 2.0])[:, None]).bfloat16()
    logits[0, 11] = float("nan")
    logits[1, ::3] = float("-inf")
    logits[2, 40] = float("inf")
    scale = 1.0 if temperature == 1.0 else kernels.inverse_temperature(temperature)
    return logits.to(DEV), scale


def _int_bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


@pytest.mark.parametrize("temperature", [1.0, 0.8, 1.3])
def test_the_consumers_read_bf16_logits_as_their_fp32_copy(temperature):
    """The Gumbel draw, the filter and the logprob on bf16 logits (upcast and scaled in registers) give
    the bits they give on the fp32 copy kernels.temper(logits, scale): NaN and inf rows included (the
    draw on the rows it accepts)."""
    from rlalign.kernels.triton.logprob import log_softmax_gather, tempered_logprobs

    logits, scale = _bf16_logits(temperature)
    z = kernels.temper(logits, scale)
    ids, pos = torch.arange(6, device=DEV) * 5 + 1, torch.arange(6, device=DEV) + 9
    tok = gumbel_argmax(logits[1:], 2**63 + 5, ids[1:], pos[1:], scale)
    assert torch.equal(tok, gumbel_argmax(z[1:], 2**63 + 5, ids[1:], pos[1:]))
    tok = torch.cat([tok[:1], tok])
    assert torch.equal(_int_bits(tempered_logprobs(logits, scale, tok)), _int_bits(log_softmax_gather(z, tok)))
    for top_k, top_p in ((0, 0.9), (7, 0.8), (40, 1.0)):
        got = triton_filtered(logits, top_k, top_p, scale)
        assert torch.equal(_int_bits(got), _int_bits(triton_filtered(z, top_k, top_p)))
        assert torch.isnan(got[0, 11]) and torch.isfinite(got[3]).sum() < 1500


def test_negative_twin_the_neighbouring_factor_gives_other_bits():
    """The in-register product is the one computed: the next fp32 factor above 1 / 0.8 moves the logprobs
    and the filtered values."""
    from rlalign.kernels.triton.logprob import tempered_logprobs

    logits, scale = _bf16_logits(0.8)
    up = torch.nextafter(torch.tensor(scale), torch.tensor(2.0)).item()
    tok = torch.zeros(6, dtype=torch.long, device=DEV)
    lp = tempered_logprobs(logits, scale, tok)
    assert not torch.equal(_int_bits(tempered_logprobs(logits, up, tok)), _int_bits(lp))
    kept = triton_filtered(logits, 0, 0.9, scale)
    assert not torch.equal(_int_bits(triton_filtered(logits, 0, 0.9, up)), _int_bits(kept))


@pytest.mark.parametrize("temperature,vocab", [(1.0, 1500), (0.8, 1500), (1.3, 700)])
def test_the_draw_with_its_logprob_is_the_draw_then_the_logprob(temperature, vocab):
    """gumbel_argmax_logprobs: the tokens of gumbel_argmax and the bits of tempered_logprobs at them, in one
    launch (a vocabulary under a block: the logprob kernel's smaller block); the twin: another seed's
    tokens score other logprobs."""
    from rlalign.kernels.triton.logprob import tempered_logprobs
    from rlalign.kernels.triton.sampling import gumbel_argmax_logprobs

    logits, scale = _bf16_logits(temperature)
    logits = logits[1:, :vocab]
    ids, pos = torch.arange(5, device=DEV) * 3 + 2, torch.arange(5, device=DEV) + 40
    tok, lp = gumbel_argmax_logprobs(logits, 2**63 + 5, ids, pos, scale)
    assert torch.equal(tok, gumbel_argmax(logits, 2**63 + 5, ids, pos, scale))
    assert torch.equal(_int_bits(lp), _int_bits(tempered_logprobs(logits, scale, tok)))
    tok2, lp2 = gumbel_argmax_logprobs(logits, 6, ids, pos, scale)
    assert not torch.equal(tok2, tok) and not torch.equal(_int_bits(lp2), _int_bits(lp))
