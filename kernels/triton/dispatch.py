"""MoE dispatch in one launch: the counting sort of rlalign.kernels.moe_dispatch — (token, slot) rows
grouped by expert, in (token, slot) order within an expert — where the torch formulation (one-hot
compare, scan, gathers, scatter, ~12 launches) costs more than the experts' GEMMs' share of it.
One program per expert e, all independent (no atomics, no grid sync): it counts the rows whose expert
is below e (its group's first place) and equal to e (its count), then walks the rows again in blocks,
placing its own rows in order (place = start + rows of e before this one: a running count plus a scan
of the block). Past SEGMENT_ROWS rows (a 2,048-token decode step of bench-moe-large has 16k, a training
micro-batch ~80k) they go in segments: a first launch counts them per (expert, segment of SEGMENT
rows), the second places each segment's rows from those counts, one block per program. Integers
only: the same `order`, `dest`, `counts` as the torch version, exactly
(tests/test_moe_dispatch.py, tests/gpu/test_engine_gpu.py). Every expert's programs read all the ids
(from L2), twice: rows x experts reads, spread over experts x segments programs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Launch, cached

# rows per launch: the ids are read twice by every expert's program (from L2), so the cost grows
# with rows x experts; beyond this the torch version's parallel launches take over. A training
# micro-batch of bench-moe-large is ~80k rows (10k tokens x top-8): the torch version's [E, N] compare
# and scan took ~0.15 ms of device time per MoE layer there
MAX_ROWS = 1 << 20
SEGMENT_ROWS = 4096  # past this, each expert's rows are counted and placed in segments (two launches)
SEGMENT = 1024  # rows per segment: one block per (expert, segment) program, ~1k programs at 2,048 tokens x top-8


@triton.jit(do_not_specialize=["N"])
def _dispatch_count(ids_ptr, cnt_ptr, blw_ptr, N, E, S, SEG, BLOCK: tl.constexpr):
    """Program (e, s): the rows of segment s ([s SEG, (s + 1) SEG)) whose expert is e (cnt[e, s]) and
    below e (blw[e, s])."""
    e, s = tl.program_id(0), tl.program_id(1)
    below = tl.zeros((BLOCK,), dtype=tl.int32)
    mine = tl.zeros((BLOCK,), dtype=tl.int32)
    for n0 in range(s * SEG, tl.minimum(N, s * SEG + SEG), BLOCK):
        rows = n0 + tl.arange(0, BLOCK)
        x = tl.load(ids_ptr + rows, mask=rows < N, other=E).to(tl.int32)
        below += (x < e).to(tl.int32)
        mine += (x == e).to(tl.int32)
    tl.store(cnt_ptr + e * S + s, tl.sum(mine, axis=0))
    tl.store(blw_ptr + e * S + s, tl.sum(below, axis=0))


@triton.jit(do_not_specialize=["N"])
def _dispatch_kernel(ids_ptr, order_ptr, dest_ptr, counts_ptr, cnt_ptr, blw_ptr, N, E, S, SEG, BLOCK: tl.constexpr,
                     S2: tl.constexpr, SEGMENTED: tl.constexpr):
    """Program e (SEGMENTED: (e, s), the rows of segment s, their counts from _dispatch_count): the rows
    of expert e placed in order, after the rows of lower experts and of e in earlier segments."""
    e = tl.program_id(0)
    if SEGMENTED:
        s = tl.program_id(1)
        ss = tl.arange(0, S2)
        cnt = tl.load(cnt_ptr + e * S + ss, mask=ss < S, other=0)
        count = tl.sum(cnt, axis=0)
        run = tl.sum(tl.load(blw_ptr + e * S + ss, mask=ss < S, other=0), axis=0) + tl.sum(tl.where(ss < s, cnt, 0), 0)
        lo = s * SEG
        hi = tl.minimum(N, lo + SEG)
        if s == 0:
            tl.store(counts_ptr + e, count.to(tl.int64))
        todo = tl.sum(tl.where(ss == s, cnt, 0), 0)  # this segment's rows of e
    else:
        below = tl.zeros((BLOCK,), dtype=tl.int32)
        mine = tl.zeros((BLOCK,), dtype=tl.int32)
        for n0 in range(0, N, BLOCK):
            rows = n0 + tl.arange(0, BLOCK)
            x = tl.load(ids_ptr + rows, mask=rows < N, other=E).to(tl.int32)  # masked rows: in no group
            below += (x < e).to(tl.int32)
            mine += (x == e).to(tl.int32)
        count = tl.sum(mine, axis=0)
        tl.store(counts_ptr + e, count.to(tl.int64))
        run = tl.sum(below, axis=0)  # the group's first place, then its next free one
        todo = count
        lo = 0
        hi = N
    for n0 in range(lo, hi, BLOCK):
        if todo > 0 or e == 0:
            rows = n0 + tl.arange(0, BLOCK)
            x = tl.load(ids_ptr + rows, mask=rows < hi, other=E).to(tl.int32)
            hit = (x == e).to(tl.int32)
            place = run + tl.cumsum(hit, axis=0) - 1
            tl.store(dest_ptr + rows, place.to(tl.int64), mask=hit > 0)
            tl.store(order_ptr + place, rows.to(tl.int64), mask=hit > 0)
            run += tl.sum(hit, axis=0)
            if e == 0:  # an id outside [0, E) (NaN router logits) is in no group: dest 0, never memory it does not own
                tl.store(dest_ptr + rows, tl.zeros((BLOCK,), dtype=tl.int64), mask=(rows < hi) & ((x < 0) | (x >= E)))


def moe_dispatch(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, dest, counts) of the expert ids `flat` [N] (int64, token-major): see
    rlalign.kernels.moe_dispatch. N <= MAX_ROWS. Past SEGMENT_ROWS rows, two launches: each expert's
    rows counted per segment of SEGMENT rows, then placed per (expert, segment): a program per block of
    rows, not one walking N / SEGMENT blocks in turn."""
    N = flat.numel()
    if N > MAX_ROWS:
        raise ValueError(f"triton moe_dispatch: {N} rows exceed MAX_ROWS={MAX_ROWS} (use the torch version)")
    flat = flat.contiguous()
    order = torch.empty(N, dtype=torch.long, device=flat.device)
    dest = torch.empty(N, dtype=torch.long, device=flat.device)
    counts = torch.empty(num_experts, dtype=torch.long, device=flat.device)
    if num_experts == 0:
        return order, dest, counts
    if N <= SEGMENT_ROWS:  # one program per expert, a decode step's rows in one or two blocks
        block = max(16, min(2048, triton.next_power_of_2(max(N, 1))))
        seg = N
    else:
        block = seg = SEGMENT
    S = triton.cdiv(max(N, 1), max(seg, 1))
    cnt = torch.empty(num_experts * S, dtype=torch.int32, device=flat.device)
    blw = torch.empty_like(cnt)
    if S > 1:
        cached(("moe_dispatch_count", N, num_experts, S, flat.dtype), lambda: Launch(
            _dispatch_count, (num_experts, S), (N, num_experts, S, seg), dict(BLOCK=block, num_warps=4)))(
            flat, cnt, blw)
    cached(("moe_dispatch", N, num_experts, S, flat.dtype), lambda: Launch(
        _dispatch_kernel, (num_experts, S), (N, num_experts, S, seg), dict(
            BLOCK=block, S2=max(2, triton.next_power_of_2(S)), SEGMENTED=S > 1, num_warps=4)))(
        flat, order, dest, counts, cnt, blw)
    return order, dest, counts
