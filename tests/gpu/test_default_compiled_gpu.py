"""GPU: kernels.mode=default's compiled chains (torch_default.Compiled: torch.compile on CUDA) equal their
eager formulas to rounding, forward and backward, at bf16; inside a CUDA graph capture a warm one replays its
compiled kernels and a cold one runs eagerly (nothing compiles in a capture)."""

import pytest
import torch

from rlalign.kernels import torch_default as dflt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF = torch.bfloat16


def _close(a, b, tol=3e-2) -> bool:
    a, b = a.float(), b.float()
    return bool((a - b).abs().max() <= tol * b.abs().max().clamp_min(1e-30))


def _randn(*shape, seed=0, dtype=BF):
    return torch.randn(*shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").to(dtype)


def _cos_sin(N, D):
    from rlalign import kernels

    cos, sin = kernels.rope_table(4096, D, 1e6, device="cuda")
    pos = torch.arange(N, device="cuda") * 7 % 4096
    return cos[pos], sin[pos]


def _inputs(N=300, H=8, D=128, d=1024, inter=768):
    c, s = _cos_sin(N, D)
    return {  # name: (the Compiled op, its eager formula, the inputs with a gradient, the rest)
        "rope": (dflt.rope, dflt._rope, [_randn(N, H, D)], [c, s]),
        "norm_rope": (lambda x, w, c, s: dflt.norm_rope(x, w, 1e-6, c, s),
                      lambda x, w, c, s: dflt._norm_rope(x, w, 1e-6, c, s),
                      [_randn(N, H, D), _randn(D, seed=1)], [c, s]),
        "swiglu": (dflt.swiglu, dflt._swiglu, [_randn(N, inter), _randn(N, inter, seed=1)], []),
        "swiglu_halves": (dflt.swiglu_halves, dflt._swiglu_halves, [_randn(N, 2 * inter)], []),
        "add_rmsnorm": (lambda h, a, w: torch.cat(dflt.add_rmsnorm(h, a, w, 1e-6), -1),
                        lambda h, a, w: torch.cat(dflt._add_rmsnorm(h, a, w, 1e-6), -1),
                        [_randn(N, d), _randn(N, d, seed=1), _randn(d, seed=2)], []),
    }


@pytest.mark.parametrize("name", ["rope", "norm_rope", "swiglu", "swiglu_halves", "add_rmsnorm"])
def test_compiled_elementwise_chain_equals_eager_forward_and_backward(name):
    op, eager, xs, rest = _inputs()[name]
    outs = []
    for fn in (op, eager):
        leaves = [x.detach().requires_grad_() for x in xs]
        out = fn(*leaves, *rest)
        outs.append((out.detach(), *torch.autograd.grad(out, leaves, _randn(*out.shape, seed=9))))
    assert all(_close(a, b) for a, b in zip(*outs))
    assert not [k for k in dflt.BROKEN_PATHS if k.startswith("compile")]


def _dispatch(T=512, k=8, D=1024):
    y = _randn(T * k, D)
    w = torch.rand(T, k, device="cuda").softmax(-1)
    return y, w, torch.randperm(T * k, device="cuda"), _randn(T, D, seed=3)


def test_compiled_moe_combine_and_slot_rows_equal_the_eager_vendor_ops():
    y, w, rows, g = _dispatch()
    assert _close(dflt._combine_rows(y, w, rows), dflt._combine_rows_bmm(y, w, rows))
    got, want = dflt._combine_rows_grads(g, y, w, rows), dflt._combine_rows_grads_bmm(g, y, w, rows)
    assert all(_close(a, b) for a, b in zip(got, want))
    assert _close(dflt._slot_rows_grads(y, rows, 8), dflt._slot_rows_grad(y, rows, 8))
    assert dflt._combine_rows.compiled is not None and dflt._slot_rows_grads.compiled is not None
    assert not [k for k in dflt.BROKEN_PATHS if k.startswith("compile")]


def test_compiled_combine_replays_in_a_cuda_graph_and_a_cold_chain_captures_eagerly():
    y, w, rows, _ = _dispatch(T=64)
    dflt._combine_rows(y, w, rows)  # warm: compiled before the capture (the engine's warm-up step)
    cold = dflt.Compiled("cold swiglu", lambda h: dflt._swiglu_halves(h))
    h = _randn(64, 512)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_cold = dflt._combine_rows(y, w, rows), cold(h)
    assert cold.compiled is not None  # built, but nothing compiled inside the capture (stance eager_on_recompile)
    y.copy_(_randn(*y.shape, seed=5))
    h.copy_(_randn(*h.shape, seed=6))
    graph.replay()
    assert _close(out, dflt._combine_rows_bmm(y, w, rows)) and _close(out_cold, dflt._swiglu_halves(h))
    assert not [k for k in dflt.BROKEN_PATHS if k.startswith("compile")]
