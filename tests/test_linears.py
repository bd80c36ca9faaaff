"""kernels.linears on the Triton backend through TRITON_INTERPRET=1 (tiny shapes): several weights at one
input in one launch of the GEMM kernel, bit for bit the separate linears. GPU shapes: tests/gpu/test_linears_gpu.py."""

import os

import pytest
import torch
from conftest import same_bits

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from rlalign import kernels  # noqa: E402
from rlalign.kernels.triton import common, gemm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
K = 48  # three BLOCK_K chunks of the interpreter's config


@pytest.fixture
def launches(monkeypatch):
    """Counts the Triton launch plans called (one per kernel launch)."""
    calls = []
    run = common.Launch.__call__

    def counted(self, *tensors):
        calls.append(self.fn)
        return run(self, *tensors)

    monkeypatch.setattr(common.Launch, "__call__", counted)
    return calls


def _data(dtype, seed=0, m=37, ns=(40, 16, 24)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype).to(DEV)
    ws = [torch.randn(n, K, generator=g).to(dtype).to(DEV) for n in ns]
    bs = [torch.randn(n, generator=g).to(dtype).to(DEV) for n in ns]
    return x, ws, bs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linears_is_one_launch_with_the_bits_of_separate_linears(dtype, launches):
    # different N per weight, M and every N not multiples of the 32-wide tiles, biases on some, the
    # first weight not the lowest address (a negative offset would be one); outputs contiguous
    x, ws, bs = _data(dtype)
    ws = [ws[2], ws[0], ws[1]] if ws[2].data_ptr() > ws[0].data_ptr() else ws
    bs = [bs[0][: ws[0].shape[0]], None, bs[2][: ws[2].shape[0]]]
    with torch.no_grad():
        ref = [gemm.linear(x, w, b) for w, b in zip(ws, bs)]
        launches.clear()
        ys = gemm.linears(x, ws, bs)
    assert launches == [gemm._gemm_kernel]
    assert all(same_bits(y, r) for y, r in zip(ys, ref))
    assert all(y.is_contiguous() for y in ys)
    # through the op API, with batch dims; each output views as heads
    x3 = x[:36].reshape(4, 9, K)
    with torch.no_grad(), kernels.use(mode="deterministic", backend="triton"):
        y3 = kernels.linears(x3, ws)
    assert all(same_bits(y, r[:36].reshape(4, 9, -1)) for y, r in zip(y3, [gemm.linear(x, w) for w in ws]))
    assert y3[1].view(36, -1, 8).shape[1] == ws[1].shape[0] // 8


def test_linears_rows_are_batch_invariant_and_weights_may_share_storage(launches):
    # a row's bits ignore M (tails of the tile included); weights that are views of one fused tensor
    # (offsets inside one storage) and new weights at other addresses (the cached table is keyed by them)
    x, ws, _ = _data(torch.bfloat16, seed=1, m=70)
    fused = torch.cat(ws)
    parts = list(fused.split([w.shape[0] for w in ws]))
    with torch.no_grad():
        full = gemm.linears(x, parts, [None] * 3)
        for m in (1, 5, 32, 33, 64, 70):
            assert all(same_bits(y, f[:m]) for y, f in zip(gemm.linears(x[:m], parts, [None] * 3), full)), m
        assert all(same_bits(y, gemm.linear(x, w)) for y, w in zip(gemm.linears(x, ws, [None] * 3), ws))
        other = [w.flip(0).contiguous() for w in ws]
        assert all(same_bits(y, gemm.linear(x, w)) for y, w in zip(gemm.linears(x, other, [None] * 3), other))


