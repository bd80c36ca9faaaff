"""The sampler's two kernels: the top-k/top-p filter and the Gumbel-max draw. Both take the tempered
logits rlalign.kernels.temper(logits, scale) from the logits in any float dtype, upcast (exact) and
scaled in registers (common.upcast_scaled): a step makes no separate fp32 copy of [B, V] and no pass
for the temperature. filter_logits writes the filtered fp32 copy from topp.filter_cut's cut per row (the kept set is
{order key >= cut} and NaN), which the draw and the logprob also apply to the logits as they read them
(common.apply_cut: the copy's bits, without writing or reading the copy).

threshold_filter_logits (the search topp.filter_cut replaced, kept as the benchmark's baseline): the same
bits, one program per row; its first pass writes the tempered values into its fp32 output: its search
levels read them there as they read an fp32 row. The row's
max and key range, then the threshold search, level by level: first FILTER_WAYS bins of equal width
in value, then FILTER_WAYS thresholds evenly spaced in the current key interval; each level's weights
in one pass, then the interval narrowed to the bin or the two thresholds around the answer and the
row's weighted values inside it compacted to the front of the output row (so later levels read only
those), until the interval holds one key; a last pass writes the kept values and -inf.
No sort; every sum is of integers (counts, integer masses), so the cut is the torch function's.

Gumbel-max sampling fused into one kernel: per row, the noise of rlalign.kernels.sampling (a
splitmix64 hash of (seed, sample id, position, vocab index) -> u exact in fp32 -> -log(-log u)
with fixed_order.log's add/mul/div formula) added to the tempered, filtered logits z, and the first
index of the maximum — the token `first_argmax(z + gumbel(...))` draws, bit for bit (checked
against it on the GPU and under the interpreter), without the ~40 elementwise passes over [B, V]
of the torch formulation. One program per row; each of DRAW_BLOCK lanes keeps its best column, one
reduction at the end.
Compiled without FMA contraction (enable_fp_fusion=False): every add and mul rounds on its own, as
in torch's elementwise kernels; divisions are IEEE (div_rn)."""

from __future__ import annotations

import math
import struct
import sys

import torch
import triton
import triton.language as tl

from rlalign.kernels import fixed_order as fo
from rlalign.kernels import sampling

from .common import INTERPRET, ROW_BLOCK, apply_cut, upcast_scaled
from .common import order_key as _order_key
from .logprob import row_lse

U64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
DRAW_BLOCK = 512  # the draw's lanes (4 warps, 4 columns a thread), each keeping its own best over the chunks
FILTER_BLOCK, FILTER_WAYS = 256, 16  # a search level holds [FILTER_WAYS, FILTER_BLOCK] comparisons
FILTER_STREAM = 2048  # the chunk of the passes that only stream the row (max, compaction, the output)
# [WAYS, BLOCK]: a lane's ways sit in its own registers (no shuffle through shared memory to sum a level)
FILTER_WARPS = 8  # warps of a row's program


@triton.jit
def mix64(x, golden, mix1, mix2):
    x = x + golden
    x = (x ^ (x >> 30)) * mix1
    x = (x ^ (x >> 27)) * mix2
    return x ^ (x >> 31)


