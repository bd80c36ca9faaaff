"""GPU: kernels.linears (q, k, v in one launch of the GEMM kernel) has the bits of the separate linears at
the real shapes, across the small-M buckets, eager and replayed from a CUDA graph."""

import pytest
import torch
from conftest import same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"bench-moe-large": (2048, (2048, 512, 512)), "qwen3-30b": (2048, (4096, 512, 512))}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_linears_equal_separate_linears_at_every_bucket(shape, monkeypatch):
    from rlalign.kernels.triton import gemm

    K, ns = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, K, device="cuda", generator=g) * 0.02).bfloat16() for n in ns]
    bs = [None, (torch.randn(ns[1], device="cuda", generator=g)).bfloat16(), None]
    x = torch.randn(4100, K, device="cuda", generator=g).bfloat16()
    launches = []
    run = gemm.Launch.__call__

    def counted(self, *tensors):
        launches.append(self.fn)
        return run(self, *tensors)

    with torch.no_grad():
        for m in (1, 7, 8, 33, 64, 65, 100, 255, 256, 257, 512, 1000, 4096, 4100):
            ref = [gemm.linear(x[:m], w, b) for w, b in zip(ws, bs)]
            with monkeypatch.context() as mp:
                mp.setattr(gemm.Launch, "__call__", counted)
                launches.clear()
                ys = gemm.linears(x[:m], ws, bs)
            assert launches == [gemm._gemm_kernel], m
            assert all(same_bits(y, r) for y, r in zip(ys, ref)), m
        # negative twin: the same products with K in another order differ
        flipped = gemm.linears(x[:256].flip(1), [w.flip(1) for w in ws], [None] * 3)
        assert not any(same_bits(a, b) for a, b in zip(flipped, gemm.linears(x[:256], ws, [None] * 3)))


def test_linears_replayed_from_a_cuda_graph_equal_eager_linears():
    from rlalign.kernels.triton import gemm

    K, ns = SHAPES["bench-moe-large"]
    g = torch.Generator(device="cuda").manual_seed(1)
    layers = [[(torch.randn(n, K, device="cuda", generator=g) * 0.02).bfloat16() for n in ns] for _ in range(3)]
    x = torch.randn(256, K, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        for ws in layers:  # warm-up outside the capture (compile, plans)
            gemm.linears(x, ws, [None] * 3)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [gemm.linears(x, ws, [None] * 3) for ws in layers]
        for seed in (2, 3):
            x.copy_(torch.randn(256, K, device="cuda", generator=g.manual_seed(seed)).bfloat16())
            graph.replay()
            torch.cuda.synchronize()
            for ws, ys in zip(layers, outs):
                assert all(same_bits(y, gemm.linear(x, w)) for y, w in zip(ys, ws)), seed
