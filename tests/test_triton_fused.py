"""The decode step's fused launches, each the same bits as what it replaces: SwiGLU reading
the halves of the gate_up output in place, the MoE combine gathering expert rows through `dest`, the
paged KV write of k and v in one launch — on the Triton backend (interpreter on CPU, tiny shapes) and
through the op API on the torch backend. GPU bits at real shapes: tests/gpu/test_engine_gpu.py."""

import os

import pytest
import torch
from conftest import same_bits

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from rlalign import kernels  # noqa: E402
from rlalign.kernels import triton as tb  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


@pytest.mark.parametrize("rows,inner", [(1, 24), (37, 24), (5, 1100)])
def test_swiglu_reads_the_halves_in_place_with_the_same_bits(rows, inner):
    h = _randn(rows, 2 * inner, seed=rows)
    gate, up = h.chunk(2, dim=-1)
    assert rows == 1 or tb.elementwise._row_views(gate, up)  # one row: the halves are contiguous already
    want = tb.swiglu(gate.contiguous(), up.contiguous())  # the copies the strided kernel saves
    got = tb.swiglu(gate, up)
    assert got.is_contiguous() and same_bits(got, want)
    # negative twin: the halves swapped are other values (the comparison can fail)
    assert not same_bits(tb.swiglu(up, gate), want)
    # with autograd: the flat kernel on copies, the same forward bits
    g2, u2 = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    assert same_bits(tb.swiglu(g2, u2), want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_combine_through_rows_equals_the_gathered_combine(backend):
    T, k, d = 9, 3, 40
    y_sorted = _randn(T * k, d, seed=1)
    w = torch.softmax(_randn(T, k, seed=2, dtype=torch.float32), -1)
    dest = torch.randperm(T * k, generator=torch.Generator().manual_seed(3)).to(DEV)
    with kernels.use(mode="deterministic", backend=backend):
        want = kernels.moe_combine(y_sorted.index_select(0, dest).view(T, k, d), w)
        got = kernels.moe_combine(y_sorted, w, rows=dest)
        assert same_bits(got, want)
        other = kernels.moe_combine(y_sorted, w, rows=dest.flip(0))  # negative twin: other rows, other sums
        assert not same_bits(other, want)
        # with autograd (the trainer): the gather then the combine, gradients flow to y and w
        ys, wg = y_sorted.clone().requires_grad_(), w.clone().requires_grad_()
        out = kernels.moe_combine(ys, wg, rows=dest)
        assert same_bits(out.detach(), want)
        out.float().sum().backward()
        assert ys.grad is not None and wg.grad is not None


def test_moe_combine_bits_do_not_depend_on_its_column_chunks(monkeypatch):
    """The Triton combine runs a program per (token, chunk of columns): a row of 1100 columns in chunks of
    512 (three programs, the last partial), 64, or one program per row (2048) gives the same bits; the
    slot order reversed differs (the comparison can fail)."""
    T, k, d = 24, 8, 1100
    y = _randn(T * k, d, seed=6)
    w = torch.softmax(_randn(T, k, seed=7, dtype=torch.float32), -1)
    dest = torch.randperm(T * k, generator=torch.Generator().manual_seed(8)).to(DEV)
    outs = []
    for block in (512, 64, 2048):
        monkeypatch.setattr(tb.moe, "_COMBINE_BLOCK", block)
        outs.append((tb.moe_combine(y.view(T, k, d), w), tb.moe_combine_rows(y, w, dest)))
    for a, b in outs[1:]:
        assert same_bits(a, outs[0][0]) and same_bits(b, outs[0][1])
    assert not same_bits(tb.moe_combine(y.view(T, k, d).flip(1), w.flip(1)), outs[0][0])


def test_moe_combine_rows_refuses_rows_that_do_not_fit():
    with pytest.raises(ValueError, match="rows"):
        tb.moe_combine_rows(_randn(6, 8), torch.ones(2, 3, device=DEV), torch.arange(5, device=DEV))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_write_equals_index_copy(backend):
    P, ps, hk, d, n = 5, 4, 2, 16, 7
    kp = torch.zeros(P, ps, hk, d, dtype=torch.bfloat16, device=DEV)
    vp = torch.zeros_like(kp)
    k, v = _randn(n, hk, d, seed=4), _randn(n, hk * d, seed=5).view(n, hk, d)
    slots = torch.tensor([19, 0, 3, 7, 8, 12, 2], device=DEV)
    want_k, want_v = kp.clone(), vp.clone()
    want_k.flatten(0, 1).index_copy_(0, slots, k)
    want_v.flatten(0, 1).index_copy_(0, slots, v)
    with kernels.use(mode="deterministic", backend=backend):
        kernels.paged_write(kp, vp, slots, k, v)
    assert same_bits(kp, want_k) and same_bits(vp, want_v)
    # then fewer rows (the next decode step): each call writes its own rows only (a launch plan per row count)
    k3, v3 = _randn(3, hk, d, seed=6), _randn(3, hk, d, seed=7)
    with kernels.use(mode="deterministic", backend=backend):
        kernels.paged_write(kp, vp, slots[:3], k3, v3)
    want_k.flatten(0, 1).index_copy_(0, slots[:3], k3)
    want_v.flatten(0, 1).index_copy_(0, slots[:3], v3)
    assert same_bits(kp, want_k) and same_bits(vp, want_v)
    # negative twin: another slot mapping writes other places
    kp2 = torch.zeros_like(kp)
    with kernels.use(mode="deterministic", backend=backend):
        kernels.paged_write(kp2, torch.zeros_like(vp), slots.roll(1), k, v)
    assert not same_bits(kp2, want_k)


def test_paged_write_refuses_pages_of_another_shape():
    kp = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="paged_write"):
        tb.paged_write(kp, kp.clone(), torch.arange(3, device=DEV), _randn(3, 4, 8), _randn(3, 4, 8))


