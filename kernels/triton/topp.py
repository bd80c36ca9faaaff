"""The top-k / top-p cut: rlalign.kernels.sampling.filter_cut(temper(z, scale), top_k, top_p), the same
key per row, from the logits in any float dtype read in place (upcast and scaled in registers,
common.upcast_scaled). One program per row, in up to three launches (each with its own registers: the streaming
passes of the first are not held to the searches' count):
  first  A  one pass: the row's greatest value zm (NaN aside), whether it has a NaN; for top-k its least and
            greatest keys; for top-p without top-k also the estimate's counts of values per bin of d = zm - z
            over every s-th chunk of the row, and each lane's greatest value and its chunk (row_stats).
         top-k  one pass: a histogram of counts over NB bins of keys (kmax - key) >> shift: the bin of the k-th
                largest key is exact; one pass compacts that bin into the row's work buffer.
         top-p  (after top-k: one pass for the estimate's counts over the values top-k kept.) The counts, the
                lane maxima at their own masses and each bin's other values taken as spread evenly over it
                (est_points), estimate the distance where the mass reaches top_p * Q and a window of d around it
                (est_window: at least EST_DMIN plus the input dtype's spacing there each side). One pass sums each
                value's integer mass (sampling.top_p_mass, the same formula) into Q and into the mass above the
                window, and compacts the window's values (window_pass). The row's state is kept for the next
                launches.
  search  where top_p * Q lies within the window's exact masses: the cut is among its values (key_search).
  retry   else up to EST_RETRIES adjacent windows (their edge's mass is exact), then the exact bins: per-bin
          mass bounds over NB bins narrow the cut to bins [ja, jb], whose values are compacted.
  `key_search` (levels of WAYS thresholds in key space, each compacting the keys between the two
  thresholds around the answer, then every pair of the last PAIR_MAX values compared) runs over the compacted
  values alone. Every sum is of integers, so the cut is the torch function's: the estimate only places the
  window, whose exact masses decide whether it holds the cut; the weight above it is exact, and values
  outside it are above or below every compacted key.
Rows are independent (one program, its own work row): a row's cut does not depend on the batch.
Compiled without FMA contraction (enable_fp_fusion=False), as the sampler's other kernels."""

from __future__ import annotations

import math
import struct
import sys

import torch
import triton
import triton.language as tl

from rlalign.kernels import fixed_order as fo
from rlalign.kernels import sampling

from .common import INTERPRET, order_key, upcast_scaled, work_table
from .sampling import check_2d_float

# NB: the exact bins' histogram (top-k's keys; top-p's values below the max when the estimated windows miss).
# tl.histogram's cost grows with the bins, fewer bins leave more values to compact: as top-p's only path on one
# H100 (bench_topp_cut_h100.json at a917f39, 1024 x 151,936 bf16, top-p 0.95, T 0.8) 256 / 512 / 1,024 / 2,048
# bins took 3.5 / 3.3 / 4.4 / 10.1 ms on flat rows (s 1), 4.6 / 2.9 / 4.2 / 9.9 on peaked ones (s 4)
CUT_BINS = 512
D_RANGE = 24.0  # top-p bins span d = zm - z in [0, 24): fixed_order.exp(-22.2) * 2**32 < 1, mass 0 below
_D_RANGE = tl.constexpr(D_RANGE)
CUT_WAYS, CUT_BLOCK, CUT_STREAM = 16, 256, 1024  # key-search level [WAYS, BLOCK]; the streaming passes' chunk
CUT_WARPS = 8
# the key search's last step: every pair of its (at most PAIR_MAX) values compared, in [PAIR_TI, PAIR_TJ] tiles
PAIR_MAX, PAIR_TI, PAIR_TJ = 256, 64, 64
_PAIR_TI, _PAIR_TJ = tl.constexpr(PAIR_TI), tl.constexpr(PAIR_TJ)
# The estimate's counts (EST_BINS bins; in pass A they cost ~0.48 ms of the 1.98 ms cut at 1024 x 151,936,
# probe_topp_window_h100.json), the window's half-width in estimated ranks (EST_RANK values each side of the
# estimated cut, at least EST_DMIN in d), and the retries with an adjacent window before the exact bins
EST_BINS, EST_RANK, EST_DMIN, EST_RETRIES = 128, 1024, 0.03, 2
# pass A counts the estimate's bins over every s-th chunk of the row, s = max(chunks // EST_CHUNKS, 1) (4 at
# 151,936 columns): tl.histogram is ~210 of the pass's ~280 instructions a chunk (sm_90); the lane maxima stay exact
EST_CHUNKS = 32
# every window's least half-width EST_DMIN plus the spacing of the input dtype's values at its estimate (in d, the
# spacing of the raw values times scale: bf16 in [16, 32) 0.125): over values that coarse the cut's value may lie a
# spacing beyond the estimate, and EST_DMIN alone may hold no value at all
EST_DTYPE_FLOOR = True
# the estimate's bins span d + EST_SHIFT around an anchor in [0, D_RANGE + EST_SHIFT): in pass A the anchor is the
# greatest of values sampled over the row, below the max by up to EST_SHIFT with the bins still whole
EST_SHIFT = 8.0
_EST_SHIFT = tl.constexpr(EST_SHIFT)
KEEP_ALL = sampling.KEEP_ALL
_KEEP_ALL = tl.constexpr(KEEP_ALL)  # what a kernel may read of it
_NAN_CUT = tl.constexpr(sampling.NAN_CUT)  # the cut at a NaN (any sign): only the NaNs kept
EXP_SLACK = 1e-5  # relative: fixed_order.exp is within a few ulp (1e-7) of exp; the bin edges within 2**-23


def est_scale(ne: int) -> float:
    """fp32(ne / (D_RANGE + EST_SHIFT)): the estimate's bin of d' = anchor - z is int(fp32((d' + EST_SHIFT) *
    est_scale))."""
    return float(torch.tensor(ne / (D_RANGE + EST_SHIFT), dtype=torch.float32))


def value_spacing(dtype: torch.dtype) -> float:
    """The spacing of the dtype's values over the power of 2 at or below them, 2**-(mantissa bits): bf16 2**-7, fp16
    2**-10, fp32 2**-23 (the kernels' values are fp32); 0 (no floor) when EST_DTYPE_FLOOR is off."""
    return max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps) if EST_DTYPE_FLOOR else 0.0


def bin_scale(nb: int) -> float:
    """fp32(nb / D_RANGE): the top-p bin of d is int(fp32(d * bin_scale))."""
    return float(torch.tensor(nb / D_RANGE, dtype=torch.float32))


