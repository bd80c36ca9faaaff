"""kernels.mode=default's MoE gather / combine and elementwise chains (kernels/torch_default.py) on CPU: each
equals its plain formula, computed in float64, forward and gradient, in fp32 and bf16 (the eager formulas,
and the ones written for torch.compile that run on CUDA); a wrong formula falls outside the same tolerance
(the negative twins). The Compiled wrapper: CPU runs eager, a compile that raises is named in one logged line."""

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from rlalign import kernels
from rlalign.kernels import torch_default as dflt

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the reference's largest magnitude


def _close(out, ref, dtype) -> bool:
    out, ref = out.double(), ref.double()
    return bool((out - ref).abs().max() <= TOL[dtype] * ref.abs().max().clamp_min(1e-30))


def _dispatch(T=7, k=3, D=16, extra=2, seed=0):
    """y [T*k + extra, D], weights [T, k] fp32, rows [T*k] distinct (a shuffle), g [T, D]."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(T * k + extra, D, generator=gen)
    w = torch.rand(T, k, generator=gen)
    rows = torch.randperm(T * k + extra, generator=gen)[: T * k]
    return y, w, rows, torch.randn(T, D, generator=gen)


def _reference_combine(y, w, rows, g):
    """(out, dy, dw) of sum_j w[t, j] y[rows[t*k + j]] by float64 autograd."""
    y64, w64 = y.double().requires_grad_(), w.double().requires_grad_()
    out = (y64[rows].view(*w.shape, -1) * w64[..., None]).sum(1)
    out.backward(g.double())
    return out.detach(), y64.grad, w64.grad


FORMULAS = {"eager": (dflt._combine_rows_bmm, dflt._combine_rows_grads_bmm),
            "compiled": (dflt._combine_rows_sum, dflt._combine_rows_grads_sum)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("formula", list(FORMULAS))
def test_default_combine_rows_is_the_weighted_sum_forward_and_backward(dtype, formula):
    y, w, rows, g = _dispatch()
    fwd, bwd = FORMULAS[formula]
    ref, dy_ref, dw_ref = _reference_combine(y.to(dtype), w, rows, g.to(dtype))
    dy, dw = bwd(g.to(dtype), y.to(dtype), w, rows)
    assert _close(fwd(y.to(dtype), w, rows), ref, dtype)
    assert dy.dtype == dtype and dw.dtype == torch.float32 and _close(dy, dy_ref, dtype) and _close(dw, dw_ref, dtype)
    unread = torch.ones(y.shape[0], dtype=torch.bool)
    unread[rows] = False
    assert torch.equal(dy[unread], torch.zeros_like(dy[unread]))  # rows no slot reads: zero gradient


@pytest.mark.parametrize("formula", list(FORMULAS))
def test_default_combine_rows_of_no_tokens_is_empty(formula):  # an EP rank or micro-batch without rows
    y, w, rows, g = _dispatch(T=0, extra=3)
    fwd, bwd = FORMULAS[formula]
    dy, dw = bwd(g, y, w, rows)
    assert fwd(y, w, rows).shape == (0, 16) and torch.equal(dy, torch.zeros_like(y)) and dw.shape == (0, 3)


def test_default_combine_rows_negative_twin_slots_in_another_order_differ():
    y, w, rows, g = _dispatch()
    ref, dy_ref, _ = _reference_combine(y, w, rows, g)
    assert not _close(dflt._combine_rows_bmm(y, w.flip(1), rows), ref, torch.float32)
    assert not _close(dflt._combine_rows_grads_sum(g, y, w.flip(1), rows)[0], dy_ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_moe_combine_dispatches_to_the_rows_combine_with_its_autograd(dtype):
    y, w, rows, g = _dispatch(seed=1)
    ref, dy_ref, dw_ref = _reference_combine(y.to(dtype), w, rows, g.to(dtype))
    yq, wq = y.to(dtype).requires_grad_(), w.clone().requires_grad_()
    with kernels.use(mode="default"):
        out = kernels.moe_combine(yq, wq, rows=rows)
        out.backward(g.to(dtype))
        plain = kernels.moe_combine(yq.detach()[rows].view(*w.shape, -1), w)
    assert _close(out, ref, dtype) and _close(yq.grad, dy_ref, dtype) and _close(wq.grad, dw_ref, dtype)
    assert _close(plain, ref, dtype)
    with kernels.use(mode="default"):  # negative twin: the slots' weights swapped
        assert not _close(kernels.moe_combine(yq.detach(), w.flip(1), rows=rows), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_slot_rows_gathers_and_sums_each_tokens_slot_gradients(dtype):
    T, k, D = 6, 3, 8
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 4, (T * k,), generator=gen)
    order, dest, _ = kernels.moe_dispatch(ids, 4)
    x = torch.randn(T, D, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(T * k, D, generator=gen).to(dtype)
    with kernels.use(mode="default"):
        rows = kernels.moe_slot_rows(x, order, dest, k)
    rows.backward(g)
    assert torch.equal(rows.detach(), x.detach()[order // k])  # a gather: the rows' bits
    ref = torch.zeros(T, D, dtype=torch.float64).index_add_(0, order // k, g.double())
    assert _close(x.grad, ref, dtype)
    assert not _close(dflt._slot_rows_grad(g, order, k), ref, dtype)  # negative twin: the inverse's index


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def _ref_rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ref_rope(x, c, s):
    return x * c[:, None] + _rotate_half(x) * s[:, None]


def _cos_sin(N, D):
    cos, sin = kernels.rope_table(64, D, 10000.0)
    pos = torch.arange(N) * 5 % 64
    return cos[pos], sin[pos]


OPS = {  # name: (default op, float64 reference, input shapes; cos / sin of N rows appended where needed)
    "rope": (dflt.rope, _ref_rope, [(5, 3, 8)]),
    "norm_rope": (lambda x, w, c, s: dflt.norm_rope(x, w, 1e-6, c, s),
                  lambda x, w, c, s: _ref_rope(_ref_rmsnorm(x, w, 1e-6), c, s), [(5, 3, 8), (8,)]),
    "swiglu": (dflt.swiglu, lambda a, b: a * torch.sigmoid(a) * b, [(6, 10), (6, 10)]),
    "swiglu_halves": (dflt.swiglu_halves, lambda h: h[:, :10] * torch.sigmoid(h[:, :10]) * h[:, 10:], [(6, 20)]),
    "add_rmsnorm": (lambda h, a, w: torch.cat(dflt.add_rmsnorm(h, a, w, 1e-6), -1),
                    lambda h, a, w: torch.cat([h + a, _ref_rmsnorm(h + a, w, 1e-6)], -1), [(6, 12), (6, 12), (12,)]),
}


def _op_inputs(name, dtype, seed=3):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in OPS[name][2]]
    cs = list(_cos_sin(5, 8)) if "rope" in name else []
    return xs, cs


def _op_and_grads(fn, xs, cs, g):
    out = fn(*xs, *cs)
    return (out.detach(), *torch.autograd.grad(out, xs, g.to(out.dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPS))
def test_default_elementwise_op_is_its_formula_forward_and_backward(name, dtype):
    fn, ref_fn, _ = OPS[name]
    xs, cs = _op_inputs(name, dtype)
    ref64 = [x.detach().double().requires_grad_() for x in xs]
    out_ref = ref_fn(*ref64, *(c.double() for c in cs))
    g = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = _op_and_grads(fn, xs, cs, g)
    want = (out_ref.detach(), *torch.autograd.grad(out_ref, ref64, g))
    assert got[0].dtype == dtype and all(_close(a, b, dtype) for a, b in zip(got, want))
    wrong = _op_and_grads(ref_fn, [x.detach().double().requires_grad_() for x in xs],
                          [c.double() for c in cs], -g)  # negative twin: the gradient of -g (and not the output)
    assert not all(_close(a, b, dtype) for a, b in zip(wrong[1:], want[1:]))


def test_default_rope_negative_twin_the_interleaved_convention_differs():
    xs, (c, s) = _op_inputs("rope", torch.float32)
    x = xs[0].detach()
    interleaved = torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
    assert not _close(dflt.rope(x, c, s), x * c[:, None] + interleaved * s[:, None], torch.float32)


def test_default_model_fused_ops_match_the_deterministic_model():
    """The default mode's whole MoE model (its gather, combine, fused norms and rotations), fp32: the
    deterministic model's logits and gradients to rounding; not its bits (the negative twin)."""
    model = tiny_model("float32")
    tokens, cu = torch.randint(0, model.args.vocab_size, (13,), generator=torch.Generator().manual_seed(5)), [0, 6, 13]

    def run(mode):
        model.zero_grad()
        with kernels.use(mode=mode, backend="torch"):
            logits = model(tokens, cu)
            logits.pow(2).mean().backward()
        return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    det, dfl = run("deterministic"), run("default")
    assert len(det) == len(dfl) and all(_close(a, b, torch.float32) for a, b in zip(dfl, det))
    assert not all(torch.equal(a, b) for a, b in zip(dfl, det))