@triton.jit
def fo_log(x, SQRT2: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
         C4: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr):
    """fixed_order.log for positive normal fp32 x (what the sampler feeds it)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > SQRT2
    m = tl.where(big, m * 0.5, m)
    ef = (e + big.to(tl.int32)).to(tl.float32)
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    s2 = s * s
    p = tl.full(s.shape, C0, tl.float32)
    p = p * s2 + C1
    p = p * s2 + C2
    p = p * s2 + C3
    p = p * s2 + C4
    log_m = (p * s2) * s + 2.0 * s
    return ef * LN2_HI + (log_m + ef * LN2_LO)


@triton.jit
def _pow2(k):
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exp(x, LOG2E: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, E0: tl.constexpr, E1: tl.constexpr,
         E2: tl.constexpr, E3: tl.constexpr, E4: tl.constexpr, E5: tl.constexpr):
    """fixed_order.exp for x <= 0 (or NaN): round half to even by the 1.5 * 2**23 shift (|x * log2 e| < 2**22)."""
    xc = tl.where(x < -104.0, -104.0, x)
    n = (xc * LOG2E + 12582912.0) - 12582912.0
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = tl.full(r.shape, E0, tl.float32)
    p = p * r + E1
    p = p * r + E2
    p = p * r + E3
    p = p * r + E4
    p = p * r + E5
    p = (p * r + 1.0) * r + 1.0
    n1 = tl.floor(n * 0.5)
    y = (p * _pow2(n1)) * _pow2(n - n1)
    return tl.where(x < -104.0, 0.0, y)


@triton.jit
def _weight(z, inside, zm, IS_P: tl.constexpr, LOG2E: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr,
            E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr, E4: tl.constexpr,
            E5: tl.constexpr, SCALE: tl.constexpr):
    """top-p: the integer mass (kernels.sampling.top_p_mass); top-k: 1; 0 outside the search."""
    if IS_P:
        e = _exp(z - zm, LOG2E, LN2_HI, LN2_LO, E0, E1, E2, E3, E4, E5) * SCALE
        return tl.where(inside & (e >= 1.0), tl.floor(e), 0.0).to(tl.int64)
    return inside.to(tl.int64)


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
            w = _weight(z, (cols < V) & (key > lo) & (key <= hi), zm, IS_P, LOG2E, LN2_HI, LN2_LO, E0, E1, E2,
                        E3, E4, E5, SCALE)
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
            w = _weight(z, (cols < V) & (key.to(tl.int64) > lo) & (key.to(tl.int64) <= hi), zm, IS_P, LOG2E,
                        LN2_HI, LN2_LO, E0, E1, E2, E3, E4, E5, SCALE)
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
            w = _weight(z, (cols < n) & (key.to(tl.int64) > lo) & (key.to(tl.int64) <= hi), zm, IS_P, LOG2E,
                        LN2_HI, LN2_LO, E0, E1, E2, E3, E4, E5, SCALE)
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
                sel = _weight(z, (cols < n) & (key > lo) & (key <= hi), zm, IS_P, LOG2E, LN2_HI, LN2_LO, E0, E1,
                              E2, E3, E4, E5, SCALE) > 0
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



@triton.jit(do_not_specialize=["seed"])  # a seed of 1 would otherwise become a constant
def gumbel_argmax_kernel(z_ptr, ids_ptr, pos_ptr, out_ptr, lp_ptr, cut_ptr, seed, golden, mix1, mix2, scale, V,
                          SCALED: tl.constexpr, LOGPROB: tl.constexpr, CUT: tl.constexpr, SQRT2: tl.constexpr,
                          C0: tl.constexpr,
                          C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                          LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, DRAW_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """The draw: each of DRAW_BLOCK lanes keeps the best value of its columns and the first column holding
    it, one reduction at the end (the first index of the row's maximum: the least of the lanes' firsts).
    LOGPROB: also the drawn token's logprob, logprob._logprob_fwd's bits: the row's max taken in the draw's
    pass, then logprob.row_lse (the trainer's sum, its BLOCK and loads) and the gather.
    CUT: the row's values filtered by its cut (common.apply_cut) in registers, every read (the draw's, the
    sum's, the gather's): the bits the filtered fp32 copy holds."""
    row = tl.program_id(0).to(tl.int64)
    cut = tl.zeros((), tl.int64)
    if CUT:
        cut = tl.load(cut_ptr + row)
    sid = tl.load(ids_ptr + row).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
    h = mix64(seed.to(tl.int64).to(tl.uint64, bitcast=True), golden, mix1, mix2)
    h = mix64(h ^ sid, golden, mix1, mix2)
    h = mix64(h ^ pos, golden, mix1, mix2)
    best = tl.full((DRAW_BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((DRAW_BLOCK,), V, tl.int32)
    nan = tl.zeros((DRAW_BLOCK,), tl.int32)
    zmax = tl.full((DRAW_BLOCK,), float("-inf"), tl.float32)
    for v0 in range(0, V, DRAW_BLOCK):
        cols = v0 + tl.arange(0, DRAW_BLOCK)
        mask = cols < V
        z = upcast_scaled(tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")), scale, SCALED)
        if CUT:
            z = apply_cut(z, cut)
        if LOGPROB:
            zmax = tl.maximum(zmax, z)
        hv = mix64(h ^ cols.to(tl.uint64), golden, mix1, mix2)
        u = ((hv >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        g = -fo_log(-fo_log(u, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO), SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO)
        x = tl.where(mask, z + g, float("-inf"))
        nan = tl.maximum(nan, (x != x).to(tl.int32))
        x = tl.where(x != x, float("-inf"), x)
        take = x > best  # strictly greater: a lane keeps the first column of its maximum
        best_i = tl.where(take, cols, best_i)
        best = tl.where(take, x, best)
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, best_i, V), axis=0)
    tok = tl.where((tl.max(nan, axis=0) > 0) | (m == float("-inf")), V, first)
    tl.store(out_ptr + row, tok)
    if LOGPROB:
        lse = row_lse(z_ptr, row, V, tl.max(zmax, axis=0), scale, SCALED, BLOCK, cut, CUT)
        zt = upcast_scaled(tl.load(z_ptr + row * V + tl.minimum(tok, V - 1)), scale, SCALED)
        if CUT:
            zt = apply_cut(zt, cut)
        tl.store(lp_ptr + row, zt - lse)


LOG_CONST = dict(SQRT2=fo.SQRT2, C0=fo.ATANH_COEFFS[0], C1=fo.ATANH_COEFFS[1], C2=fo.ATANH_COEFFS[2],
              C3=fo.ATANH_COEFFS[3], C4=fo.ATANH_COEFFS[4], LN2_HI=fo.LN2_HI, LN2_LO=fo.LN2_LO)
assert len(fo.ATANH_COEFFS) == 5 and sampling.UNIFORM_BITS == 23 and math.isclose(fo.SQRT2, 2 ** 0.5)


_EXP_CONST = dict(LOG2E=fo.LOG2E, LN2_HI=fo.LN2_HI, LN2_LO=fo.LN2_LO,
                  **{f"E{i}": c for i, c in enumerate(fo.EXP_COEFFS)})
assert len(fo.EXP_COEFFS) == 6
mass_weight, EXP_CONST = _weight, _EXP_CONST  # shared with topp.py's cut search (the same mass formula)


def check_2d_float(name: str, z: torch.Tensor) -> None:
    if z.dtype not in (torch.float32, torch.bfloat16, torch.float16) or z.dim() != 2:
        raise TypeError(f"triton {name}: z must be a 2-D float tensor (fp32, bf16, fp16), got {z.dtype} "
                        f"{tuple(z.shape)}")


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
                         SBLOCK=FILTER_STREAM, **_EXP_CONST, **opts)
    return (out if write else None), cut


def filter_logits(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, scale: float = 1.0) -> torch.Tensor:
    """rlalign.kernels.sampling.filter_logits(rlalign.kernels.temper(z, scale), top_k, top_p) (the same
    kept set, the same bits) for z [B, V] in any float dtype, read in place: fp32 [B, V]. The cut from
    topp.filter_cut, then one pass writes the kept values and -inf."""
    from .topp import apply_cut, filter_cut

    check_2d_float("filter_logits", z)
    if not ((bool(top_k) and top_k < z.shape[1]) or top_p < 1.0) or z.shape[0] == 0:
        return sampling.temper(z, scale)
    return apply_cut(z, filter_cut(z, top_k, top_p, scale), scale)


def threshold_filter_logits(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, scale: float = 1.0) -> torch.Tensor:
    """filter_logits's kept set and bits by _filter_kernel, the threshold search over an fp32 copy (a 16-way
    first level of int64 masses): the baseline experiments/kernels/bench_topp_cut.py times."""
    check_2d_float("filter_logits", z)
    if not ((top_k and top_k < z.shape[1]) or top_p < 1.0) or z.shape[0] == 0:
        return sampling.temper(z, scale)
    return _filter(z, top_k, top_p, scale, True)[0]


def _draw(z, seed, sample_ids, positions, scale, logprobs: bool, cut):
    check_2d_float("gumbel_argmax", z)
    B, V = z.shape
    out = torch.empty(B, dtype=torch.long, device=z.device)
    lp = torch.empty(B if logprobs else 0, dtype=torch.float32, device=z.device)
    if B:
        z = z.contiguous()
        ids = sample_ids.to(device=z.device, dtype=torch.long).contiguous()
        pos = positions.to(device=z.device, dtype=torch.long).contiguous()
        s64 = (seed & U64) - (1 << 64) if (seed & U64) >= (1 << 63) else seed & U64
        opts = {} if INTERPRET else dict(enable_fp_fusion=False)
        cuts = out if cut is None else cut.to(device=z.device, dtype=torch.long).contiguous()
        gumbel_argmax_kernel[(B,)](z, ids, pos, out, lp if logprobs else out, cuts, s64, GOLDEN, MIX1, MIX2, scale,
                                    V, SCALED=scale != 1.0, LOGPROB=logprobs, CUT=cut is not None,
                                    DRAW_BLOCK=DRAW_BLOCK,
                                    BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), **LOG_CONST, **opts)
    torch._assert_async(((out >= 0) & (out < V)).all(),
                        "sample: a row has no finite maximum (NaN or all -inf logits); no token can be drawn")
    return out, lp


def gumbel_argmax(z: torch.Tensor, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                  scale: float = 1.0, cut: torch.Tensor | None = None) -> torch.Tensor:
    """first_argmax(temper(z, scale) + gumbel(seed, sample_ids, positions, V)) for z [B, V] in any float
    dtype (rlalign.kernels.temper: read in place, upcast and scaled in registers): the token ids [B]
    (int64); a row with NaN or no finite value is the same device-side error as first_argmax's. With cut
    (int64 [B], filter_cut's), of sampling.apply_cut(temper(z, scale), cut): filter_logits's output's tokens."""
    return _draw(z, seed, sample_ids, positions, scale, False, cut)[0]


def gumbel_argmax_logprobs(z: torch.Tensor, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                           scale: float = 1.0, cut: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprob.tempered_logprobs(z, scale, tokens, cut)) for tokens = gumbel_argmax(z, ..., cut), the
    same bits, in one launch: the draw's pass over the row also takes the row's max for the logprob."""
    return _draw(z, seed, sample_ids, positions, scale, True, cut)
