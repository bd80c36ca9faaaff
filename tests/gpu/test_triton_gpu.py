"""GPU: the Triton kernels' bitwise promises at real sizes, with the pinned tiles (the small-M buckets
and the prefill/decode tile heights differ, so these cross their boundaries)."""

import math

import pytest
import torch
from conftest import same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_matmul_rows_identical_across_the_small_m_buckets():
    from rlalign.kernels import triton as tb

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1100, 1024, device="cuda", generator=g).bfloat16()
    w = torch.randn(2048, 1024, device="cuda", generator=g).bfloat16()
    full = tb.matmul(x, w.t())
    for m in list(range(1, 300)) + [511, 1024, 1100]:
        assert same_bits(tb.matmul(x[:m], w.t()), full[:m]), m
    assert not same_bits(tb.matmul(x.flip(1), w.flip(1).t()), full)  # negative twin: another K order


def test_grouped_rows_equal_matmul_rows_and_decode_equals_prefill():
    from rlalign.kernels import triton as tb

    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(8, 1536, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(700, 1024, device="cuda", generator=g).bfloat16()
    counts = [3, 0, 150, 1, 300, 46, 0, 200]
    y = tb.grouped_linear(x, w, counts)
    s = 0
    for e, c in enumerate(counts):
        assert same_bits(y[s : s + c], tb.matmul(x[s : s + c], w[e].t())), e
        s += c
    T, D = 300, 128
    q, k, v = (torch.randn(T, h, D, device="cuda", generator=g).bfloat16() for h in (16, 4, 4))
    pre = tb.attention_prefill(q, k, v, [0, T], 1 / math.sqrt(D))
    kc, vc = k[None].contiguous(), v[None].contiguous()
    for t in range(T):
        dec = tb.attention_decode(q[t : t + 1], kc, vc, torch.tensor([t + 1], device="cuda"), 1 / math.sqrt(D))
        assert same_bits(dec[0], pre[t]), t
