"""The trainer step's fused kernels on CPU through TRITON_INTERPRET=1 (tiny shapes), each against its
torch definition bit for bit, with negative twins: AdamW's update (kernels.adamw_)."""

import os

import pytest
import torch
from conftest import same_bits, tiny_model

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from rlalign import kernels  # noqa: E402
from rlalign.kernels import torch_deterministic as ref  # noqa: E402
from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.training.optimizer import adamw_scalars  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _adam_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (n,), generator=g).float() for _ in range(3)]
    return p.to(DEV), [x.to(DEV) for x in grads]


def _run(fn, p, grads, coefs, wd=0.01, out_dtype=None):
    p, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(p.shape, dtype=out_dtype, device=p.device) if out_dtype else None
    for t, (gr, coef) in enumerate(zip(grads, coefs), 1):
        fn(p, gr, m, v, adamw_scalars(0.01, (0.9, 0.99), 1e-8, wd, float(t), coef, p.device), out)
    return p, m, v, out


@pytest.mark.parametrize("n", [1, 77, 4099])
def test_adamw_triton_equals_the_torch_definition(n):
    """Three steps (clipped, unclipped, clipped), weight decay on: weights, both moments and the
    bf16 copy for the model are the definition's bits."""
    p, grads = _adam_inputs(n, n)
    coefs = [0.37, 1.0, 0.9]
    want = _run(ref.adamw_, p, grads, coefs, out_dtype=torch.bfloat16)
    got = _run(tb.adamw_, p, grads, coefs, out_dtype=torch.bfloat16)
    for i in range(4):
        assert same_bits(got[i], want[i]), (n, i)
    assert same_bits(want[3], want[0].to(torch.bfloat16))
    with kernels.use(backend="triton"):  # the op API reaches the same kernel
        api = _run(kernels.adamw_, p, grads, coefs)
    assert same_bits(api[0], want[0])


def test_adamw_negative_twins():
    """The definition is sharp: fusing v's update into one fma-like step (v + a2 g^2 computed in
    float64 and rounded once) or torch.optim.AdamW's own step gives other bits."""
    p, grads = _adam_inputs(4099, 5)
    want = _run(ref.adamw_, p, grads, [1.0, 1.0, 1.0], wd=0.0)

    def fused_v(p_, g, m, v, s, out):
        coef, decay, w1, beta2, a2, inv_bc2, eps, neg = s.tolist()
        m.add_((g - m).mul_(w1))
        v.copy_((v.double() * beta2 + a2 * g.double() * g.double()).float())
        p_.add_(torch.div(m, v.sqrt().mul_(inv_bc2).add_(eps)).mul_(neg))

    assert not same_bits(_run(fused_v, p, grads, [1.0, 1.0, 1.0], wd=0.0)[0], want[0])
    q = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([q], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, foreach=False, fused=False)
    for gr in grads:
        q.grad = gr.clone()
        opt.step()
    assert not same_bits(q.data, want[0])


def test_adamw_is_elementwise_slices_equal_the_whole():
    """Dense sharding cuts tensors into row units: the update of a slice is the slice of the update."""
    p, grads = _adam_inputs(4099, 6)
    whole = _run(tb.adamw_, p, grads, [0.5, 1.0, 1.0])
    cuts = [0, 7, 1000, 2048, 4099]
    parts = [_run(tb.adamw_, p[a:b].contiguous(), [x[a:b].contiguous() for x in grads], [0.5, 1.0, 1.0])
             for a, b in zip(cuts, cuts[1:])]
    for i in range(3):
        assert same_bits(torch.cat([q[i] for q in parts]), whole[i]), i


def test_sqrt_rn_is_the_ieee_root():
    """The reference's square root is correctly rounded (numpy's float32 sqrt is the hardware's IEEE
    instruction): over random magnitudes, zeros, infinities, NaN and subnormals."""
    import numpy as np

    g = torch.Generator().manual_seed(7)
    x = torch.rand(1 << 16, generator=g) * 10.0 ** torch.randint(-40, 38, (1 << 16,), generator=g).float()
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), 1e-45, 4.0, 2.0])])
    assert same_bits(ref.sqrt_rn(x), torch.from_numpy(np.sqrt(x.numpy())))
    assert ref.sqrt_rn(torch.tensor([float("nan"), -1.0])).isnan().all()