def test_linears_under_autograd_falls_back_to_separate_linears_with_the_same_bits(launches):
    x, ws, bs = _data(torch.bfloat16, seed=2)
    with torch.no_grad():
        plain = gemm.linears(x, ws, bs)
    xx = x.clone().requires_grad_()
    wws = [w.clone().requires_grad_() for w in ws]
    launches.clear()
    ys = gemm.linears(xx, wws, bs)
    assert len(launches) == 3  # the loop (autograd records each linear)
    assert all(same_bits(y.detach(), p) for y, p in zip(ys, plain))
    sum((y.float() * (i + 1)).sum() for i, y in enumerate(ys)).backward()
    xr = x.clone().requires_grad_()
    wr = [w.clone().requires_grad_() for w in ws]
    sum((gemm.linear(xr, w, b).float() * (i + 1)).sum() for i, (w, b) in enumerate(zip(wr, bs))).backward()
    assert same_bits(xx.grad, xr.grad) and all(same_bits(a.grad, b.grad) for a, b in zip(wws, wr))
    # a weight in another dtype than x (converted per call): the loop too, the bits of linear
    w32 = [w.float() for w in ws]
    with torch.no_grad():
        assert all(same_bits(y, p) for y, p in zip(gemm.linears(x, w32, bs), plain))


def test_linears_negative_twin_other_k_order_differs():
    # the same products with K reduced in another order change bits: the comparison can fail
    x, ws, _ = _data(torch.float32, seed=3)
    with torch.no_grad():
        ys = gemm.linears(x, ws, [None] * 3)
        flipped = gemm.linears(x.flip(1), [w.flip(1) for w in ws], [None] * 3)
    assert not any(same_bits(a, b) for a, b in zip(ys, flipped))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(ys, flipped))


def test_linears_configs_keep_the_k_chunks_and_masked_rows_change_no_bit(monkeypatch):
    # the one launch's configs are linear's small-M rule over all its weights' tiles (BLOCK_K 128 at
    # these shapes) up to 256 rows, past them the main config where its tiles fill half the SMs; the
    # narrowest tiles that fit one wave;
    # MASK_M (rows past M masked, not read) is scheduling only
    x, ws, _ = _data(torch.bfloat16, seed=4, m=37)
    with torch.no_grad():
        ref = [gemm.linear(x, w) for w in ws]
        monkeypatch.setattr(gemm, "small_m_config", lambda *a: dict(gemm.INTERPRET_MATMUL, MASK_M=True))
        assert all(same_bits(y, r) for y, r in zip(gemm.linears(x, ws, [None] * 3), ref))
        assert all(same_bits(y, r[:5]) for y, r in zip(gemm.linears(x[:5], ws, [None] * 3), ref))
    monkeypatch.undo()
    monkeypatch.setattr(gemm, "INTERPRET", False)
    bf, moe, big = torch.bfloat16, [2048, 512, 512], [4096, 512, 512]
    for m in (1, 8, 32, 64, 100, 256):
        for ns in (moe, big):
            assert gemm.small_m_config(bf, m, ns, 132)["BLOCK_K"] == 128
    pick = {(m, ns[0]): gemm.small_m_config(bf, m, ns, 132) for m in (1, 64, 128, 256) for ns in (moe, big)}
    assert pick[1, 2048]["BLOCK_N"] == 32 and pick[1, 2048]["MASK_M"] and pick[1, 4096]["BLOCK_N"] == 64
    assert not pick[64, 2048].get("MASK_M") and pick[64, 2048]["BLOCK_N"] == 32 and pick[64, 4096]["BLOCK_N"] == 64
    assert pick[128, 2048]["BLOCK_N"] == 64 and pick[128, 4096]["BLOCK_N"] == 128
    assert pick[256, 2048]["BLOCK_N"] == 128 and pick[256, 4096]["BLOCK_N"] == 128  # nothing fits: the widest
    assert gemm.small_m_config(bf, 257, moe, 132)["BLOCK_N"] == 128  # main tiles under half a wave: the widest
    assert gemm.small_m_config(bf, 1024, moe, 132) == gemm.MATMUL_CONFIGS[bf]
    assert gemm.small_m_config(torch.float32, 8, moe, 132) == gemm.MATMUL_CONFIGS[torch.float32]