class _OnCuda:
    """A value whose is_cuda is True: the Compiled wrapper's CUDA branch without a GPU."""

    is_cuda = True

    def __init__(self, v):
        self.v = v


def test_compiled_runs_eager_on_cpu_and_names_a_failed_compile_once(monkeypatch, caplog):
    op = dflt.Compiled("double", lambda a: a.v * 2 if isinstance(a, _OnCuda) else a * 2)
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0)) and op.compiled is None  # CPU: no compile

    def broken(fn, dynamic):
        def run(*args):
            raise RuntimeError("no backend here\nmore")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(dflt, "BROKEN_PATHS", {})
    with caplog.at_level(logging.WARNING, logger="rlalign.kernels"):
        assert op(_OnCuda(3)) == 6 and op(_OnCuda(4)) == 8
    lines = [r.getMessage() for r in caplog.records if "double" in r.getMessage()]
    assert lines == ["kernels.mode=default: double: torch.compile failed (RuntimeError: no backend here); "
                     "running eager torch ops instead"]


def test_compiled_negative_twin_a_working_compile_runs_the_compiled_function(monkeypatch, caplog):
    op = dflt.Compiled("triple", lambda a: a.v * 3)
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic: (lambda a: ("compiled", fn(a))))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with caplog.at_level(logging.WARNING, logger="rlalign.kernels"):
        assert op(_OnCuda(2)) == ("compiled", 6)
    assert not [r for r in caplog.records if "triple" in r.getMessage()]


def test_swiglu_halves_default_equals_silu_of_the_gate_times_the_up_half():
    h = torch.randn(4, 12, generator=torch.Generator().manual_seed(6))
    with kernels.use(mode="default"):
        out = kernels.swiglu_halves(h)
    assert torch.equal(out, F.silu(h[:, :6]) * h[:, 6:])
    assert not torch.equal(out, F.silu(h[:, 6:]) * h[:, :6])
