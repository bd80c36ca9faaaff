"""The threshold-search top-k/top-p filter that topp.filter_cut replaced, kept here as the baseline of
experiments/kernels/bench_topp_cut.py: the same kept set and bits as rlalign.kernels.sampling.filter_logits,
one program per row; its first pass writes the tempered values into its fp32 output: its search levels read
them there as they read an fp32 row. The row's max and key range, then the threshold search, level by level:
first FILTER_WAYS bins of equal width in value, then FILTER_WAYS thresholds evenly spaced in the current key
interval; each level's weights in one pass (a 16-way one-hot of int64 masses per value), then the interval
narrowed to the bin or the two thresholds around the answer and the row's weighted values inside it compacted
to the front of the output row, until the interval holds one key; a last pass writes the kept values and -inf.
"""

from __future__ import annotations

import struct
import sys

import torch
import triton
import triton.language as tl

from rlalign.kernels import fixed_order as fo
from rlalign.kernels import sampling
from rlalign.kernels.triton.common import INTERPRET, apply_cut, upcast_scaled
from rlalign.kernels.triton.common import order_key as _order_key
from rlalign.kernels.triton.sampling import check_2d_float
from rlalign.kernels.triton.topp import weight_of

FILTER_BLOCK, FILTER_WAYS = 256, 16  # a search level holds [FILTER_WAYS, FILTER_BLOCK] comparisons
FILTER_STREAM = 2048  # the chunk of the passes that only stream the row (max, compaction, the output)
FILTER_WARPS = 8  # warps of a row's program
# its kernels' fixed_order.exp constants (the mass itself is topp.weight_of's)
EXP_CONST = dict(LOG2E=fo.LOG2E, LN2_HI=fo.LN2_HI, LN2_LO=fo.LN2_LO,
                 **{f"E{i}": c for i, c in enumerate(fo.EXP_COEFFS)})


@triton.jit
def _value_bin(z, zm, scale, WAYS: tl.constexpr):
    """Bins of equal width in value below zm (bin 0 holds zm; values past the last bin's end go to
    it): non-decreasing as z falls, so each bin is an interval of keys."""
    b = tl.minimum(tl.maximum(tl.floor((zm - z) * scale), 0.0), WAYS - 1.0)
    return b.to(tl.int32)