# --- the MoE rows: no gathered copies, no sorting index_put in the backward -----------------------
def _moe_case(T=37, k=3, E=5, D=48, seed=11):
    from rlalign.kernels import moe_dispatch as dispatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    order, dest, _ = dispatch(ids.reshape(-1), E)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.rand(T, k, generator=g).to(DEV)
    gy = torch.randn(T * k, D, generator=g).to(torch.bfloat16).to(DEV)
    gy[::7] = -0.0  # signed zeros in the incoming gradient
    return x, w, order, dest, gy


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_slot_rows_backward_sums_the_slots_in_fp32_in_slot_order(backend):
    """The backward is the combine's sum with unit weights (fp32, slot 0 first, one rounding) in
    either backend; on the CPU also the bits of the expand-copy-and-index_select backward it replaced."""
    x, _, order, dest, gy = _moe_case()
    T, D = x.shape
    k = order.numel() // T
    a = x.clone().requires_grad_()
    with kernels.use(mode="deterministic", backend=backend):
        kernels.moe_slot_rows(a, order, dest, k).backward(gy)
    b = x.clone().requires_grad_()
    b.unsqueeze(1).expand(T, k, D).reshape(T * k, D).index_select(0, order).backward(gy)
    assert same_bits(kernels.moe_slot_rows(x, order, dest, k), x.index_select(0, order // k))
    slots = gy.index_select(0, dest).view(T, k, D)
    ones = torch.ones(T, k, device=DEV)
    want = ref.moe_combine(slots, ones) if backend == "torch" else tb.moe_combine(slots, ones)
    assert same_bits(a.grad, want)
    if backend == "torch" and DEV == "cpu":  # torch's CPU sum over the slots (the interpreter truncates to bf16)
        assert same_bits(a.grad, b.grad)
    # twin: partial sums rounded to bf16 on the way
    twin = slots[:, 0]
    for j in range(1, k):
        twin = twin + slots[:, j]
    assert not same_bits(twin, a.grad)


def test_triton_combine_rows_equals_gather_then_combine_forward_and_backward():
    y0, w0, order, dest, _ = _moe_case(seed=12)
    T, k = w0.shape
    g = torch.Generator().manual_seed(13)
    y = torch.randn(T * k, y0.shape[1], generator=g).to(torch.bfloat16).to(DEV)
    go = torch.randn(T, y0.shape[1], generator=g).to(torch.bfloat16).to(DEV)
    go[3] = 0.0  # a zero row: its slots' gradients are zeros (of either sign before the index_put)
    outs = []
    for fused in (True, False):
        yy, ww = y.clone().requires_grad_(), w0.clone().requires_grad_()
        if fused:
            out = tb.moe_combine_rows(yy, ww, dest)
        else:
            out = tb.moe_combine(yy.index_select(0, dest).view(T, k, -1), ww)
        out.backward(go)
        outs.append((out, yy.grad, ww.grad))
    for a, b in zip(*outs):
        assert same_bits(a, b)
    with pytest.raises(ValueError, match="rows"):
        tb.moe_combine_rows(y[:-1].clone().requires_grad_(), w0, dest)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_slot_linear_equals_slot_rows_then_grouped_linear(backend):
    """The experts' first GEMM over the token rows read in place: output, dX and dW are the bits of the
    copied rows through grouped_linear (the Triton backend gathers inside the GEMM); twin: other rows."""
    from rlalign.kernels import moe_dispatch as dispatch

    x, _, order, dest, _ = _moe_case(T=45, k=3, E=5, D=32, seed=21)
    g = torch.Generator().manual_seed(22)
    w = (torch.randn(5, 48, 32, generator=g) * 0.1).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(45)]).to(DEV)
    order, dest, counts = dispatch(ids.reshape(-1), 5)
    go = torch.randn(order.numel(), 48, generator=g).to(torch.bfloat16).to(DEV)
    outs = []
    with kernels.use(mode="deterministic", backend=backend):
        for fused in (True, False):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            if fused:
                y = kernels.moe_slot_linear(xx, order, dest, 3, ww, counts)
            else:
                y = kernels.grouped_linear(kernels.moe_slot_rows(xx, order, dest, 3), ww, counts)
            y.backward(go)
            outs.append((y, xx.grad, ww.grad))
        for a, b in zip(*outs):
            assert same_bits(a, b)
        with torch.no_grad():
            assert same_bits(kernels.moe_slot_linear(x, order, dest, 3, w, counts), outs[0][0])
            assert not same_bits(kernels.moe_slot_linear(x, order.flip(0), dest, 3, w, counts), outs[0][0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swiglu_in_the_gate_up_gemm_equals_the_gemm_then_swiglu(backend):
    """moe_slot_swiglu / grouped_swiglu: without a gradient the Triton backend's one GEMM (SwiGLU in its epilogue,
    the last output tile ragged: I = 40), with one the two ops (outputs, dX, dW), in the bits of swiglu_halves
    over the plain GEMM, an inf and a NaN row included. Twin: the SwiGLU of the product before its rounding."""
    from rlalign.kernels import moe_dispatch as dispatch

    x, _, _, _, _ = _moe_case(T=45, k=3, E=5, D=32, seed=23)
    x[0, 3], x[1, 9] = float("inf"), float("nan")
    g = torch.Generator().manual_seed(24)
    w = (torch.randn(5, 80, 32, generator=g) * 0.3).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(45)]).to(DEV)
    order, dest, counts = dispatch(ids.reshape(-1), 5)
    xs = x.index_select(0, order // 3)
    go = torch.randn(order.numel(), 40, generator=g).to(torch.bfloat16).to(DEV)
    with kernels.use(mode="deterministic", backend=backend):
        with torch.no_grad():
            want = kernels.swiglu_halves(kernels.moe_slot_linear(x, order, dest, 3, w, counts))
            tok = order // 3  # want's rows in dispatch order: token 0's hold an inf, token 1's are NaN
            assert want[tok == 0].isinf().any() and want[tok == 1].isnan().all() and want[tok > 1].isfinite().all()
            assert same_bits(kernels.moe_slot_swiglu(x, order, dest, 3, w, counts), want)
            for c in (counts, counts.tolist()):
                assert same_bits(kernels.grouped_swiglu(xs, w, c), want)
        outs = []
        for fused in (True, False):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            if fused:
                y = kernels.moe_slot_swiglu(xx, order, dest, 3, ww, counts)
            else:
                y = kernels.swiglu_halves(kernels.moe_slot_linear(xx, order, dest, 3, ww, counts))
            y.backward(go)
            outs.append((y, xx.grad, ww.grad))
        for a, b in zip(*outs):
            assert same_bits(a, b)
        assert same_bits(outs[0][0], want)
    h = torch.cat([xs[r0:r0 + c].double() @ w[e].double().t() for e, (r0, c) in
                   enumerate(zip(torch.cumsum(counts, 0).tolist(), counts.tolist()))
                   for r0 in [r0 - c]]).float()
    unrounded = (torch.nn.functional.silu(h[:, :40]) * h[:, 40:]).to(torch.bfloat16)
    assert not same_bits(unrounded[tok > 1], want[tok > 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_equals_the_add_then_the_norm(dtype):
    """The residual add fused into the norm: s, y and the gradients of h, a and the weight are the bits
    of the add and the norm apart, with s used downstream (its gradient summed with the norm's) or not."""
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 where torch's add rounds to nearest")
    g = torch.Generator().manual_seed(31)
    h, a, gs, gy = (torch.randn(37, 96, generator=g).to(dtype).to(DEV) for _ in range(4))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEV)
    for use_s in (True, False):
        outs = []
        for fused in (True, False):
            hh, aa, ww = (t.clone().requires_grad_() for t in (h, a, w))
            if fused:
                s, y = tb.add_rmsnorm(hh, aa, ww, 1e-6)
            else:
                s = hh + aa
                y = tb.rmsnorm(s, ww, 1e-6)
            torch.autograd.backward([s, y] if use_s else [y], [gs, gy] if use_s else [gy])
            outs.append((s, y, hh.grad, aa.grad, ww.grad))
        for x, z in zip(*outs):
            assert same_bits(x, z)
    assert not same_bits(tb.rmsnorm(h, w, 1e-6), outs[0][1])  # twin: the norm of h alone


@pytest.mark.slow  # the tiny model forward + backward twice through the interpreter
def test_model_with_fused_residual_norms_equals_the_tapped_model():
    """Quiet taps: the residual adds run fused into the norms; a tap that records (here: an identity)
    runs them apart. Logits and every gradient keep their bits (fp32: the interpreter rounds exactly)."""
    model = tiny_model("float32").to(DEV)
    tokens = torch.randint(2, model.args.vocab_size, (23,), generator=torch.Generator().manual_seed(3)).to(DEV)
    outs = []
    with kernels.use(mode="deterministic", backend="triton"):
        for taps in (None, lambda name, x: x):
            model.taps = taps
            model.zero_grad(set_to_none=True)
            z = model(tokens, [0, 9, 23])
            z.float().square().sum().backward()
            outs.append([z] + [p.grad for p in model.parameters()])
    model.taps = None
    assert all(same_bits(x, z) for x, z in zip(*outs))


def test_add_f32_is_the_sum_of_the_fp32_conversions():
    g = torch.Generator().manual_seed(14)
    for da, db in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)):
        a = (torch.randn(5000, generator=g) * 10.0 ** torch.randint(-30, 30, (5000,), generator=g)).to(da).to(DEV)
        b = (torch.randn(5000, generator=g) * 10.0 ** torch.randint(-30, 30, (5000,), generator=g)).to(db).to(DEV)
        a[:3] = torch.tensor([-0.0, float("inf"), 1.0], dtype=da)
        b[:3] = torch.tensor([-0.0, -1.0, -1.0], dtype=db)
        got = tb.add_f32(a, b)
        assert got.dtype == torch.float32 and same_bits(got, a.float() + b.float()), (da, db)
        if da == db == torch.bfloat16:  # twin: the add in bf16, then converted
            assert not same_bits(got, (a + b).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_rows_equals_gather_then_token_logprobs(dtype):
    """The trainer's scoring of response rows: the same logprobs and the same logits gradient (zero
    outside the rows, +0 zeros) as indexing the rows and scoring them."""
    g = torch.Generator().manual_seed(15)
    N, V = 23, 300
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype).to(DEV)
    rows = torch.tensor([2, 3, 4, 9, 10, 11, 12, 20], device=DEV)
    toks = torch.randint(0, V, (rows.numel(),), generator=g).to(DEV)
    up = torch.randn(rows.numel(), generator=g).to(DEV)
    up[1] = -0.0  # a zero-weighted token: its row's gradient is signed zeros before the index_put
    got, want = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with kernels.use(backend="triton"):
        a = kernels.token_logprobs_rows(got, rows, toks)
        b = kernels.token_logprobs(want[rows], toks)
        (a * up).sum().backward()
        (b * up).sum().backward()
    assert same_bits(a, b)
    assert same_bits(got.grad, want.grad)
    assert got.grad[0].eq(0).all() and not same_bits(got.grad, want.grad.neg())  # twin: another sign
    with torch.no_grad(), kernels.use(backend="triton"):
        assert same_bits(kernels.token_logprobs_rows(logits, rows, toks), b.detach())


