"""MoE dispatch in one launch: the counting sort of rlalign.model.model.dispatch — (token, slot) rows
grouped by expert, in (token, slot) order within an expert — for the few rows of a decode step,
where the torch formulation (one-hot compare, scan, gathers, scatter, ~12 launches) costs more than
the experts' GEMMs' share of it. One program walks the rows in blocks twice: first the per-expert
counts, then each row's place = its expert's start + the rows of that expert before it (earlier
blocks: a running count; this block: a column scan of the one-hot block). Integers only, no atomics:
the same `order`, `dest`, `counts` as the torch version, exactly (tests/test_moe_dispatch.py,
tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import Launch, _cached

MAX_ROWS = 16384  # one program: beyond this (prefill, training) the torch version's parallel launches win
# model.dispatch takes this kernel (off: RLALIGN_TRITON_DISPATCH=0, or ENABLED = False at run time;
# experiments/bench_generate.py compares both in one run)
ENABLED = os.environ.get("RLALIGN_TRITON_DISPATCH", "1") != "0"


@triton.jit
def _dispatch_kernel(ids_ptr, order_ptr, dest_ptr, counts_ptr, N, E: tl.constexpr, E_P2: tl.constexpr,
                     BLOCK: tl.constexpr):
    cols = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for n0 in range(0, N, BLOCK):
        rows = n0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + rows, mask=rows < N, other=E_P2).to(tl.int32)  # masked rows: no column
        counts += tl.sum((e[:, None] == cols[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + cols, counts.to(tl.int64), mask=cols < E)
    base = tl.cumsum(counts, axis=0) - counts  # each expert's first row, then its next free row
    for n0 in range(0, N, BLOCK):
        rows = n0 + tl.arange(0, BLOCK)
        ok = rows < N
        e = tl.load(ids_ptr + rows, mask=ok, other=E_P2).to(tl.int32)
        hit = (e[:, None] == cols[None, :]).to(tl.int32)
        place = tl.cumsum(hit, axis=0) - 1 + base[None, :]  # in the row's own column: where it goes
        d = tl.sum(hit * place, axis=1)
        tl.store(dest_ptr + rows, d.to(tl.int64), mask=ok)
        tl.store(order_ptr + d, rows.to(tl.int64), mask=ok)
        base += tl.sum(hit, axis=0)


def moe_dispatch(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, dest, counts) of the expert ids `flat` [N] (int64, token-major): see
    rlalign.model.model.dispatch. N <= MAX_ROWS."""
    N = flat.numel()
    if N > MAX_ROWS:
        raise ValueError(f"triton moe_dispatch: {N} rows exceed MAX_ROWS={MAX_ROWS} (use the torch version)")
    flat = flat.contiguous()
    order = torch.empty(N, dtype=torch.long, device=flat.device)
    dest = torch.empty(N, dtype=torch.long, device=flat.device)
    counts = torch.empty(num_experts, dtype=torch.long, device=flat.device)
    e_p2 = max(16, triton.next_power_of_2(num_experts))
    block = max(16, min(256, 16384 // e_p2))  # the one-hot block: BLOCK x E_P2 int32, 64 per thread of 8 warps
    _cached(("moe_dispatch", N, num_experts, flat.dtype), lambda: Launch(
        _dispatch_kernel, (1,), (N,), dict(E=num_experts, E_P2=e_p2, BLOCK=block, num_warps=8)))(
        flat, order, dest, counts)
    return order, dest, counts