def mass_bounds(nb: int = CUT_BINS) -> tuple[list[int], list[int]]:
    """Per bin j of d (b = int(fp32(d * fp32(nb / D_RANGE))), clamped to nb - 1): integers lo_j <= mass <=
    hi_j for every value in it, mass = floor(fixed_order.exp(-d) * 2**32). d lies within
    [j / s, (j + 1) / s] up to the product's rounding (2**-24 relative, padded to 2**-22), and
    fixed_order.exp within EXP_SLACK of exp: both pads make the bounds valid, not tight."""
    s = bin_scale(nb)
    lo, hi = [], []
    for j in range(nb):
        d_lo = j / s * (1 - 2.0 ** -22)
        d_hi = (j + 1) / s * (1 + 2.0 ** -22) if j < nb - 1 else math.inf
        hi.append(math.floor(math.exp(-d_lo) * (1 + EXP_SLACK) * 2.0 ** 32) + 1)
        lo.append(max(math.floor(math.exp(-d_hi) * (1 - EXP_SLACK) * 2.0 ** 32) - 1, 0))
    return lo, hi


assert len(fo.EXP_COEFFS) == 6
_LOG2E, _LN2_HI, _LN2_LO = tl.constexpr(fo.LOG2E), tl.constexpr(fo.LN2_HI), tl.constexpr(fo.LN2_LO)
_E0, _E1, _E2, _E3, _E4, _E5 = (tl.constexpr(c) for c in fo.EXP_COEFFS)
_MASS_SCALE = tl.constexpr(sampling.MASS_SCALE)