def test_swiglu_halves_equals_swiglu_of_the_chunks():
    g = torch.Generator().manual_seed(16)
    h = (torch.randn(19, 2 * 40, generator=g) * 3).to(torch.bfloat16).to(DEV)
    dy = torch.randn(19, 40, generator=g).to(torch.bfloat16).to(DEV)
    a, b = h.clone().requires_grad_(), h.clone().requires_grad_()
    ya = tb.swiglu_halves(a)
    yb = tb.swiglu(*b.chunk(2, dim=-1))
    ya.backward(dy)
    yb.backward(dy)
    assert same_bits(ya, yb) and same_bits(a.grad, b.grad)
    assert same_bits(tb.swiglu_halves(h), yb.detach())
    assert not same_bits(a.grad, torch.cat([b.grad[:, 40:], b.grad[:, :40]], 1))  # twin: halves swapped
    with pytest.raises(ValueError, match="2I"):
        tb.swiglu_halves(h[:, :-1])


def test_add_f32_three_terms_is_a_plus_the_sum_of_b_and_c():
    g = torch.Generator().manual_seed(17)
    a = (torch.randn(3000, generator=g) * 1e3).to(DEV)
    b, c = ((torch.randn(3000, generator=g) * 10.0 ** torch.randint(-8, 8, (3000,), generator=g)).to(torch.bfloat16)
            .to(DEV) for _ in range(2))
    got = tb.add_f32(a, b, c)
    assert same_bits(got, a + (b.float() + c.float()))
    assert not same_bits(got, (a + b.float()) + c.float())  # twin: the other grouping


def test_sum_of_squares_is_the_tree_of_squares():
    """The grad norm's sums: the Triton pass over the tree's first four levels + tree_sum equals
    tree_sum(x ** 2) bit for bit, rows or one vector, every length around the powers of two."""
    from rlalign.kernels import fixed_order as fo

    g = torch.Generator().manual_seed(18)
    for shape in ((1,), (9,), (16,), (17,), (31,), (33,), (4099,), (3, 40), (2, 1000), (5, 77)):
        x = (torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-4, 4, shape, generator=g)).to(DEV)
        want = fo.tree_sum(x**2, -1)
        assert same_bits(tb.sum_of_squares(x), want), shape
        assert same_bits(ref.sum_of_squares(x), want), shape
    y = torch.randn(4099, generator=g).to(DEV)
    seq = torch.zeros((), dtype=torch.float32)
    for v in (y**2).cpu():  # twin: the squares added one after the other
        seq = seq + v
    assert not same_bits(tb.sum_of_squares(y).cpu(), seq)