def _qk_inputs(N, H, HK, D, dtype, seed=0):
    q, k, v = (_randn(N, h, D, seed=seed + i, dtype=dtype) * 3 for i, h in enumerate((H, HK, HK)))
    qw, kw = (1 + 0.1 * _randn(D, seed=seed + 3 + i, dtype=dtype) for i in range(2))
    cos, sin = (t[torch.arange(N) % 50].to(DEV) for t in kernels.rope_table(64, D, 10000.0))
    return q, k, v, qw, kw, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_norm_rope_is_the_norms_and_rotations_apart(dtype):
    """One launch (q's and k's rows normed per head, then rotated; with pages, k and v written into the KV
    cache) gives the bits of rmsnorm, rope and paged_write apart, for any number of rows; the rotation
    before the norm (the other order) differs: the comparison can fail."""
    N, H, HK, D, eps = 70, 4, 2, 16, 1e-6  # 280 q rows: two programs of the norm's 256-row tile
    q, k, v, qw, kw, cos, sin = _qk_inputs(N, H, HK, D, dtype)
    want_q, want_k = (tb.rope(tb.rmsnorm(x, w, eps), cos, sin) for x, w in ((q, qw), (k, kw)))
    got_q, got_k = tb.qk_norm_rope(q, k, qw, kw, eps, cos, sin)
    assert same_bits(got_q, want_q) and same_bits(got_k, want_k)
    for m in (1, 5, N - 1):  # a row's bits do not depend on the rows beside it
        sub_q, sub_k = tb.qk_norm_rope(q[:m], k[:m], qw, kw, eps, cos[:m], sin[:m])
        assert same_bits(sub_q, want_q[:m]) and same_bits(sub_k, want_k[:m])
    kp, vp = (torch.zeros(12, 8, HK, D, dtype=dtype, device=DEV) for _ in range(2))
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(1))[:N].to(DEV)
    want_kp, want_vp = kp.clone(), vp.clone()
    tb.paged_write(want_kp, want_vp, slots, want_k, v)
    pq, pk = tb.qk_norm_rope(q, k, qw, kw, eps, cos, sin, (kp, vp, slots, v))
    assert pk is None and same_bits(pq, want_q) and same_bits(kp, want_kp) and same_bits(vp, want_vp)
    other = tb.rmsnorm(tb.rope(q, cos, sin), qw, eps)  # negative twin: rotate, then norm
    assert not same_bits(other, want_q)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_qk_norm_rope_op_equals_the_ops_apart_with_and_without_autograd(backend):
    N, H, HK, D, eps = 9, 4, 2, 16, 1e-6
    q, k, v, qw, kw, cos, sin = _qk_inputs(N, H, HK, D, torch.bfloat16, seed=10)
    with kernels.use(mode="deterministic", backend=backend):
        want_q, want_k = (kernels.rope(kernels.rmsnorm(x, w, eps), cos, sin) for x, w in ((q, qw), (k, kw)))
        got_q, got_k = kernels.qk_norm_rope(q, k, qw, kw, eps, cos, sin)
        assert same_bits(got_q, want_q) and same_bits(got_k, want_k)
        kp, vp = (torch.zeros(3, 4, HK, D, dtype=torch.bfloat16, device=DEV) for _ in range(2))
        slots = torch.arange(N, device=DEV).flip(0)
        pq, pk = kernels.qk_norm_rope(q, k, qw, kw, eps, cos, sin, (kp, vp, slots, v))
        assert pk is None and same_bits(pq, want_q)
        assert same_bits(kp.flatten(0, 1)[slots], want_k) and same_bits(vp.flatten(0, 1)[slots], v)
        # with autograd (the trainer): the ops apart, the same forward bits, gradients reach the weights
        qg, wg = q.clone().requires_grad_(), qw.clone().requires_grad_()
        aq, _ = kernels.qk_norm_rope(qg, k, wg, kw, eps, cos, sin)
        assert same_bits(aq.detach(), want_q)
        aq.float().sum().backward()
        assert qg.grad is not None and wg.grad is not None
        assert not same_bits(kernels.qk_norm_rope(q, k, kw, qw, eps, cos, sin)[0], want_q)  # the weights swapped


def test_qk_norm_rope_refuses_shapes_that_do_not_fit():
    q, k, v, qw, kw, cos, sin = _qk_inputs(3, 4, 2, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="qk_norm_rope"):
        tb.qk_norm_rope(q, k[:, :, :8], qw, kw, 1e-6, cos, sin)
    kp = torch.zeros(2, 4, 3, 16, dtype=torch.bfloat16, device=DEV)  # 3 kv heads: not k's 2
    with pytest.raises(ValueError, match="pages"):
        tb.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, (kp, kp.clone(), torch.arange(3, device=DEV), v))