@triton.jit
def _search(z_row, o_row, V, lo, hi, bound, top_p, zm, zlo, IS_P: tl.constexpr, LOG2E: tl.constexpr,
            LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr,
            E3: tl.constexpr, E4: tl.constexpr, E5: tl.constexpr, SCALE: tl.constexpr, WAYS: tl.constexpr,
            BLOCK: tl.constexpr, SBLOCK: tl.constexpr):
    """The least key c in (lo, hi] whose weight above it is below bound (top-p: below top_p times the
    row's total mass): rlalign.kernels.sampling.threshold_search's answer. Values of weight 0 never
    hold the answer (the weight above falls only at weighted keys) and are dropped from the levels.
    First level, when the row's values span (zlo, zm]: WAYS bins of equal width in value; the
    bin where the weight above crosses the bound is compacted. Then levels of WAYS thresholds
    evenly spaced in keys, each compacting the keys between the two thresholds around the answer.
    A level's weights are summed per lane in [WAYS, BLOCK] (a lane's ways in its own registers, the
    block's values not moved between threads), the lanes once at the end: integers, exact in any order."""
    jw = tl.arange(0, WAYS)
    ways = (jw + 1).to(tl.int64)
    above_hi = tl.zeros((), tl.int64)  # the weight of the keys above hi
    src = z_row
    n = V
    whole = tl.full((), 1, tl.int32)  # whether the next level reads the whole row (its total mass)
    span = zm - zlo
    scale = tl.math.div_rn(tl.full((), WAYS, tl.float32), tl.where(span > 0.0, span, 1.0))
    if (span > 0.0) & (scale > 0.0) & (scale < 3.0e38):  # a finite spread, bins of a finite positive width
        acc = tl.zeros((WAYS, BLOCK), tl.int64)
        tot = tl.zeros((BLOCK,), tl.int64)
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
            key = _order_key(z).to(tl.int64)
            w = weight_of(z, (cols < V) & (key > lo) & (key <= hi), zm, IS_P)
            b = _value_bin(z, zm, scale, WAYS)
            acc += tl.where(jw[:, None] == b[None, :], w[None, :], 0)
            tot += w
        hist = tl.sum(acc, axis=1)  # [WAYS] the weight in each bin
        if IS_P:
            bound = tl.sum(tot, axis=0).to(tl.float64) * top_p
        above = tl.cumsum(hist, axis=0) - hist  # the weight of the bins before each (higher values)
        star = tl.maximum(tl.sum((above.to(tl.float64) < bound).to(tl.int32), axis=0) - 1, 0)
        above_hi = tl.sum(tl.where(jw == star, above, 0), axis=0)
        count = tl.zeros((), tl.int32)
        kmin = tl.full((SBLOCK,), 2147483647, tl.int32)
        kmax = tl.full((SBLOCK,), -2147483648, tl.int32)
        for v0 in range(0, V, SBLOCK):
            cols = v0 + tl.arange(0, SBLOCK)
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
            key = _order_key(z)
            w = weight_of(z, (cols < V) & (key.to(tl.int64) > lo) & (key.to(tl.int64) <= hi), zm, IS_P)
            sel = (w > 0) & (_value_bin(z, zm, scale, WAYS) == star)
            pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(o_row + pos, z, mask=sel)
            count += tl.sum(sel.to(tl.int32), axis=0)
            kmin = tl.where(sel, tl.minimum(kmin, key), kmin)
            kmax = tl.where(sel, tl.maximum(kmax, key), kmax)
        tl.debug_barrier()
        lo = tl.min(kmin, axis=0).to(tl.int64) - 1
        hi = tl.maximum(tl.max(kmax, axis=0).to(tl.int64), lo + 1)  # no weighted value in the bin: done
        src = o_row
        n = count
        whole = 0
    while hi - lo > 1:
        cand = lo + ((hi - lo) * ways) // (WAYS + 1)  # [WAYS] ascending
        cand32 = tl.maximum(cand, -2147483648).to(tl.int32)
        acc = tl.zeros((WAYS, BLOCK), tl.int64)
        tot = tl.zeros((BLOCK,), tl.int64)
        for v0 in range(0, n, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            z = tl.load(src + cols, mask=cols < n, other=float("-inf"))
            key = _order_key(z)
            w = weight_of(z, (cols < n) & (key.to(tl.int64) > lo) & (key.to(tl.int64) <= hi), zm, IS_P)
            acc += tl.where(cand32[:, None] < key[None, :], w[None, :], 0)
            tot += w
        if IS_P:
            if whole == 1:
                bound = tl.sum(tot, axis=0).to(tl.float64) * top_p
        w_above = above_hi + tl.sum(acc, axis=1)
        ok = w_above.to(tl.float64) < bound
        new_hi = tl.min(tl.where(ok, cand, hi), axis=0)
        above_hi = tl.max(tl.where(ok, w_above, above_hi), axis=0)
        lo = tl.max(tl.where(ok, lo, cand), axis=0)
        hi = new_hi
        if hi - lo > 1:  # compact the weighted values inside (lo, hi] to the front of the output row
            count = tl.zeros((), tl.int32)
            for v0 in range(0, n, SBLOCK):
                cols = v0 + tl.arange(0, SBLOCK)
                z = tl.load(src + cols, mask=cols < n, other=float("-inf"))
                key = _order_key(z).to(tl.int64)
                sel = weight_of(z, (cols < n) & (key > lo) & (key <= hi), zm, IS_P) > 0
                pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.debug_barrier()
                tl.store(o_row + pos, z, mask=sel)
                count += tl.sum(sel.to(tl.int32), axis=0)
            tl.debug_barrier()
            src = o_row
            n = count
        whole = 0
    return hi


@triton.jit(do_not_specialize=["top_k", "top_p_bits"])
def _filter_kernel(z_ptr, out_ptr, work_ptr, cut_ptr, scale, V, top_k, top_p_bits, SCALED: tl.constexpr,
                   COPY: tl.constexpr, WRITE: tl.constexpr, DO_K: tl.constexpr, DO_P: tl.constexpr,
                   LOG2E: tl.constexpr, LN2_HI: tl.constexpr,
                   LN2_LO: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
                   E4: tl.constexpr, E5: tl.constexpr, SCALE: tl.constexpr, WAYS: tl.constexpr, BLOCK: tl.constexpr,
                   SBLOCK: tl.constexpr):
    """COPY: the first pass writes the row's tempered values (upcast_scaled of the logits in any dtype) to
    the output row, which the search levels then read (fp32, as they would the tempered row itself) with
    `work` as their compaction space, and the last pass filters in place. Without COPY, z is the fp32
    tempered row and the output row is the compaction space. The row's cut goes to cut_ptr; WRITE: the last
    pass writes the kept values and -inf to the output row (without it the output row is scratch)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = z_ptr + row * V
    if COPY:
        z_row = out_ptr + row * V
        o_row = work_ptr + row * V
    else:
        z_row = x_row
        o_row = out_ptr + row * V
    kmax = tl.full((SBLOCK,), -2147483648, tl.int32)
    kmin = tl.full((SBLOCK,), 2147483647, tl.int32)
    zmax = tl.full((SBLOCK,), float("-inf"), tl.float32)
    zmin = tl.full((SBLOCK,), float("inf"), tl.float32)  # the least finite value
    for v0 in range(0, V, SBLOCK):
        cols = v0 + tl.arange(0, SBLOCK)
        mask = cols < V
        z = upcast_scaled(tl.load(x_row + cols, mask=mask, other=float("-inf")), scale, SCALED)
        if COPY:
            tl.store(z_row + cols, z, mask=mask)
        key = _order_key(z)
        kmax = tl.where(mask, tl.maximum(kmax, key), kmax)
        kmin = tl.where(mask, tl.minimum(kmin, key), kmin)
        zmax = tl.maximum(zmax, z)
        zmin = tl.where(z > float("-inf"), tl.minimum(zmin, z), zmin)
    if COPY:
        tl.debug_barrier()  # the levels read values other threads wrote
    zm = tl.max(zmax, axis=0)
    zf = tl.min(zmin, axis=0)
    cut = tl.min(kmin, axis=0).to(tl.int64)  # keeps every value
    top_p = top_p_bits.to(tl.float64, bitcast=True)
    if DO_K:
        cut = _search(z_row, o_row, V, cut - 1, tl.max(kmax, axis=0).to(tl.int64), top_k.to(tl.float64), top_p, zm,
                      zf, False, LOG2E, LN2_HI, LN2_LO, E0, E1, E2, E3, E4, E5, SCALE, WAYS, BLOCK, SBLOCK)
    if DO_P:  # values 24 or more below the max have mass 0: the bins span the rest
        cut = _search(z_row, o_row, V, cut - 1, _order_key(zm).to(tl.int64), top_p, top_p, zm,
                      tl.maximum(zf, zm - 24.0), True, LOG2E, LN2_HI, LN2_LO, E0, E1, E2, E3, E4, E5, SCALE, WAYS,
                      BLOCK, SBLOCK)
    tl.store(cut_ptr + row, cut)
    if WRITE:
        for v0 in range(0, V, SBLOCK):
            cols = v0 + tl.arange(0, SBLOCK)
            mask = cols < V
            z = tl.load(z_row + cols, mask=mask, other=0.0)
            tl.store(out_ptr + row * V + cols, apply_cut(z, cut), mask=mask)




def _filter(z: torch.Tensor, top_k: int, top_p: float, scale: float, write: bool):
    """One launch of _filter_kernel: (the filtered fp32 [B, V] if write, else None; the cuts [B] int64)."""
    B, V = z.shape
    if not sys.float_info.min <= top_p <= 1.0:
        raise ValueError(f"filter_logits: top_p={top_p} must be a normal float in (0, 1]")
    if top_p < 1.0 and V >= sampling.MAX_VOCAB:
        raise ValueError(f"filter_logits: top_p over a vocabulary of {V} (at most {sampling.MAX_VOCAB - 1})")
    z = z.contiguous()
    out = torch.empty(B, V, dtype=torch.float32, device=z.device)  # without write: the levels' space
    cut = torch.empty(B, dtype=torch.long, device=z.device)
    copy = z.dtype != torch.float32 or scale != 1.0  # the tempered values are not z itself: written first
    work = torch.empty_like(out) if copy else out
    opts = {} if INTERPRET else dict(enable_fp_fusion=False, num_warps=FILTER_WARPS)
    _filter_kernel[(B,)](z, out, work, cut, scale, V, int(top_k), struct.unpack("<q", struct.pack("<d", top_p))[0],
                         SCALED=scale != 1.0, COPY=copy, WRITE=write, DO_K=bool(top_k) and top_k < V,
                         DO_P=top_p < 1.0, SCALE=sampling.MASS_SCALE, WAYS=FILTER_WAYS, BLOCK=FILTER_BLOCK,
                         SBLOCK=FILTER_STREAM, **EXP_CONST, **opts)
    return (out if write else None), cut


def threshold_filter_logits(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, scale: float = 1.0) -> torch.Tensor:
    """filter_logits's kept set and bits by _filter_kernel, the threshold search over an fp32 copy (a 16-way
    first level of int64 masses): the baseline experiments/kernels/bench_topp_cut.py times."""
    check_2d_float("filter_logits", z)
    if not ((top_k and top_k < z.shape[1]) or top_p < 1.0) or z.shape[0] == 0:
        return sampling.temper(z, scale)
    return _filter(z, top_k, top_p, scale, True)[0]
