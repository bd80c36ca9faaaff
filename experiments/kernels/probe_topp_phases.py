"""Where the top-p cut's time goes: kernels/triton/topp.py's passes run cumulatively, one kernel per prefix
(A: the row's max and keys; + B: the mass total and the counts histogram, the candidate bins; + C: the exact mass
above them and their values compacted; + the key search over those values: the whole cut), beside the Gumbel
draw over the same logits and a plain bf16 read of them (the memory floor of a pass).

    python experiments/kernels/probe_topp_phases.py [--rows 1024] [--vocab 151936] [--out DIR]

Logits: bf16 normal(0, s), s in (1, 2, 4), top-p 0.95, T 0.8 (rows with top-k, NaN or an infinite max take
other branches of the cut kernel: not probed). Also records the candidate values per row (what the key search
reads). Writes results/probe_topp_phases_<gpu>.json.
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

from rlalign.kernels import inverse_temperature  # noqa: E402
from rlalign.kernels.triton import common, topp  # noqa: E402
from rlalign.kernels.triton import sampling as tsampling  # noqa: E402

PHASES = {1: "A stats", 2: "A+B bins", 3: "A+B+C compact", 4: "A+B+C+search (the cut)"}


@triton.jit
def _phases(z_ptr, work_ptr, out_ptr, bounds_ptr, scale, V, top_p_bits, SCALED: tl.constexpr, PHASE: tl.constexpr,
            NB: tl.constexpr, BSCALE: tl.constexpr, WAYS: tl.constexpr, PAIR: tl.constexpr, BLOCK: tl.constexpr,
            SBLOCK: tl.constexpr):
    """out[row] = (zm, ja, jb, candidates, cut) as far as PHASE gets."""
    row = tl.program_id(0).to(tl.int64)
    x_row = z_ptr + row * V
    w_row = work_ptr + row * V
    zm, kmin, kmax, nan, hist, anchor, _zl = topp.row_stats(x_row, scale, V, SCALED, False, True, 32, 1.0, SBLOCK)
    tl.store(out_ptr + row * 5, zm.to(tl.float64))
    if PHASE >= 2:
        bound, ja, jb = topp.top_p_bins(x_row, bounds_ptr, scale, V, kmin.to(tl.int64), zm,
                                        top_p_bits.to(tl.float64, bitcast=True), SCALED, NB, BSCALE, SBLOCK)
        tl.store(out_ptr + row * 5 + 1, ja.to(tl.float64))
        tl.store(out_ptr + row * 5 + 2, jb.to(tl.float64))
        if PHASE >= 3:
            above, count, lo, hi = topp.top_p_compact(x_row, w_row, scale, V, kmin.to(tl.int64), zm, ja, jb, SCALED,
                                                      NB, BSCALE, SBLOCK)
            tl.store(out_ptr + row * 5 + 3, count.to(tl.float64))
            if PHASE >= 4:
                cut = topp.key_search(w_row, count, lo, hi, above, bound, zm, True, WAYS, PAIR, BLOCK, SBLOCK)
                tl.store(out_ptr + row * 5 + 4, cut.to(tl.float64))


@triton.jit
def _read(z_ptr, out_ptr, V, SBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((SBLOCK,), tl.float32)
    for v0 in range(0, V, SBLOCK):
        cols = v0 + tl.arange(0, SBLOCK)
        acc = tl.maximum(acc, tl.load(z_ptr + row * V + cols, mask=cols < V, other=0.0).to(tl.float32))
    tl.store(out_ptr + row, tl.max(acc, axis=0))


@triton.jit
def _pass_b_parts(z_ptr, out_ptr, cut_ptr, scale, V, SCALED: tl.constexpr, NB: tl.constexpr, BSCALE: tl.constexpr,
                  SBLOCK: tl.constexpr, MASS: tl.constexpr, HIST: tl.constexpr):
    """Pass B's loop with its mass sum (MASS) and its counts histogram (HIST) each optional: what each costs.
    The row's max is read from cut_ptr's row (any value: only the work is timed)."""
    row = tl.program_id(0).to(tl.int64)
    zm = tl.load(cut_ptr + row).to(tl.float32)
    hist = tl.zeros((NB,), tl.int32)
    tot = tl.zeros((SBLOCK,), tl.int64)
    for v0 in range(0, V, SBLOCK):
        cols = v0 + tl.arange(0, SBLOCK)
        mask = cols < V
        z = common.upcast_scaled(tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")), scale, SCALED)
        b, inb = topp.d_bin(z, zm, BSCALE, NB)
        inb = inb & mask
        if MASS:
            tot += topp.weight_of(z, inb, zm, True)
        else:
            tot += b.to(tl.int64)
        if HIST:
            hist += tl.histogram(b, NB, mask=inb)
    tl.store(out_ptr + row, tl.sum(tot, axis=0).to(tl.float64) + tl.sum(hist, axis=0).to(tl.float64))


@triton.jit
def _pass_c_parts(z_ptr, w_ptr, cnt_ptr, out_ptr, cut_ptr, scale, V, SCALED: tl.constexpr, NB: tl.constexpr,
                  BSCALE: tl.constexpr, SBLOCK: tl.constexpr, MASS: tl.constexpr, ATOMIC: tl.constexpr,
                  JA: tl.constexpr, JB: tl.constexpr):
    """Pass C's loop over bins JA..JB with its exact masses (MASS) and its compaction by a scan or by an atomic
    per-row counter (ATOMIC: the compacted order then varies, the set does not)."""
    row = tl.program_id(0).to(tl.int64)
    zm = tl.load(cut_ptr + row).to(tl.float32)
    above = tl.zeros((SBLOCK,), tl.int64)
    count = tl.zeros((), tl.int32)
    for v0 in range(0, V, SBLOCK):
        cols = v0 + tl.arange(0, SBLOCK)
        mask = cols < V
        z = common.upcast_scaled(tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")), scale, SCALED)
        b, inb = topp.d_bin(z, zm, BSCALE, NB)
        inb = inb & mask
        if MASS:
            w = topp.weight_of(z, inb, zm, True)
            above += tl.where(b < JA, w, 0)
            sel = (b >= JA) & (b <= JB) & (w > 0)
        else:
            sel = (b >= JA) & (b <= JB) & inb
        if ATOMIC:
            pos = tl.atomic_add(cnt_ptr + row + cols * 0, 1, mask=sel, sem="relaxed")
        else:
            pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            count += tl.sum(sel.to(tl.int32), axis=0)
        tl.store(w_ptr + row * V + pos, z, mask=sel)
    tl.store(out_ptr + row, tl.sum(above, axis=0).to(tl.float64) + count.to(tl.float64))


def parts(z: torch.Tensor, scale: float, ja: int, jb: int) -> dict:
    """Pass B's and pass C's parts timed apart (the max in place of each row's: only the work matters)."""
    B, V = z.shape
    nb = topp.CUT_BINS
    zm = z.float().amax(1).mul(scale).double()
    out = torch.empty(B, dtype=torch.float64, device=z.device)
    work = torch.empty(B, V, dtype=torch.float32, device=z.device)
    cnt = torch.zeros(B, dtype=torch.int32, device=z.device)
    kw = dict(SCALED=scale != 1.0, NB=nb, BSCALE=topp.bin_scale(nb), SBLOCK=topp.CUT_STREAM, enable_fp_fusion=False,
              num_warps=topp.CUT_WARPS)
    res = {}
    for mass, hist in ((True, True), (True, False), (False, True), (False, False)):
        res[f"passB_mass{int(mass)}_hist{int(hist)}_ms"] = triton.testing.do_bench(
            lambda m=mass, h=hist: _pass_b_parts[(B,)](z, out, zm, scale, V, MASS=m, HIST=h, **kw))
    for mass, atomic in ((True, False), (True, True), (False, False), (False, True)):
        res[f"passC_mass{int(mass)}_atomic{int(atomic)}_ms"] = triton.testing.do_bench(
            lambda m=mass, a=atomic: (cnt.zero_(), _pass_c_parts[(B,)](z, work, cnt, out, zm, scale, V, MASS=m,
                                                                      ATOMIC=a, JA=ja, JB=jb, **kw)))
    return res


def probe(z: torch.Tensor, scale: float, top_p: float) -> dict:
    B, V = z.shape
    work = torch.empty(B, V, dtype=torch.float32, device=z.device)
    out = torch.zeros(B, 5, dtype=torch.float64, device=z.device)
    nb = topp.CUT_BINS
    bounds = torch.tensor([v for half in topp.mass_bounds(nb) for v in half], dtype=torch.long, device=z.device)
    bits = struct.unpack("<q", struct.pack("<d", top_p))[0]

    def run(phase):
        _phases[(B,)](z, work, out, bounds, scale, V, bits, SCALED=scale != 1.0, PHASE=phase, NB=nb,
                      BSCALE=topp.bin_scale(nb), WAYS=topp.CUT_WAYS, PAIR=topp.PAIR_MAX, BLOCK=topp.CUT_BLOCK,
                      SBLOCK=topp.CUT_STREAM, enable_fp_fusion=False, num_warps=topp.CUT_WARPS)
    res = {f"phase{p}_ms": triton.testing.do_bench(lambda p=p: run(p)) for p in PHASES}
    run(4)
    cut = topp.filter_cut(z, 0, top_p, scale)
    res["cut_equal_filter_cut"] = bool(torch.equal(out[:, 4].long(), cut))
    res["candidates_mean"] = float(out[:, 3].mean())
    res["candidates_max"] = float(out[:, 3].max())
    res["candidate_bins_mean"] = float((out[:, 2] - out[:, 1] + 1).mean())
    res["filter_cut_ms"] = triton.testing.do_bench(lambda: topp.filter_cut(z, 0, top_p, scale))
    ids = torch.arange(B, device=z.device)
    res["gumbel_argmax_cut_ms"] = triton.testing.do_bench(
        lambda: tsampling.gumbel_argmax(z, 3, ids, ids, scale, cut=cut))
    mx = torch.empty(B, dtype=torch.float32, device=z.device)
    res["bf16_read_ms"] = triton.testing.do_bench(lambda: _read[(B,)](z, mx, V, SBLOCK=topp.CUT_STREAM, num_warps=8))
    res.update(parts(z, scale, int(out[:, 1].median()), int(out[:, 2].median())))
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
    for s in (1.0, 2.0, 4.0):
        z = (torch.randn(a.rows, a.vocab, device="cuda", generator=g) * s).bfloat16()
        r = {"rows": a.rows, "vocab": a.vocab, "logit_std": s, "temperature": 0.8, "top_p": top_p,
             **probe(z, scale, top_p)}
        cases.append(r)
        print(f"s {s}: " + ", ".join(f"{PHASES[p]} {r[f'phase{p}_ms']:.3f} ms" for p in PHASES)
              + f"; filter_cut {r['filter_cut_ms']:.3f}, draw {r['gumbel_argmax_cut_ms']:.3f}, bf16 read "
              f"{r['bf16_read_ms']:.3f}; candidates {r['candidates_mean']:.0f} (max {r['candidates_max']:.0f}) in "
              f"{r['candidate_bins_mean']:.1f} bins; cut equal {r['cut_equal_filter_cut']}", flush=True)
        print("   " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k.startswith("pass")), flush=True)
    shows = "; ".join(
        f"s {c['logit_std']}: A {c['phase1_ms']:.2f}, +B {c['phase2_ms'] - c['phase1_ms']:.2f}, "
        f"+C {c['phase3_ms'] - c['phase2_ms']:.2f}, +search {c['phase4_ms'] - c['phase3_ms']:.2f} ms "
        f"({c['candidates_mean']:.0f} candidates a row); bf16 read {c['bf16_read_ms']:.2f}, draw "
        f"{c['gumbel_argmax_cut_ms']:.2f}" for c in cases)
    record.write(f"probe_topp_phases_{record.gpu_tag()}", {"cases": cases, "cut_bins": topp.CUT_BINS, "what_it_shows": (
        f"The top-p cut's passes, cumulative kernels at {a.rows} x {a.vocab} bf16, T 0.8, top-p 0.95 "
        f"({topp.CUT_BINS} bins): " + shows)}, a.out)


if __name__ == "__main__":
    main()