@triton.jit
def _exp(x):
    """fixed_order.exp for x <= 0 (or NaN): n = round-half-even(x * log2 e) by the 1.5 * 2**23 shift (|x * log2 e| <
    2**22), its integer read from the shifted value's bits; 2**n applied as 2**(n >> 1) * 2**(n - (n >> 1)), the
    halves (floor(n / 2) and the rest) as the formula's. No float-to-int conversion: its bits on one H100 equal
    the converting form's (probe_topp_window_h100.json)."""
    xc = tl.where(x < -104.0, -104.0, x)
    t = xc * _LOG2E + 12582912.0
    n = t - 12582912.0
    k = t.to(tl.int32, bitcast=True) - 0x4B400000
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = tl.full(r.shape, _E0, tl.float32)
    p = p * r + _E1
    p = p * r + _E2
    p = p * r + _E3
    p = p * r + _E4
    p = p * r + _E5
    p = (p * r + 1.0) * r + 1.0
    k1 = k >> 1
    y = (p * ((k1 + 127) << 23).to(tl.float32, bitcast=True)) * (((k - k1) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x < -104.0, 0.0, y)


@triton.jit
def weight_of(z, inside, zm, IS_P: tl.constexpr):
    """top-p: the integer mass (kernels.sampling.top_p_mass, fixed_order.exp's formula); top-k: 1; 0 outside."""
    if IS_P:
        e = _exp(z - zm) * _MASS_SCALE
        return tl.where(inside & (e >= 1.0), tl.floor(e), 0.0).to(tl.int64)
    return inside.to(tl.int64)


@triton.jit
def _chunk(x_row, v0, V, scale, SCALED: tl.constexpr, SBLOCK: tl.constexpr):
    """A streaming pass's chunk of the row, columns v0 .. v0 + SBLOCK: (which lie in the row, their
    upcast_scaled values, -inf past V)."""
    cols = v0 + tl.arange(0, SBLOCK)
    mask = cols < V
    return mask, upcast_scaled(tl.load(x_row + cols, mask=mask, other=float("-inf")), scale, SCALED)


@triton.jit
def _pair_cut(buf, n, lo, hi, above_hi, bound, zm, IS_P: tl.constexpr, TI: tl.constexpr, TJ: tl.constexpr):
    """The least key of buf's n values (all with keys in (lo, hi], the weight above lo's at least bound) whose
    weight above it (above_hi plus the weights of buf's values with greater keys) is below bound, every pair
    of values compared: the search's answer (the weight above a key changes only at the values' keys, and hi
    is one's or above them all)."""
    best = hi
    for i0 in range(0, n, TI):
        ci = i0 + tl.arange(0, TI)
        ki = order_key(tl.load(buf + ci, mask=ci < n, other=float("-inf"))).to(tl.int64)
        acc = tl.zeros((TI, TJ), tl.int64)
        for j0 in range(0, n, TJ):
            cj = j0 + tl.arange(0, TJ)
            zj = tl.load(buf + cj, mask=cj < n, other=float("-inf"))
            wj = weight_of(zj, cj < n, zm, IS_P)
            acc += tl.where(order_key(zj).to(tl.int64)[None, :] > ki[:, None], wj[None, :], 0)
        ok = (ci < n) & ((above_hi + tl.sum(acc, axis=1)).to(tl.float64) < bound)
        best = tl.minimum(best, tl.min(tl.where(ok, ki, hi), axis=0))
    return best


@triton.jit
def key_search(buf, n, lo, hi, above_hi, bound, zm, IS_P: tl.constexpr, WAYS: tl.constexpr, PAIR: tl.constexpr,
               BLOCK: tl.constexpr, SBLOCK: tl.constexpr):
    """The least key c in (lo, hi] whose weight above it (above_hi, the weight above hi, plus the
    weights of buf's n values with keys in (c, hi]) is below bound: sampling.threshold_search's answer.
    Levels of WAYS thresholds evenly spaced in (lo, hi]; each compacts the weighted values between the
    two thresholds around the answer to the front of buf (in place: a value moves to an index at or
    below its own), until at most PAIR values are left: `_pair_cut` over them. The search only sums
    integers and takes a min and a max, so the order of buf's values does not matter."""
    ways = (tl.arange(0, WAYS) + 1).to(tl.int64)
    while (hi - lo > 1) & (n > PAIR):
        cand = lo + ((hi - lo) * ways) // (WAYS + 1)  # [WAYS] ascending
        cand32 = tl.maximum(cand, -2147483648).to(tl.int32)
        acc = tl.zeros((WAYS, BLOCK), tl.int64)
        for v0 in range(0, n, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            z = tl.load(buf + cols, mask=cols < n, other=float("-inf"))
            key = order_key(z)
            w = weight_of(z, (cols < n) & (key.to(tl.int64) > lo) & (key.to(tl.int64) <= hi), zm, IS_P)
            acc += tl.where(cand32[:, None] < key[None, :], w[None, :], 0)
        w_above = above_hi + tl.sum(acc, axis=1)
        ok = w_above.to(tl.float64) < bound
        new_hi = tl.min(tl.where(ok, cand, hi), axis=0)
        above_hi = tl.max(tl.where(ok, w_above, above_hi), axis=0)
        lo = tl.max(tl.where(ok, lo, cand), axis=0)
        hi = new_hi
        if hi - lo > 1:
            count = tl.zeros((), tl.int32)
            for v0 in range(0, n, SBLOCK):
                cols = v0 + tl.arange(0, SBLOCK)
                z = tl.load(buf + cols, mask=cols < n, other=float("-inf"))
                key = order_key(z).to(tl.int64)
                sel = weight_of(z, (cols < n) & (key > lo) & (key <= hi), zm, IS_P) > 0
                pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.debug_barrier()  # the chunk is read before any of it is overwritten
                tl.store(buf + pos, z, mask=sel)
                count += tl.sum(sel.to(tl.int32), axis=0)
            tl.debug_barrier()
            n = count
    if hi - lo > 1:
        hi = _pair_cut(buf, n, lo, hi, above_hi, bound, zm, IS_P, _PAIR_TI, _PAIR_TJ)
    return hi


@triton.jit
def _anchor_bin(z, anchor, ESCALE: tl.constexpr, NE: tl.constexpr):
    """The estimate's bin of z (NE bins of d' + EST_SHIFT, d' = anchor - z, in [0, D_RANGE + EST_SHIFT); values
    further above the anchor in bin 0) and whether d' < D_RANGE (false for NaN and -inf)."""
    dt = anchor - z
    inb = dt < _D_RANGE
    return tl.minimum(tl.maximum((tl.where(inb, dt, 0.0) + _EST_SHIFT) * ESCALE, 0.0).to(tl.int32), NE - 1), inb


@triton.jit
def row_stats(x_row, scale, V, SCALED: tl.constexpr, HIST: tl.constexpr, KEYS: tl.constexpr, NE: tl.constexpr,
              ESCALE: tl.constexpr, NCHUNK: tl.constexpr, SBLOCK: tl.constexpr):
    """Pass A: the greatest non-NaN value, whether a NaN is present; KEYS: the least and greatest keys (else the
    int32 extremes, unread);
    HIST: also the top-p estimate's counts per bin around an anchor (the greatest of SBLOCK values strided over
    the row, 0 when that is not finite: the bins' offset from d's follows from the max, est_offset) of the
    values in every s-th chunk (s = max(chunks // NCHUNK, 1), chunks 0, s, 2s, ...), else zeros and 0; each lane's
    greatest non-NaN value (lane l: columns l, l + SBLOCK, ...; -inf for none) and the chunk it is first met in;
    and s."""
    kmax = tl.full((SBLOCK,), -2147483648, tl.int32)
    kmin = tl.full((SBLOCK,), 2147483647, tl.int32)
    zmax = tl.full((SBLOCK,), float("-inf"), tl.float32)
    nan = tl.zeros((SBLOCK,), tl.int32)
    hist = tl.zeros((NE,), tl.int32)
    anchor = tl.zeros((), tl.float32)
    zc = tl.zeros((SBLOCK,), tl.int32)
    every = tl.maximum(tl.cdiv(V, SBLOCK) // NCHUNK, 1)
    if HIST:
        cs = tl.arange(0, SBLOCK) * tl.maximum(V // SBLOCK, 1)
        zs = upcast_scaled(tl.load(x_row + cs, mask=cs < V, other=float("-inf")), scale, SCALED)
        anchor = tl.max(tl.where(zs == zs, zs, float("-inf")), axis=0)
        anchor = tl.where((anchor > float("-inf")) & (anchor < float("inf")), anchor, 0.0)
    for v0 in range(0, V, SBLOCK):
        mask, z = _chunk(x_row, v0, V, scale, SCALED, SBLOCK)
        if KEYS:
            key = order_key(z)
            kmax = tl.where(mask, tl.maximum(kmax, key), kmax)
            kmin = tl.where(mask, tl.minimum(kmin, key), kmin)
        zok = tl.where(z == z, z, float("-inf"))
        zc = tl.where(zok > zmax, v0 // SBLOCK, zc)
        zmax = tl.maximum(zmax, zok)
        nan = tl.maximum(nan, (z != z).to(tl.int32))
        if HIST:
            if (v0 // SBLOCK) % every == 0:
                b, inb = _anchor_bin(z, anchor, ESCALE, NE)
                hist += tl.histogram(b, NE, mask=inb & mask)
    return (tl.max(zmax, axis=0), tl.min(kmin, axis=0), tl.max(kmax, axis=0), tl.max(nan, axis=0), hist, anchor,
            zmax, zc, every)


@triton.jit
def _compact(w_row, z, key, sel, count, lo, hi):
    """One chunk's selected values appended to the work row after its count values; the least and greatest
    selected keys per lane kept: (count, lo, hi) after the chunk."""
    pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(w_row + pos, z, mask=sel)
    return count + tl.sum(sel.to(tl.int32), axis=0), tl.where(sel, tl.minimum(lo, key), lo), \
        tl.where(sel, tl.maximum(hi, key), hi)


@triton.jit
def _key_bin(key, kmax, shift):
    return ((kmax.to(tl.int64) - key.to(tl.int64)) >> shift).to(tl.int32)


@triton.jit
def _top_k_cut(x_row, w_row, scale, V, k, kmin, kmax, SCALED: tl.constexpr, NB: tl.constexpr, WAYS: tl.constexpr,
               PAIR: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr):
    """The key of the k-th largest value, NaN counted above every value (as torch.topk ranks it). Bins of
    keys (kmax - key) >> shift (descending), NB of them cover the row: the bin from the counts (exact);
    that bin compacted and searched with weight 1 (the NaNs and the keys above it counted whole). k at
    most the NaNs: sampling.NAN_CUT (only the NaNs kept, the torch cut at a NaN of any sign)."""
    span = kmax.to(tl.int64) - kmin.to(tl.int64)
    shift = tl.zeros((), tl.int64)
    while (span >> shift) >= NB:
        shift += 1
    hist = tl.zeros((NB,), tl.int32)
    nans = tl.zeros((SBLOCK,), tl.int32)
    for v0 in range(0, V, SBLOCK):
        mask, z = _chunk(x_row, v0, V, scale, SCALED, SBLOCK)
        hist += tl.histogram(_key_bin(order_key(z), kmax, shift), NB, mask=mask & (z == z))
        nans += (z != z).to(tl.int32)
    n_nan = tl.sum(nans, axis=0)
    jb = tl.sum((n_nan + tl.cumsum(hist, axis=0) < k).to(tl.int32), axis=0)  # the first bin reaching k
    above = n_nan.to(tl.int64) + tl.sum(tl.where(tl.arange(0, NB) < jb, hist, 0), axis=0).to(tl.int64)
    count = tl.zeros((), tl.int32)
    lo = tl.full((SBLOCK,), 2147483647, tl.int32)
    hi = tl.full((SBLOCK,), -2147483648, tl.int32)
    for v0 in range(0, V, SBLOCK):
        mask, z = _chunk(x_row, v0, V, scale, SCALED, SBLOCK)
        key = order_key(z)
        sel = mask & (z == z) & (_key_bin(key, kmax, shift) == jb)
        count, lo, hi = _compact(w_row, z, key, sel, count, lo, hi)
    tl.debug_barrier()  # the search reads values other threads wrote
    cut = key_search(w_row, count, tl.min(lo, axis=0).to(tl.int64) - 1, tl.max(hi, axis=0).to(tl.int64), above,
                      k.to(tl.float64), 0.0, False, WAYS, PAIR, BLOCK, SBLOCK)
    return tl.where(n_nan >= k, _NAN_CUT, cut)


@triton.jit
def d_bin(z, zm, BSCALE: tl.constexpr, NB: tl.constexpr):
    """The top-p bin of d = zm - z (z - zm is the mass's exponent, negated exactly), and whether d < D_RANGE
    (false for NaN and -inf: mass 0)."""
    d = zm - z
    inb = d < _D_RANGE
    return tl.minimum((tl.where(inb, d, 0.0) * BSCALE).to(tl.int32), NB - 1), inb


@triton.jit
def top_p_bins(x_row, bounds_ptr, scale, V, cut_k, zm, top_p, SCALED: tl.constexpr, NB: tl.constexpr,
                BSCALE: tl.constexpr, SBLOCK: tl.constexpr):
    """Pass B: the bound top_p * Q (Q the row's total mass over keys >= cut_k) and the counts per bin of d;
    with the table's mass bounds per bin, the bins ja..jb that can hold the cut."""
    hist = tl.zeros((NB,), tl.int32)
    tot = tl.zeros((SBLOCK,), tl.int64)
    for v0 in range(0, V, SBLOCK):
        mask, z = _chunk(x_row, v0, V, scale, SCALED, SBLOCK)
        b, inb = d_bin(z, zm, BSCALE, NB)
        inb = inb & mask & (order_key(z).to(tl.int64) >= cut_k)
        tot += weight_of(z, inb, zm, True)
        hist += tl.histogram(b, NB, mask=inb)
    bound = tl.sum(tot, axis=0).to(tl.float64) * top_p
    nbins = tl.arange(0, NB)
    hist64 = hist.to(tl.int64)
    upper = tl.cumsum(hist64 * tl.load(bounds_ptr + NB + nbins), axis=0)  # >= the exact mass of bins 0..j
    lower = tl.cumsum(hist64 * tl.load(bounds_ptr + nbins), axis=0)  # <= it
    ja = tl.sum((upper.to(tl.float64) < bound).to(tl.int32), axis=0)
    jb = tl.minimum(tl.sum((lower.to(tl.float64) < bound).to(tl.int32), axis=0), NB - 1)
    return bound, ja, jb


@triton.jit
def top_p_compact(x_row, w_row, scale, V, cut_k, zm, ja, jb, SCALED: tl.constexpr, NB: tl.constexpr,
                   BSCALE: tl.constexpr, SBLOCK: tl.constexpr):
    """Pass C: the exact mass of the bins before ja; the weighted values of bins ja..jb compacted to the front
    of the work row: (that mass, their count, the least key among them - 1, the greatest)."""
    above = tl.zeros((SBLOCK,), tl.int64)
    count = tl.zeros((), tl.int32)
    lo = tl.full((SBLOCK,), 2147483647, tl.int32)
    hi = tl.full((SBLOCK,), -2147483648, tl.int32)
    for v0 in range(0, V, SBLOCK):
        mask, z = _chunk(x_row, v0, V, scale, SCALED, SBLOCK)
        key = order_key(z)
        b, inb = d_bin(z, zm, BSCALE, NB)
        inb = inb & mask & (key.to(tl.int64) >= cut_k)
        w = weight_of(z, inb, zm, True)
        above += tl.where(b < ja, w, 0)
        sel = (b >= ja) & (b <= jb) & (w > 0)
        count, lo, hi = _compact(w_row, z, key, sel, count, lo, hi)
    tl.debug_barrier()  # the search reads values other threads wrote
    return tl.sum(above, axis=0), count, tl.min(lo, axis=0).to(tl.int64) - 1, tl.max(hi, axis=0).to(tl.int64)


@triton.jit
def _top_p_cut(x_row, w_row, bounds_ptr, scale, V, cut_k, zm, top_p, SCALED: tl.constexpr, NB: tl.constexpr,
               BSCALE: tl.constexpr, WAYS: tl.constexpr, PAIR: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr):
    """The least key whose mass above it is below top_p * Q, the masses of keys >= cut_k: pass B (the
    candidate bins), pass C (their values compacted), the key search over those values."""
    bound, ja, jb = top_p_bins(x_row, bounds_ptr, scale, V, cut_k, zm, top_p, SCALED, NB, BSCALE, SBLOCK)
    above, count, lo, hi = top_p_compact(x_row, w_row, scale, V, cut_k, zm, ja, jb, SCALED, NB, BSCALE, SBLOCK)
    return key_search(w_row, count, lo, hi, above, bound, zm, True, WAYS, PAIR, BLOCK, SBLOCK)


# --- top-p by an estimated window: one counts histogram, one exact pass, a key search over the window's values ---


@triton.jit
def _at(v, idx, j):
    """v[j] of a 1-D tensor as a scalar (0 where j is out of range)."""
    return tl.sum(tl.where(idx == j, v, 0), axis=0)


@triton.jit
def est_hist(x_row, scale, V, cut_k, anchor, SCALED: tl.constexpr, NE: tl.constexpr, ESCALE: tl.constexpr,
             SBLOCK: tl.constexpr):
    """The estimate's counts per bin around anchor (as row_stats's) of the values with keys >= cut_k: no mass."""
    hist = tl.zeros((NE,), tl.int32)
    for v0 in range(0, V, SBLOCK):
        mask, z = _chunk(x_row, v0, V, scale, SCALED, SBLOCK)
        b, inb = _anchor_bin(z, anchor, ESCALE, NE)
        hist += tl.histogram(b, NE, mask=inb & mask & (order_key(z).to(tl.int64) >= cut_k))
    return hist


@triton.jit
def est_offset(zm, anchor):
    """The distance d = zm - z at the estimate's bin 0's lower edge: bin j spans [off + j / ESCALE, off + (j + 1) /
    ESCALE) of d."""
    return (zm - anchor) - _EST_SHIFT


@triton.jit
def _est_bin(d, off, ESCALE: tl.constexpr, NE: tl.constexpr):
    """Distance d (clamped to [0, D_RANGE]) in bin units from the estimate's bin 0, and its bin."""
    u = (tl.minimum(tl.maximum(d, 0.0), _D_RANGE) - off) * ESCALE
    return u, tl.minimum(tl.maximum(u, 0.0).to(tl.int32), NE - 1)


@triton.jit
def _est_mass_at(d, bm, cm, off, idx, ESCALE: tl.constexpr, NE: tl.constexpr):
    """The estimated mass (the max's = 1) of the values with distance <= d: each bin's mass bm spread over it as
    values spread evenly over it would be."""
    _u, j = _est_bin(d, off, ESCALE, NE)
    a = j.to(tl.float32) / ESCALE + off
    dd = tl.minimum(tl.maximum(d, a), a + 1.0 / ESCALE)
    part = _at(bm, idx, j) * (1.0 - tl.exp(a - dd)) / (1.0 - tl.exp(-1.0 / ESCALE))
    return tl.where(d < 0.0, 0.0, _at(cm, idx, j - 1) + part)


@triton.jit
def _est_d_at_mass(t, bm, cm, off, idx, ESCALE: tl.constexpr, NE: tl.constexpr):
    """The distance at which the estimated mass reaches t (inverse of _est_mass_at within the bin that crosses t)."""
    j = tl.minimum(tl.sum((cm < t).to(tl.int32), axis=0), NE - 1)
    a = j.to(tl.float32) / ESCALE + off
    frac = tl.minimum(tl.maximum((t - _at(cm, idx, j - 1)) / tl.maximum(_at(bm, idx, j), 1e-30), 0.0), 1.0)
    return a - tl.log(tl.maximum(1.0 - frac * (1.0 - tl.exp(-1.0 / ESCALE)), tl.exp(-1.0 / ESCALE)))


@triton.jit
def _est_rank_at(d, h, cn, off, idx, ESCALE: tl.constexpr, NE: tl.constexpr):
    """The estimated count of values with distance <= d."""
    u, j = _est_bin(d, off, ESCALE, NE)
    frac = tl.minimum(tl.maximum(u - j.to(tl.float32), 0.0), 1.0)
    return tl.where(d < 0.0, 0.0, _at(cn, idx, j - 1).to(tl.float32) + _at(h, idx, j) * frac)


@triton.jit
def _est_d_at_rank(r, h, cn, off, idx, ESCALE: tl.constexpr, NE: tl.constexpr):
    """The distance of the r-th value by the estimate: -1 at r <= 0 (above every value), 1e30 past the last."""
    j = tl.sum((cn.to(tl.float32) <= r).to(tl.int32), axis=0)
    u = j.to(tl.float32) + (r - _at(cn, idx, j - 1).to(tl.float32)) / tl.maximum(_at(h, idx, j), 1.0)
    return tl.where(r <= 0.0, -1.0, tl.where(j >= NE, 1e30, u / ESCALE + off))


@triton.jit
def window_pass(x_row, w_row, cnt_ptr, scale, V, cut_k, zm, d_lo, d_hi, EXACT: tl.constexpr, HAS_K: tl.constexpr,
                SCALED: tl.constexpr, SBLOCK: tl.constexpr):
    """One pass: the values with d_lo < d <= d_hi (and mass possible; HAS_K: keys >= cut_k, the top-k cut) appended
    to the work row at positions from an atomic counter (their order varies; the key search's sums and min / max
    do not); EXACT: also the row's total mass and the mass of the values with d <= d_lo. (total, above, count)."""
    tot = tl.zeros((SBLOCK,), tl.int64)
    above = tl.zeros((SBLOCK,), tl.int64)
    cnt = tl.zeros((SBLOCK,), tl.int32)
    for v0 in range(0, V, SBLOCK):
        mask, z = _chunk(x_row, v0, V, scale, SCALED, SBLOCK)
        d = zm - z
        inb = mask & (d < _D_RANGE)
        if HAS_K:
            inb = inb & (order_key(z).to(tl.int64) >= cut_k)
        if EXACT:
            w = weight_of(z, inb, zm, True)
            tot += w
            above += tl.where(d <= d_lo, w, 0)
        sel = inb & (d > d_lo) & (d <= d_hi)
        pos = tl.atomic_add(cnt_ptr + tl.zeros((SBLOCK,), tl.int32), 1, mask=sel, sem="relaxed")
        tl.store(w_row + pos, z, mask=sel)
        cnt += sel.to(tl.int32)
    tl.debug_barrier()  # the window's values are read by other threads
    return tl.sum(tot, axis=0), tl.sum(above, axis=0), tl.sum(cnt, axis=0)


@triton.jit
def window_stats(buf, n, zm, BLOCK: tl.constexpr):
    """The exact mass of the work row's first n values, their least key - 1 and their greatest key (the key
    search's bounds; INT32_MAX - 1 and INT32_MIN for none)."""
    acc = tl.zeros((BLOCK,), tl.int64)
    lo = tl.full((BLOCK,), 2147483647, tl.int32)
    hi = tl.full((BLOCK,), -2147483648, tl.int32)
    for v0 in range(0, n, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(buf + cols, mask=cols < n, other=float("-inf"))
        key = order_key(z)
        acc += weight_of(z, cols < n, zm, True)
        lo = tl.where(cols < n, tl.minimum(lo, key), lo)
        hi = tl.where(cols < n, tl.maximum(hi, key), hi)
    return tl.sum(acc, axis=0), tl.min(lo, axis=0).to(tl.int64) - 1, tl.max(hi, axis=0).to(tl.int64)


@triton.jit
def _spacing_at(dh, zm, scale, ULP: tl.constexpr):
    """The spacing in d of the input's values around distance dh: the raw value there, (zm - dh) / scale, its
    power of 2 (its fp32 exponent bits kept) times ULP (value_spacing), times scale; 0 where that value is 0,
    subnormal in fp32 or not finite."""
    e = ((zm - dh) / scale).to(tl.int32, bitcast=True) & 0x7F800000
    return tl.where(e == 0x7F800000, 0.0, e.to(tl.float32, bitcast=True) * ULP * scale)


@triton.jit
def _est_window(dh, r_half, h, cn, off, idx, zm, scale, ESCALE: tl.constexpr, NE: tl.constexpr, DMIN,
                ULP: tl.constexpr):
    """(d_lo, d_hi) around the estimated cut distance dh: r_half estimated values each side, at least DMIN (the
    estimate's error over a continuum of values) plus, ULP > 0, the spacing of the input's values there
    (_spacing_at: the nearest value to the estimate may be that far)."""
    r = _est_rank_at(dh, h, cn, off, idx, ESCALE, NE)
    dmin = DMIN
    if ULP > 0:
        dmin = dmin + _spacing_at(dh, zm, scale, ULP)
    d_lo = tl.minimum(_est_d_at_rank(r - r_half, h, cn, off, idx, ESCALE, NE), dh - dmin)
    d_hi = tl.maximum(_est_d_at_rank(r + r_half, h, cn, off, idx, ESCALE, NE), dh + dmin)
    return d_lo, d_hi


@triton.jit
def est_points(pts_row, zl, zc, every, anchor, zm, hist, off, ESCALE: tl.constexpr, NE: tl.constexpr):
    """Each bin's estimated mass (the max's = 1; bin j spanning [off + j / ESCALE, off + (j + 1) / ESCALE) of d) with
    the row's lane maxima zl (a lane's greatest value: exact values of the row, most of its top) at their own
    masses and the bin's other values spread evenly over it, and each bin's estimated count. hist counts the
    values of every `every`-th chunk (row_stats); the lane maxima met in those chunks (zc, each one's chunk) are
    among them, so the others there are hist less those, exactly, and stand for `every` times as many. The lane
    maxima's masses (in fixed point, 2**-20), counts and counts in the counted chunks are summed per bin by integer
    atomics into pts_row (3 * NE zeros): any order, the same sums. (masses, counts) per bin."""
    idx = tl.arange(0, NE)
    b, inb = _anchor_bin(zl, anchor, ESCALE, NE)
    tl.atomic_add(pts_row + b, (tl.exp(tl.minimum(zl - zm, 0.0)) * 1048576.0).to(tl.int32), mask=inb, sem="relaxed")
    tl.atomic_add(pts_row + NE + b, 1, mask=inb, sem="relaxed")
    tl.atomic_add(pts_row + 2 * NE + b, 1, mask=inb & (zc % every == 0), sem="relaxed")
    tl.debug_barrier()  # every lane's sum is in before the bins are read
    pm = tl.atomic_add(pts_row + idx, tl.zeros((NE,), tl.int32), sem="relaxed").to(tl.float32) * (1.0 / 1048576.0)
    pn = tl.atomic_add(pts_row + NE + idx, tl.zeros((NE,), tl.int32), sem="relaxed")
    ps = tl.atomic_add(pts_row + 2 * NE + idx, tl.zeros((NE,), tl.int32), sem="relaxed")
    others = tl.maximum(hist - ps, 0) * every
    return est_spread(others, off, NE, ESCALE) + pm, others + pn


@triton.jit
def est_spread(hist, off, NE: tl.constexpr, ESCALE: tl.constexpr):
    """Each bin's estimated mass (as est_points's) with its counted values spread evenly over it."""
    idx = tl.arange(0, NE)
    return hist.to(tl.float32) * ESCALE * tl.exp(-(idx.to(tl.float32) / ESCALE + off)) * (1.0 - tl.exp(-1.0 / ESCALE))


@triton.jit
def est_window(hist, bm, top_p, off, zm, scale, NE: tl.constexpr, ESCALE: tl.constexpr, RANK,
               DMIN, ULP: tl.constexpr):
    """The first window (d_lo, d_hi) around the distance where the estimated mass (bm per bin) reaches top_p * Q."""
    idx = tl.arange(0, NE)
    cm = tl.cumsum(bm, axis=0)
    dh = _est_d_at_mass(top_p.to(tl.float32) * tl.max(cm, axis=0), bm, cm, off, idx, ESCALE, NE)
    return _est_window(dh, RANK, hist.to(tl.float32), tl.cumsum(hist, axis=0), off, idx, zm, scale, ESCALE, NE,
                       DMIN, ULP)


@triton.jit
def window_first(x_row, w_row, cnt_row, scale, V, cut_k, zm, top_p, hist, bm, off, HAS_K: tl.constexpr,
                 SCALED: tl.constexpr, NE: tl.constexpr, ESCALE: tl.constexpr, RANK, DMIN,
                 ULP: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr):
    """The top-p cut's first window: counts over NE bins of d (hist, bin j spanning [off + j / ESCALE, off + (j + 1) /
    ESCALE)) and the bins' estimated masses bm estimate where the mass reaches top_p * Q; one exact pass sums Q and
    the mass above a window of d around that estimate, and compacts the window's values. (Q, the mass above the
    window, above it plus the window's, the window's count, its least key - 1, its greatest, d_lo, d_hi): the
    window holds the cut when above < top_p * Q <= upto."""
    d_lo, d_hi = est_window(hist, bm, top_p, off, zm, scale, NE, ESCALE, RANK, DMIN, ULP)
    tot, above, count = window_pass(x_row, w_row, cnt_row, scale, V, cut_k, zm, d_lo, d_hi, True, HAS_K, SCALED,
                                    SBLOCK)
    win, klo, khi = window_stats(w_row, count, zm, BLOCK)
    return tot, above, above + win, count, klo, khi, d_lo, d_hi


@triton.jit
def window_retry(x_row, w_row, cnt_row, bounds_ptr, scale, V, cut_k, zm, top_p, hist, bm, off, bound, above, upto,
                 d_lo, d_hi, HAS_K: tl.constexpr, SCALED: tl.constexpr, NB: tl.constexpr, BSCALE: tl.constexpr,
                 NE: tl.constexpr, ESCALE: tl.constexpr, RANK, DMIN, ULP: tl.constexpr,
                 RETRIES: tl.constexpr, WAYS: tl.constexpr, PAIR: tl.constexpr, BLOCK: tl.constexpr,
                 SBLOCK: tl.constexpr):
    """The top-p cut of a row whose first window (d_lo, d_hi], with the exact masses above it and up to its end,
    missed top_p * Q (= bound): up to RETRIES windows adjacent to the last one (their edge's mass is exact: only
    their values' masses are summed), estimated again from that exact edge; past them, the exact bins of
    _top_p_cut. (cut, the window passes made: 1 + the retries, one more when the exact bins found the cut.)"""
    idx = tl.arange(0, NE)
    h = hist.to(tl.float32)
    cm = tl.cumsum(bm, axis=0)
    cn = tl.cumsum(hist, axis=0)
    tries = tl.zeros((), tl.int32)
    count = tl.zeros((), tl.int32)
    klo = tl.zeros((), tl.int64)
    khi = tl.zeros((), tl.int64)
    for _ in range(RETRIES):
        if (above.to(tl.float64) >= bound) | (upto.to(tl.float64) < bound):
            tries += 1
            deeper = upto.to(tl.float64) < bound
            r_half = RANK * (2 << tries) * 0.5
            # the estimate anchored at the exact edge: the mass still missing (deeper) or in excess (above)
            edge = tl.where(deeper, d_hi, d_lo)
            gap = tl.where(deeper, bound - upto.to(tl.float64), bound - above.to(tl.float64))
            t = _est_mass_at(edge, bm, cm, off, idx, ESCALE, NE) + (gap * (1.0 / _MASS_SCALE)).to(tl.float32)
            dh = _est_d_at_mass(t, bm, cm, off, idx, ESCALE, NE)
            w_lo, w_hi = _est_window(dh, r_half, h, cn, off, idx, zm, scale, ESCALE, NE, DMIN, ULP)
            n_lo = tl.where(deeper, d_hi, tl.minimum(w_lo, d_lo))
            n_hi = tl.where(deeper, tl.maximum(w_hi, d_hi), d_lo)
            tl.debug_barrier()  # the work row and the counter are reused
            _t, _a, count = window_pass(x_row, w_row, cnt_row + tries, scale, V, cut_k, zm, n_lo, n_hi, False, HAS_K,
                                        SCALED, SBLOCK)
            win, klo, khi = window_stats(w_row, count, zm, BLOCK)
            above, upto = tl.where(deeper, upto, above - win), tl.where(deeper, upto + win, above)
            d_lo, d_hi = n_lo, n_hi
    # RETRIES 0: the first window missed (the only rows this runs for), no window holds the cut; no key search over
    # an empty one is compiled
    if (RETRIES > 0) & (above.to(tl.float64) < bound) & (upto.to(tl.float64) >= bound):
        cut = key_search(w_row, count, klo, khi, above, bound, zm, True, WAYS, PAIR, BLOCK, SBLOCK)
        passes = tries + 1
    else:
        tl.debug_barrier()
        cut = _top_p_cut(x_row, w_row, bounds_ptr, scale, V, cut_k, zm, top_p, SCALED, NB, BSCALE, WAYS, PAIR, BLOCK,
                         SBLOCK)
        passes = tries + 2
    return cut, passes


# The launches' row state between the first kernel and the window's search / retry (int64 and fp32 tables per row)
N_STATE, N_FSTATE = 7, 4
_S_TOT, _S_ABOVE, _S_UPTO, _S_COUNT, _S_KLO, _S_KHI, _S_CUTK = (tl.constexpr(i) for i in range(N_STATE))
_F_ZM, _F_OFF, _F_DLO, _F_DHI = (tl.constexpr(i) for i in range(N_FSTATE))
_N_STATE, _N_FSTATE = tl.constexpr(N_STATE), tl.constexpr(N_FSTATE)
# a row's passes after the first kernel: 0 done (no top-p, or a row without mass), 1 its first window holds the
# cut (the search kernel finds it), WINDOW_MISSED the retry kernel's (it writes the passes made)
WINDOW_MISSED = -1
_WINDOW_MISSED = tl.constexpr(WINDOW_MISSED)


@triton.jit(do_not_specialize=["top_k", "top_p_bits"])
def _first_kernel(z_ptr, work_ptr, cnt_ptr, cut_ptr, passes_ptr, state_ptr, fstate_ptr, hist_ptr, bm_ptr, pts_ptr,
                  scale, V, top_k, top_p_bits, SCALED: tl.constexpr, HIST: tl.constexpr, DO_K: tl.constexpr,
                  DO_P: tl.constexpr, NB: tl.constexpr, NE: tl.constexpr, ESCALE: tl.constexpr, RANK,
                  DMIN, ULP: tl.constexpr, RETRIES: tl.constexpr, NCHUNK: tl.constexpr, WAYS: tl.constexpr,
                  PAIR: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr):
    """A row's top-k cut, and for top-p its first window (window_first), the row's state kept for the search and
    retry kernels. Top-p over a row whose masses are all 0 (its max +inf or -inf) or holding a NaN: the torch
    search's answer there, the key of the row's max (torch's max of a row with a NaN is NaN: the canonical quiet
    NaN's key, sampling.NAN_CUT, whatever the NaN's sign: only the NaNs kept)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = z_ptr + row * V
    w_row = work_ptr + row * V
    zm, kmin, kmax, nan, hist, anchor, zl, zc, every = row_stats(x_row, scale, V, SCALED, HIST, DO_K, NE, ESCALE,
                                                                  NCHUNK, SBLOCK)
    cut = tl.full((), _KEEP_ALL, tl.int64)
    passes = tl.zeros((), tl.int32)
    if DO_K:
        cut = _top_k_cut(x_row, w_row, scale, V, top_k, kmin, kmax, SCALED, NB, WAYS, PAIR, BLOCK, SBLOCK)
    if DO_P:
        tl.debug_barrier()  # the work row is reused
        flat = (nan > 0) | (zm == float("inf")) | (zm == float("-inf"))
        if flat:
            cut = tl.where(nan > 0, _NAN_CUT, order_key(zm)).to(tl.int64)
        else:
            if DO_K:  # the estimate's counts over the values top-k kept, spread evenly
                hist = est_hist(x_row, scale, V, cut, zm, SCALED, NE, ESCALE, SBLOCK)
                off = est_offset(zm, zm)
                bm = est_spread(hist, off, NE, ESCALE)
            else:  # the lane maxima at their own masses
                off = est_offset(zm, anchor)
                bm, hist = est_points(pts_ptr + row * 3 * NE, zl, zc, every, anchor, zm, hist, off, ESCALE, NE)
            top_p = top_p_bits.to(tl.float64, bitcast=True)
            tot, above, upto, count, klo, khi, d_lo, d_hi = window_first(
                x_row, w_row, cnt_ptr + row * (RETRIES + 1), scale, V, cut, zm, top_p, hist, bm, off, DO_K, SCALED,
                NE, ESCALE, RANK, DMIN, ULP, BLOCK, SBLOCK)
            bound = tot.to(tl.float64) * top_p
            passes = tl.where((above.to(tl.float64) < bound) & (upto.to(tl.float64) >= bound), 1, _WINDOW_MISSED)
            s_row = state_ptr + row * _N_STATE
            tl.store(s_row + _S_TOT, tot)
            tl.store(s_row + _S_ABOVE, above)
            tl.store(s_row + _S_UPTO, upto)
            tl.store(s_row + _S_COUNT, count.to(tl.int64))
            tl.store(s_row + _S_KLO, klo)
            tl.store(s_row + _S_KHI, khi)
            tl.store(s_row + _S_CUTK, cut)
            f_row = fstate_ptr + row * _N_FSTATE
            tl.store(f_row + _F_ZM, zm)
            tl.store(f_row + _F_OFF, off)
            tl.store(f_row + _F_DLO, d_lo)
            tl.store(f_row + _F_DHI, d_hi)
            tl.store(hist_ptr + row * NE + tl.arange(0, NE), hist)
            tl.store(bm_ptr + row * NE + tl.arange(0, NE), bm)
    tl.store(cut_ptr + row, cut)
    tl.store(passes_ptr + row, passes)


@triton.jit(do_not_specialize=["top_p_bits"])
def _window_kernel(z_ptr, work_ptr, cnt_ptr, cut_ptr, passes_ptr, state_ptr, fstate_ptr, hist_ptr, bm_ptr, bounds_ptr,
                   scale, V, top_p_bits, SEARCH: tl.constexpr, RETRY: tl.constexpr, HAS_K: tl.constexpr,
                   SCALED: tl.constexpr, NB: tl.constexpr, BSCALE: tl.constexpr, NE: tl.constexpr,
                   ESCALE: tl.constexpr, RANK, DMIN, ULP: tl.constexpr,
                   RETRIES: tl.constexpr, WAYS: tl.constexpr, PAIR: tl.constexpr, BLOCK: tl.constexpr,
                   SBLOCK: tl.constexpr):
    """After _first_kernel: SEARCH, the key search over the first window's values of the rows it holds the cut of;
    RETRY, window_retry for the rows it missed. Other rows return at once."""
    row = tl.program_id(0).to(tl.int64)
    passes = tl.load(passes_ptr + row)
    s_row = state_ptr + row * _N_STATE
    f_row = fstate_ptr + row * _N_FSTATE
    top_p = top_p_bits.to(tl.float64, bitcast=True)
    if SEARCH:
        if passes == 1:
            zm = tl.load(f_row + _F_ZM)
            bound = tl.load(s_row + _S_TOT).to(tl.float64) * top_p
            cut = key_search(work_ptr + row * V, tl.load(s_row + _S_COUNT).to(tl.int32), tl.load(s_row + _S_KLO),
                             tl.load(s_row + _S_KHI), tl.load(s_row + _S_ABOVE), bound, zm, True, WAYS, PAIR, BLOCK,
                             SBLOCK)
            tl.store(cut_ptr + row, cut)
    if RETRY:
        if passes == _WINDOW_MISSED:
            zm = tl.load(f_row + _F_ZM)
            bound = tl.load(s_row + _S_TOT).to(tl.float64) * top_p
            hist = tl.load(hist_ptr + row * NE + tl.arange(0, NE))
            bm = tl.load(bm_ptr + row * NE + tl.arange(0, NE))
            cut, passes = window_retry(z_ptr + row * V, work_ptr + row * V, cnt_ptr + row * (RETRIES + 1), bounds_ptr,
                                       scale, V, tl.load(s_row + _S_CUTK), zm, top_p, hist, bm, tl.load(f_row + _F_OFF),
                                       bound, tl.load(s_row + _S_ABOVE), tl.load(s_row + _S_UPTO),
                                       tl.load(f_row + _F_DLO), tl.load(f_row + _F_DHI), HAS_K, SCALED, NB, BSCALE,
                                       NE, ESCALE, RANK, DMIN, ULP, RETRIES, WAYS, PAIR, BLOCK, SBLOCK)
            tl.store(cut_ptr + row, cut)
            tl.store(passes_ptr + row, passes)


# the launches after the first kernel: (SEARCH, RETRY) flags of each
WINDOW_LAUNCHES = ((True, False), (False, True))


def filter_cut(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, scale: float = 1.0,
               passes: torch.Tensor | None = None) -> torch.Tensor:
    """rlalign.kernels.sampling.filter_cut(rlalign.kernels.temper(z, scale), top_k, top_p) for z [B, V] in
    any float dtype, read in place: the cut [B] int64; the kept set of row r is {v : order_key(temper(z,
    scale))[r, v] >= cut[r]} plus its NaNs. KEEP_ALL (below every int32 key) where no filter applies.
    passes ([B] int32, optional): per row, the top-p window passes it took (0: none; 1: the estimated
    window held the cut; 2 .. EST_RETRIES + 1: adjacent windows; EST_RETRIES + 2: the exact bins found it).
    Top-p takes three launches (rows independent in each): the first window (and top-k's cut), the key search
    over it where it holds the cut, the retries where it does not; each launch's registers its own."""
    check_2d_float("filter_cut", z)
    B, V = z.shape
    do_k, do_p = bool(top_k) and top_k < V, top_p < 1.0
    if not (do_k or do_p) or B == 0:
        if passes is not None:
            passes.zero_()
        return torch.full((B,), KEEP_ALL, dtype=torch.long, device=z.device)
    if not sys.float_info.min <= top_p <= 1.0:
        raise ValueError(f"filter_cut: top_p={top_p} must be a normal float in (0, 1]")
    if do_p and V >= sampling.MAX_VOCAB:
        raise ValueError(f"filter_cut: top_p over a vocabulary of {V} (at most {sampling.MAX_VOCAB - 1})")
    if passes is not None and (passes.shape != (B,) or passes.dtype != torch.int32 or passes.device != z.device):
        raise ValueError(f"filter_cut: passes must be a [{B}] int32 tensor on {z.device}, got {tuple(passes.shape)} "
                         f"{passes.dtype} on {passes.device}")
    z = z.contiguous()
    dev = z.device
    work = torch.empty(B, V, dtype=torch.float32, device=dev)
    counters = torch.zeros(B, EST_RETRIES + 1, dtype=torch.int32, device=dev)  # one per window pass
    cut = torch.empty(B, dtype=torch.long, device=dev)
    row_passes = passes if passes is not None else torch.empty(B, dtype=torch.int32, device=dev)
    state = torch.empty(B, N_STATE, dtype=torch.long, device=dev)
    fstate = torch.empty(B, N_FSTATE, dtype=torch.float32, device=dev)
    hist = torch.empty(B, EST_BINS, dtype=torch.int32, device=dev)
    bm = torch.empty(B, EST_BINS, dtype=torch.float32, device=dev)
    # the lane maxima's masses, counts and counts in pass A's counted chunks, per bin
    points = torch.zeros(B, 3, EST_BINS, dtype=torch.int32, device=dev)
    nb = CUT_BINS  # a module constant (a benchmark may sweep it)
    top_p_bits = struct.unpack("<q", struct.pack("<d", top_p))[0]
    opts = {} if INTERPRET else dict(enable_fp_fusion=False, num_warps=CUT_WARPS)
    # the window's widths (EST_RANK, EST_DMIN) are fp32 arguments, not constexprs: every setting a test or benchmark
    # sweeps runs the kernel the product runs
    common_meta = dict(SCALED=scale != 1.0, NE=EST_BINS, ESCALE=est_scale(EST_BINS), RANK=float(EST_RANK),
                       DMIN=float(EST_DMIN), ULP=value_spacing(z.dtype), RETRIES=EST_RETRIES, WAYS=CUT_WAYS,
                       PAIR=PAIR_MAX, BLOCK=CUT_BLOCK, SBLOCK=CUT_STREAM, **opts)
    _first_kernel[(B,)](z, work, counters, cut, row_passes, state, fstate, hist, bm, points, scale, V, int(top_k),
                        top_p_bits, HIST=do_p and not do_k, DO_K=do_k, DO_P=do_p, NB=nb, NCHUNK=EST_CHUNKS,
                        **common_meta)
    if do_p:
        bounds = work_table(("topp_mass_bounds", nb), lambda: (list(mass_bounds(nb)), torch.long), dev)
        for search, retry in WINDOW_LAUNCHES:
            _window_kernel[(B,)](z, work, counters, cut, row_passes, state, fstate, hist, bm, bounds, scale, V,
                                 top_p_bits, SEARCH=search, RETRY=retry, HAS_K=do_k, NB=nb, BSCALE=bin_scale(nb),
                                 **common_meta)
    return cut
