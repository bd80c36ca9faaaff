"""GPU: the single-rank (EP 1) MoE forward on the Triton backend makes no host sync (expert counts
and the grouped GEMM's problem table stay on the device), so it captures in a CUDA graph; its bits
equal the old host-counts path's, forward and backward."""

import pytest
import torch
from conftest import same_bits, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _layer_and_input(T=96, seed=0):
    from rlalign.model.model import MoE

    model = tiny_model(hidden_size=1024, moe_intermediate_size=512, num_experts=16, top_k=4, num_layers=1,
                       num_heads=8, num_kv_heads=2, head_dim=128).to("cuda")
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    g = torch.Generator(device="cuda").manual_seed(seed)
    return moe, torch.randn(T, 1024, device="cuda", generator=g).bfloat16()


def test_ep1_moe_forward_makes_no_host_sync_and_keeps_the_bits():
    from test_moe_counts import _moe_forward_with_host_counts

    from rlalign import kernels

    moe, x = _layer_and_input()
    with kernels.use(backend="triton"), torch.no_grad():
        host = _moe_forward_with_host_counts(moe, x)
        moe(x)  # compile outside the checked region
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # negative twin: the detector does fire on the old path (bincount + tolist)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):
                _moe_forward_with_host_counts(moe, x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert same_bits(y, host)


def test_ep1_moe_forward_replays_from_a_cuda_graph_bitwise():
    from rlalign import kernels

    moe, x = _layer_and_input(T=64, seed=1)
    static_x = x.clone()
    with kernels.use(backend="triton"), torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static_x)  # warm-up (compiles, fills the plan caches) off the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        for seed in (2, 3):  # other tokens, other routing, same shapes
            new = torch.randn(64, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
            static_x.copy_(new.bfloat16())
            graph.replay()
            assert same_bits(static_y, moe(static_x)), seed


def test_moe_backward_with_device_counts_equals_host_counts():
    from test_moe_counts import _moe_forward_with_host_counts

    from rlalign import kernels

    moe, x = _layer_and_input(T=200, seed=4)
    gy = torch.randn_like(x)
    params = [moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj]
    outs = []
    with kernels.use(backend="triton"):
        for fwd in (moe.forward, lambda t: _moe_forward_with_host_counts(moe, t)):
            xr = x.clone().requires_grad_()
            y = fwd(xr)
            outs.append((y, *torch.autograd.grad(y, [xr, *params], gy)))
    assert all(same_bits(a, b) for a, b in zip(*outs))
