"""Where the estimated-window top-p cut's time goes (kernels/triton/topp.py): its steps as cumulative kernels
(A: the row's max and keys; A with the estimate's counts histogram; + the window's exact pass; the whole cut), each
step's variants timed apart (the histogram's bins; the exact pass without its mass, without its compaction,
with the converting mass formula (topp.weight_of's before) against the integer-exponent one, summed in fp64 or
int64 and checked bit for bit; the compaction's store right after its atomic or a chunk later), and the whole
cut at other warps and chunk sizes.

    python experiments/kernels/probe_topp_window.py [--rows 1024] [--vocab 151936] [--out DIR]

Logits: bf16 normal(0, 1) (flat), normal(0, 4) (peaked), student-t(3) (one dominant value: a window of a few
values); top-p 0.95, T 0.8. Writes results/probe_topp_window_<gpu>.json.
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign.kernels import fixed_order as fo  # noqa: E402
from rlalign.kernels import inverse_temperature  # noqa: E402
from rlalign.kernels.triton import common, topp  # noqa: E402

_LOG2E, _LN2_HI, _LN2_LO = tl.constexpr(fo.LOG2E), tl.constexpr(fo.LN2_HI), tl.constexpr(fo.LN2_LO)
_E0, _E1, _E2, _E3, _E4, _E5 = (tl.constexpr(c) for c in fo.EXP_COEFFS)


@triton.jit
def _pow2(k):
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mass_converting(z, inside, zm):
    """The top-p mass with fixed_order.exp's 2**n from float-to-int conversions of n and floor(n / 2) (the form
    topp.weight_of replaced), as fp32."""
    x = z - zm
    xc = tl.where(x < -104.0, -104.0, x)
    n = (xc * _LOG2E + 12582912.0) - 12582912.0
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = tl.full(r.shape, _E0, tl.float32)
    p = p * r + _E1
    p = p * r + _E2
    p = p * r + _E3
    p = p * r + _E4
    p = p * r + _E5
    p = (p * r + 1.0) * r + 1.0
    n1 = tl.floor(n * 0.5)
    e = tl.where(x < -104.0, 0.0, (p * _pow2(n1)) * _pow2(n - n1)) * 4294967296.0
    return tl.where(inside & (e >= 1.0), tl.floor(e), 0.0)


@triton.jit
def _phases(z_ptr, work_ptr, cnt_ptr, out_ptr, scale, V, top_p_bits, SCALED: tl.constexpr, PHASE: tl.constexpr,
            HIST: tl.constexpr, NE: tl.constexpr, ESCALE: tl.constexpr, RANK: tl.constexpr, DMIN: tl.constexpr,
            SBLOCK: tl.constexpr):
    """out[row] = (zm, histogram total, d_lo, d_hi, window count) as far as PHASE gets (HIST: PHASE >= 2, the
    estimate's counts in pass A)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = z_ptr + row * V
    zm, kmin, kmax, nan, hist, anchor, _zl = topp.row_stats(x_row, scale, V, SCALED, HIST, True, NE, ESCALE, SBLOCK)
    tl.store(out_ptr + row * 5, zm)
    if PHASE >= 2:
        tl.store(out_ptr + row * 5 + 1, tl.sum(hist, axis=0).to(tl.float32))
        if PHASE >= 3:
            off = topp.est_offset(zm, anchor)
            bm = topp.est_spread(hist, off, NE, ESCALE)
            d_lo, d_hi = topp.est_window(hist, bm, top_p_bits.to(tl.float64, bitcast=True), off, NE, ESCALE, RANK,
                                         DMIN)
            tot, above, count = topp.window_pass(x_row, work_ptr + row * V, cnt_ptr + row, scale, V,
                                                 kmin.to(tl.int64), zm, d_lo, d_hi, True, True, SCALED, SBLOCK)
            tl.store(out_ptr + row * 5 + 2, d_lo)
            tl.store(out_ptr + row * 5 + 3, d_hi)
            tl.store(out_ptr + row * 5 + 4, count.to(tl.float32) + (tot + above).to(tl.float32) * 0.0)


@triton.jit
def _hist_variant(z_ptr, zm_ptr, out_ptr, scale, V, SCALED: tl.constexpr, NE: tl.constexpr, ESCALE: tl.constexpr,
                  SBLOCK: tl.constexpr):
    """One pass of the estimate's histogram over NE bins (NE 0: the pass without a histogram)."""
    row = tl.program_id(0).to(tl.int64)
    zm = tl.load(zm_ptr + row)
    acc = tl.zeros((SBLOCK,), tl.int32)
    hist = tl.zeros((max(NE, 32),), tl.int32)
    for v0 in range(0, V, SBLOCK):
        cols = v0 + tl.arange(0, SBLOCK)
        mask = cols < V
        z = common.upcast_scaled(tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")), scale, SCALED)
        if NE > 0:
            b, inb = topp.d_bin(z, zm, ESCALE, NE)
            hist += tl.histogram(b, NE, mask=inb & mask)
        else:
            acc += (zm - z < 24.0).to(tl.int32)
    tl.store(out_ptr + row, tl.sum(hist, axis=0) + tl.sum(acc, axis=0))


@triton.jit
def _exact_variant(z_ptr, work_ptr, cnt_ptr, zm_ptr, win_ptr, out_ptr, mass_ptr, scale, V, SCALED: tl.constexpr,
                   MASS: tl.constexpr, COMPACT: tl.constexpr, SBLOCK: tl.constexpr):
    """The window's exact pass: MASS 0 none, 1 the converting mass formula (int64), 2 topp.weight_of (the
    integer-exponent formula) converted to fp64, 3 topp.weight_of (int64); COMPACT 1: the window's values
    appended by an atomic counter, 2: each chunk's values stored after the next chunk's atomics (their latency
    hidden). Row 0's
    masses written to mass_ptr (the bit check)."""
    row = tl.program_id(0).to(tl.int64)
    zm = tl.load(zm_ptr + row)
    d_lo = tl.load(win_ptr + row * 2)
    d_hi = tl.load(win_ptr + row * 2 + 1)
    tot = tl.zeros((SBLOCK,), tl.float64)
    above = tl.zeros((SBLOCK,), tl.float64)
    cnt = tl.zeros((SBLOCK,), tl.int32)
    last_z = tl.zeros((SBLOCK,), tl.float32)
    last_pos = tl.zeros((SBLOCK,), tl.int32)
    last_sel = tl.arange(0, SBLOCK) < 0
    for v0 in range(0, V, SBLOCK):
        cols = v0 + tl.arange(0, SBLOCK)
        mask = cols < V
        z = common.upcast_scaled(tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")), scale, SCALED)
        d = zm - z
        inb = mask & (d < 24.0)
        if MASS == 1:
            w = _mass_converting(z, inb, zm).to(tl.int64)
            tot += w.to(tl.float64)
            above += tl.where(d <= d_lo, w, 0).to(tl.float64)
            if row == 0:
                tl.store(mass_ptr + cols, w.to(tl.float32), mask=mask)
        elif MASS == 2:
            w = topp.weight_of(z, inb, zm, True).to(tl.float64)
            tot += w
            above += tl.where(d <= d_lo, w, 0.0)
            if row == 0:
                tl.store(mass_ptr + cols, w.to(tl.float32), mask=mask)
        elif MASS == 3:
            w = topp.weight_of(z, inb, zm, True)
            tot += w.to(tl.float64)
            above += tl.where(d <= d_lo, w, 0).to(tl.float64)
        else:
            tot += d.to(tl.float64)
        sel = inb & (d > d_lo) & (d <= d_hi)
        if COMPACT == 1:
            pos = tl.atomic_add(cnt_ptr + row + cols * 0, 1, mask=sel, sem="relaxed")
            tl.store(work_ptr + row * V + pos, z, mask=sel)
        elif COMPACT == 2:
            pos = tl.atomic_add(cnt_ptr + row + cols * 0, 1, mask=sel, sem="relaxed")
            tl.store(work_ptr + row * V + last_pos, last_z, mask=last_sel)
            last_z, last_pos, last_sel = z, pos, sel
        cnt += sel.to(tl.int32)
    tl.store(work_ptr + row * V + last_pos, last_z, mask=last_sel)
    tl.store(out_ptr + row, tl.sum(tot, axis=0) + tl.sum(above, axis=0) + tl.sum(cnt, axis=0).to(tl.float64))


def logits(kind: str, B: int, V: int, g) -> torch.Tensor:
    if kind == "student_t":
        torch.manual_seed(0)
        return torch.distributions.StudentT(3.0).sample((B, V)).cuda().bfloat16()
    return (torch.randn(B, V, generator=g, device="cuda") * {"flat": 1.0, "peaked": 4.0}[kind]).bfloat16()


def probe(z: torch.Tensor, scale: float, top_p: float) -> dict:
    B, V = z.shape
    bits = struct.unpack("<q", struct.pack("<d", top_p))[0]
    work = torch.empty(B, V, dtype=torch.float32, device="cuda")
    cnt = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.zeros(B, 5, dtype=torch.float32, device="cuda")
    kw = dict(SCALED=scale != 1.0, NE=topp.EST_BINS, ESCALE=topp.est_scale(topp.EST_BINS), RANK=topp.EST_RANK,
              DMIN=topp.EST_DMIN, SBLOCK=topp.CUT_STREAM, enable_fp_fusion=False, num_warps=topp.CUT_WARPS)
    res = {}
    for ph in (1, 2, 3):
        res[f"phase{ph}_ms"] = triton.testing.do_bench(
            lambda p=ph: (cnt.zero_(), _phases[(B,)](z, work, cnt, out, scale, V, bits, PHASE=p, HIST=p >= 2, **kw)))
    res["cut_ms"] = triton.testing.do_bench(lambda: topp.filter_cut(z, 0, top_p, scale))
    passes = torch.empty(B, dtype=torch.int32, device="cuda")
    topp.filter_cut(z, 0, top_p, scale, passes=passes)
    res["rows_by_passes"] = {str(int(n)): int(c) for n, c in zip(*passes.unique(return_counts=True))}
    cnt.zero_()
    _phases[(B,)](z, work, cnt, out, scale, V, bits, PHASE=3, HIST=True, **kw)
    res["window_values_mean"] = float(out[:, 4].mean())
    zm = out[:, 0].contiguous()
    win = out[:, 2:4].contiguous()
    hk = dict(SCALED=scale != 1.0, SBLOCK=topp.CUT_STREAM, enable_fp_fusion=False, num_warps=topp.CUT_WARPS)
    hout = torch.empty(B, dtype=torch.int32, device="cuda")
    for ne in (0, 32, 64, 128):
        res[f"hist{ne}_pass_ms"] = triton.testing.do_bench(
            lambda n=ne: _hist_variant[(B,)](z, zm, hout, scale, V, NE=n, ESCALE=topp.bin_scale(max(n, 1)), **hk))
    eout = torch.empty(B, dtype=torch.float64, device="cuda")
    masses = torch.zeros(4, V, dtype=torch.float32, device="cuda")
    for mass in (0, 1, 2, 3):
        for compact in (0, 1, 2):
            res[f"exact_mass{mass}_compact{compact}_ms"] = triton.testing.do_bench(
                lambda m=mass, c=compact: (cnt.zero_(), _exact_variant[(B,)](z, work, cnt, zm, win, eout, masses[m],
                                                                             scale, V, MASS=m, COMPACT=c, **hk)))
    res["weight_of_bits_equal_converting_form"] = bool(torch.equal(masses[1].view(torch.int32),
                                                                   masses[2].view(torch.int32)))
    warps0, stream0 = topp.CUT_WARPS, topp.CUT_STREAM
    for warps in (4, 8, 16):
        for stream in (1024, 2048, 4096):
            topp.CUT_WARPS, topp.CUT_STREAM = warps, stream
            res[f"cut_w{warps}_s{stream}_ms"] = triton.testing.do_bench(lambda: topp.filter_cut(z, 0, top_p, scale))
    topp.CUT_WARPS, topp.CUT_STREAM = warps0, stream0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    assert not common.INTERPRET, "a GPU timing"
    g = torch.Generator(device="cuda").manual_seed(0)
    scale, top_p, cases = inverse_temperature(0.8), 0.95, []
    for kind in ("flat", "peaked", "student_t"):
        r = {"kind": kind, "rows": a.rows, "vocab": a.vocab, "temperature": 0.8, "top_p": top_p,
             **probe(logits(kind, a.rows, a.vocab, g), scale, top_p)}
        cases.append(r)
        print(kind, " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                             if k not in ("kind", "rows", "vocab", "temperature", "top_p")), flush=True)
    shows = "; ".join(f"{c['kind']}: A {c['phase1_ms']:.3f}, +hist {c['phase2_ms'] - c['phase1_ms']:.3f}, +exact pass "
                      f"{c['phase3_ms'] - c['phase2_ms']:.3f}, cut {c['cut_ms']:.3f} ms ({c['window_values_mean']:.0f} "
                      f"window values)" for c in cases)
    record.write(f"probe_topp_window_{record.gpu_tag()}", {"cases": cases, "what_it_shows": (
        f"The estimated-window top-p cut's steps at {a.rows} x {a.vocab} bf16, T 0.8, top-p 0.95: " + shows)}, a.out)


if __name__ == "__main__":
    main()
