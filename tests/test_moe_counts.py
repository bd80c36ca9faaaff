"""MoE expert counts kept on the device: the grouped GEMM over a tensor of group sizes (its problem
table built in the kernel, nothing read back on the host) gives every row the bits of the host-list
path, and the MoE layer's output and gradients are unchanged bit for bit. CPU: the Triton
interpreter; on CUDA the no-sync claim itself: tests/gpu/test_moe_sync_free.py."""

import os

import pytest
import torch
from conftest import same_bits, tiny_model

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from rlalign import kernels  # noqa: E402
from rlalign.kernels import torch_default, torch_deterministic  # noqa: E402
from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.model.model import MoE  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SPLITS = {
    "mixed with empty experts": [3, 0, 20, 7, 0, 0],
    "all rows in the first expert": [30, 0, 0, 0, 0, 0],
    "all rows in the middle expert": [0, 0, 30, 0, 0, 0],
    "all rows in the last expert": [0, 0, 0, 0, 0, 30],
    "even": [5] * 6,
}


def _data(dtype, rows=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 48, generator=g).to(dtype).to(DEV)
    w = (torch.randn(6, 40, 48, generator=g) * 0.1).to(dtype).to(DEV)
    return x, w


def _run(x, w, counts, gy):
    """Output and (dx, dw) of grouped_linear with these counts."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = tb.grouped_linear(xr, wr, counts)
    return (y, *torch.autograd.grad(y, (xr, wr), gy))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", list(SPLITS))
def test_device_counts_give_the_host_list_bits_forward_and_backward(dtype, split):
    counts = SPLITS[split]
    x, w = _data(dtype)
    gy = torch.randn(30, 40, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEV)
    host = _run(x, w, counts, gy)
    dev = _run(x, w, torch.tensor(counts, device=DEV), gy)
    for name, a, b in zip(("y", "dx", "dw"), host, dev):
        assert same_bits(a, b), name
    s = 0
    for e, c in enumerate(counts):  # and every row is its own expert's matmul row
        assert same_bits(dev[0][s : s + c], tb.matmul(x[s : s + c], w[e].t())), e
        s += c
    assert all(not dev[2][e].any() for e, c in enumerate(counts) if c == 0)  # empty experts: dW = 0


def test_device_counts_zero_rows():
    x, w = _data(torch.float32, rows=0)
    counts = torch.zeros(6, dtype=torch.long, device=DEV)
    y, dx, dw = _run(x, w, counts, torch.zeros(0, 40, device=DEV))
    assert y.shape == (0, 40) and dx.shape == (0, 48)
    assert dw.shape == w.shape and not dw.any()


def test_negative_twin_other_counts_change_the_rows():
    # the equality above can fail: the same rows under another split (same total) change bits
    x, w = _data(torch.float32)
    right = tb.grouped_linear(x, w, torch.tensor([3, 0, 20, 7, 0, 0], device=DEV))
    moved = tb.grouped_linear(x, w, torch.tensor([3, 20, 0, 7, 0, 0], device=DEV))
    assert not same_bits(right, moved)
    assert same_bits(right[:3], moved[:3]) and same_bits(right[23:], moved[23:])  # the untouched groups


def test_counts_past_the_rows_are_clamped_not_written_out_of_bounds():
    # a wrong tensor (sum 40 > 30 rows) cannot write past the output: groups are clamped to the rows
    # (the group that runs past the rows is cut at them, not moved back onto the groups before it)
    x, w = _data(torch.float32)
    y = tb.grouped_linear(x, w, torch.tensor([3, 0, 20, 17, 0, 0], device=DEV))
    assert same_bits(y, tb.grouped_linear(x, w, [3, 0, 20, 7, 0, 0]))
    y = tb.grouped_linear(x, w, torch.tensor([30, 0, 0, 25, 0, 0], device=DEV))
    assert same_bits(y, tb.grouped_linear(x, w, [30, 0, 0, 0, 0, 0]))


def test_bad_counts_tensor_is_refused():
    x, w = _data(torch.float32)
    with pytest.raises(ValueError, match="grouped_linear: .* counts \\(tensor"):
        tb.grouped_linear(x, w, torch.tensor([30, 0, 0], device=DEV))
    with pytest.raises(ValueError, match="grouped_linear: .* counts \\(tensor"):
        tb.grouped_linear(x, w, torch.full((6,), 5.0, device=DEV))


@pytest.mark.parametrize("impl", [torch_deterministic, torch_default])
def test_torch_backends_take_a_counts_tensor(impl):
    x, w = _data(torch.float32)
    counts = [3, 0, 20, 7, 0, 0]
    assert same_bits(impl.grouped_linear(x, w, torch.tensor(counts)), impl.grouped_linear(x, w, counts))


def _moe_forward_with_host_counts(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE forward with host counts (bincount + tolist), the token rows copied, the combine gathered."""
    T, d = x.shape
    k = moe.top_k
    weights, ids = kernels.moe_route(kernels.linear(x, moe.gate.weight), k, moe.norm_topk_prob)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    dest = torch.argsort(order)
    y_sorted = moe.experts(kernels.moe_slot_rows(x, order, dest, k), counts)  # the slots' rows, copied
    y = y_sorted.index_select(0, dest).view(T, k, d)
    return kernels.moe_combine(y, weights)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_layer_output_and_gradients_unchanged(backend):
    model = tiny_model().to(DEV)
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(13, model.args.hidden_size, generator=g).bfloat16().to(DEV)
    gy = torch.randn(13, model.args.hidden_size, generator=g).bfloat16().to(DEV)
    params = [moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    outs = []
    with kernels.use(backend=backend):
        for fwd in (moe.forward, lambda t: _moe_forward_with_host_counts(moe, t)):
            xr = x.clone().requires_grad_()
            y = fwd(xr)
            outs.append((y, *torch.autograd.grad(y, [xr, *params], gy)))
    assert all(same_bits(a, b) for a, b in zip(*outs))
    assert not same_bits(outs[0][0], outs[0][0].flip(0))  # the rows differ: the comparison can fail


def test_dispatch_is_the_stable_sort_by_expert_and_its_inverse():
    """The counting sort of the MoE layer (no comparison sort, no host sync) puts rows where a stable
    sort by expert does; its negative twin: an unstable order of the same ids is a different
    permutation, which the comparison sees."""
    from rlalign.kernels import moe_dispatch as dispatch

    g = torch.Generator().manual_seed(0)
    for n, e in ((0, 8), (1, 8), (7, 4), (2048, 64), (513, 128), (300, 3)):
        flat = torch.randint(0, e, (n,), generator=g).to(DEV)
        order, dest, counts = dispatch(flat, e)
        ref = torch.sort(flat, stable=True).indices
        assert torch.equal(order, ref) and torch.equal(dest, torch.argsort(ref))
        assert torch.equal(counts, torch.bincount(flat, minlength=e))
    flat = torch.zeros(64, dtype=torch.long, device=DEV)  # one expert: every order sorts these ids,
    unstable = torch.arange(63, -1, -1, device=DEV)  # e.g. last row first (a valid but unstable sort)
    assert torch.equal(flat[unstable], flat.sort().values) and not torch.equal(dispatch(flat, 4)[0], unstable)


def test_moe_layer_inference_rows_equal_the_training_rows():
    """Without autograd the layer gathers token rows directly (no [T*k, d] copy): the same bits."""
    model = tiny_model().to(DEV)
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(13, model.args.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEV)
    with torch.no_grad():
        a = moe(x)
    b = moe(x.clone().requires_grad_())
    assert same_bits(a, b.detach())
