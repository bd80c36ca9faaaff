"""The interpreter bit tests do not touch the host's BLAS: under TRITON_INTERPRET the kernels take
their UPCAST branch (host_free_dot, exact fp64 products summed by numpy's add), and conftest makes
tl.dot itself raise there, so any kernel path that reached BLAS fails every test that runs it."""

import os

import pytest
import torch
from conftest import same_bits

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter's dot only", allow_module_level=True)

import triton.language as tl  # noqa: E402

from rlalign.kernels.triton.common import host_free_dot  # noqa: E402


@triton.jit
def _tile_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
              SPLIT: tl.constexpr, BLAS: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    if BLAS:
        c = tl.dot(a, b)
    elif SPLIT:  # the same products, K reduced as two halves: another order
        rh = tl.arange(0, H)
        a0 = tl.load(a_ptr + rm[:, None] * K + rh[None, :])
        a1 = tl.load(a_ptr + rm[:, None] * K + H + rh[None, :])
        b0 = tl.load(b_ptr + rh[:, None] * N + rn[None, :])
        b1 = tl.load(b_ptr + (H + rh)[:, None] * N + rn[None, :])
        c = host_free_dot(a0, b0) + host_free_dot(a1, b1)
    else:
        c = host_free_dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], c)


def _run(a, b, split=False, blas=False):
    c = torch.empty(a.shape[0], b.shape[1])
    _tile_dot[(1,)](a, b, c, a.shape[0], a.shape[1], b.shape[1], a.shape[1] // 2, split, blas)
    return c


def _data(m=32, k=64, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).bfloat16().float(), torch.randn(k, n, generator=g).bfloat16().float()


def test_a_rows_bits_do_not_depend_on_the_tile_around_it():
    a, b = _data()
    full = _run(a, b)
    assert same_bits(_run(a[5:21].contiguous(), b)[:, :], full[5:21])  # fewer rows
    assert same_bits(_run(a, b[:, :8].contiguous()), full[:, :8])  # fewer columns
    assert same_bits(_run(a[:1].contiguous(), b[:, :1].contiguous()), full[:1, :1])  # one element


def test_exact_products_in_fp64():
    a, b = _data()
    assert same_bits(_run(a, b), (a.double() @ b.double()).float())  # K = 64 bf16 products: the sum is exact


def test_negative_twin_another_k_order_moves_bits():
    a, b = _data(k=64, seed=3)
    a = a * torch.logspace(-6, 6, 64)  # products spread over 2**80: fp32 rounding of each half shows
    assert not same_bits(_run(a, b, split=True), _run(a, b))


def test_negative_twin_tl_dot_is_refused_under_the_interpreter():
    a, b = _data()
    with pytest.raises(Exception, match="host.s BLAS"):
        _run(a, b, blas=True)
