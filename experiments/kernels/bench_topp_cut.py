"""The top-k / top-p cut search on one GPU: kernels/triton/topp.py filter_cut (top-p: an estimated window
checked by one exact pass, a key search over its values; the exact bins when it misses) against the
threshold-search filter it replaced
(experiments/kernels/threshold_filter.py), beside one Gumbel-max draw over the same logits for scale. Checks,
on every case, that the new cut's kept set {key >= cut} plus NaN is the old filter's (its finite entries),
and that the cut applied (sampling.apply_cut) gives its bits.

    python experiments/kernels/bench_topp_cut.py [--quick] [--out DIR]

Logits: bf16 normal(0, s) rows, s in (1, 2, 4) (s 1: flat, top-p keeps much of the vocabulary; s 4:
peaked), and rows of other shapes (kind: zipf, a few spikes over a flat row, student-t), read in place at
temperature T (scale 1 / T). Records, per case, how many rows each path found the cut in (filter_cut's
passes). Writes results/bench_topp_cut_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402
from threshold_filter import threshold_filter_logits  # noqa: E402

from rlalign.kernels import inverse_temperature, sampling  # noqa: E402
from rlalign.kernels.triton import sampling as tsampling  # noqa: E402
from rlalign.kernels.triton import topp  # noqa: E402

default_bins = topp.CUT_BINS


LEVEL_STEP = 0.25  # the "levels" kind's grid


def logits_of(g, kind: str, B: int, V: int, s: float, offset: float = 0.0) -> torch.Tensor:
    """bf16 rows of a kind on the generator's device (student-t from the global generator), offset added before
    the rounding to bf16 (the offset leaves the softmax as it is, not bf16's spacing: 0.0625 in [8, 16), 0.125 in
    [16, 32)). "levels": normal(0, s) rounded to multiples of LEVEL_STEP."""
    dev = g.device
    if kind == "normal":
        z = torch.randn(B, V, generator=g, device=dev) * s
    elif kind == "levels":
        z = torch.round(torch.randn(B, V, generator=g, device=dev) * (s / LEVEL_STEP)) * LEVEL_STEP
    elif kind == "zipf":  # -s log(rank) over a random order of the vocabulary, plus noise
        rank = torch.rand(B, V, generator=g, device=dev).argsort(-1).float()
        z = -s * torch.log1p(rank) + 0.5 * torch.randn(B, V, generator=g, device=dev)
    elif kind == "spikes":  # a flat row with 3 values 4..10 higher
        z = torch.randn(B, V, generator=g, device=dev)
        z.scatter_(1, torch.randint(0, V, (B, 3), generator=g, device=dev),
                   4 + 6 * torch.rand(B, 3, generator=g, device=dev))
    elif kind == "student_t":
        z = torch.distributions.StudentT(3.0).sample((B, V)).to(dev) * s
    else:
        raise ValueError(kind)
    return (z + offset if offset else z).bfloat16()


def case(g, B: int, V: int, s: float, temp: float, k: int, p: float, bins: tuple = (), kind: str = "normal") -> dict:
    row = {"kind": kind, "rows": B, "vocab": V, "logit_scale": s, "temperature": temp, "top_k": k, "top_p": p}
    try:
        logits = logits_of(g, kind, B, V, s)
        scale = inverse_temperature(temp)
        old = threshold_filter_logits(logits, k, p, scale)
        passes = torch.empty(B, dtype=torch.int32, device="cuda")
        cut = topp.filter_cut(logits, k, p, scale, passes=passes)
        row["rows_by_passes"] = {str(n): int(c) for n, c in zip(*passes.unique(return_counts=True))}
        zt = sampling.temper(logits, scale)
        kept_new = (sampling.order_keys(zt) >= cut[:, None]) | (zt != zt)
        same = bool(torch.equal(kept_new, torch.isfinite(old) | (old != old)))
        ids = torch.arange(B, device="cuda")
        new = sampling.apply_cut(zt, cut)  # the filtered copy the consumers read in registers
        same = same and bool(torch.equal(new.view(torch.int32), old.view(torch.int32)))
        t = {"old_filter_ms": triton.testing.do_bench(lambda: threshold_filter_logits(logits, k, p, scale)),
             "filter_cut_ms": triton.testing.do_bench(lambda: topp.filter_cut(logits, k, p, scale)),
             "gumbel_argmax_ms": triton.testing.do_bench(lambda: tsampling.gumbel_argmax(logits, 3, ids, ids,
                                                                                           scale))}
        for nb in bins:  # the first level's histogram bins: its cost against the candidates' count
            topp.CUT_BINS = nb
            same = same and bool(torch.equal(topp.filter_cut(logits, k, p, scale), cut))
            t[f"filter_cut_nb{nb}_ms"] = triton.testing.do_bench(lambda: topp.filter_cut(logits, k, p, scale))
        topp.CUT_BINS = default_bins
        row.update(kept_equal_old=same, kept_mean=float(kept_new.sum(-1).float().mean()), **t)
        print(f"{kind:9s} {B:5d} x {V:6d} s{s:.0f} T{temp} k{k:2d} p{p:.2f} kept_equal={same} "
              f"passes {row['rows_by_passes']} "
              f"kept~{row['kept_mean']:9.1f}  " + "  ".join(f"{n} {v:7.3f}" for n, v in t.items()), flush=True)
    except Exception as e:
        topp.CUT_BINS = default_bins  # one failing case is recorded, the others still run
        row["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(record.RESULTS))
    ap.add_argument("--quick", action="store_true", help="one shape, two scales")
    ap.add_argument("--bins", default="", help="also time filter_cut at these CUT_BINS, e.g. 256,512,2048")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    V = 151936
    cases = [(B, V, s, 0.8, 0, 0.95) for B in (1024, 2048) for s in (1.0, 2.0, 4.0)]
    cases += [(256, V, s, 0.8, 20, 0.9) for s in (1.0, 4.0)]
    cases += [(1024, V, 1.0, t, 0, p) for t in (0.6, 1.0) for p in (0.5, 0.99)]
    others = [(kind, (1024, V, s, t, 0, p)) for kind, s in (("zipf", 1.0), ("spikes", 1.0), ("student_t", 1.0))
              for t in (0.6, 1.0) for p in (0.9, 0.99)]
    if a.quick:
        cases = [(1024, V, 1.0, 0.8, 0, 0.95), (1024, V, 4.0, 0.8, 0, 0.95), (256, V, 1.0, 0.8, 20, 0.9)]
        others = others[:2]
    bins = tuple(int(b) for b in a.bins.split(",") if b)
    rows = [case(g, *c, bins=bins) for c in cases] + [case(g, *c, kind=kind) for kind, c in others]
    ok = [r for r in rows if "error" not in r]
    same = all(r["kept_equal_old"] for r in ok) and len(ok) == len(rows)
    shows = "; ".join(f"{r['kind']} {r['rows']}x{r['vocab']} s{r['logit_scale']:g} T{r['temperature']} "
                      f"k{r['top_k']} p{r['top_p']}: cut "
                      f"{r['filter_cut_ms']:.3f} ms vs old filter {r['old_filter_ms']:.3f} ms (draw "
                      f"{r['gumbel_argmax_ms']:.3f}; rows by window passes {r['rows_by_passes']})" for r in ok)
    res = {"cases": rows, "all_kept_equal": same,
           "what_it_shows": f"filter_cut (top-p: estimated window, exact check) vs the threshold-search "
                            f"filter; the kept "
                            f"sets (and the filtered bits) equal on every case without error: {same}. {shows}"}
    print("wrote", record.write("bench_topp_cut_" + record.gpu_tag(), res, a.out))


if __name__ == "__main__":
    main()
