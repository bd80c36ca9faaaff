"""The default mode's MoE GEMM as torch._grouped_mm (one cuBLAS/CUTLASS grouped launch, TorchTitan's MoE
path), for the benchmarks that compare it with the per-expert F.linear loop that
kernels/torch_default.py runs: `with grouped_mm():` swaps it in for the block."""

from __future__ import annotations

import contextlib

import torch

from rlalign.kernels import torch_default


def grouped_linear(x, w, counts: list[int] | torch.Tensor):
    """torch_default.grouped_linear through torch._grouped_mm where it runs (CUDA, bf16, dims % 8 == 0)."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0):
        return _LOOP(x, w, counts)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device, non_blocking=True)
    return torch._grouped_mm(x, w.to(x.dtype).transpose(-2, -1), offs=offs)


_LOOP = torch_default.grouped_linear


@contextlib.contextmanager
def grouped_mm(on: bool = True):
    """Within the block the default mode's grouped_linear is torch._grouped_mm (on) or the loop."""
    torch_default.grouped_linear = grouped_linear if on else _LOOP
    try:
        yield
    finally:
        torch_default.grouped_linear = _LOOP
