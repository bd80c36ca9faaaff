"""The top-k / top-p cut search on one GPU: kernels/triton/topp.py filter_cut (count histograms, then a
key search over the candidate bins) against the threshold-search filter it replaced
(experiments/kernels/threshold_filter.py), beside one Gumbel-max draw over the same logits for scale. Checks,
on every case, that the new cut's kept set {key >= cut} plus NaN is the old filter's (its finite entries),
and that the cut applied (sampling.apply_cut) gives its bits.

    python experiments/kernels/bench_topp_cut.py [--quick] [--out DIR]

Logits: bf16 normal(0, s) rows, s in (1, 2, 4) (s 1: flat, top-p keeps much of the vocabulary; s 4:
peaked), read in place at temperature T (scale 1 / T). Writes results/bench_topp_cut_<gpu>.json.
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


def case(g, B: int, V: int, s: float, temp: float, k: int, p: float, bins: tuple = ()) -> dict:
    row = {"rows": B, "vocab": V, "logit_scale": s, "temperature": temp, "top_k": k, "top_p": p}
    try:
        logits = (torch.randn(B, V, generator=g, device="cuda") * s).bfloat16()
        scale = inverse_temperature(temp)
        old = threshold_filter_logits(logits, k, p, scale)
        cut = topp.filter_cut(logits, k, p, scale)
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
        print(f"{B:5d} x {V:6d} s{s:.0f} T{temp} k{k:2d} p{p:.2f} kept_equal={same} "
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
    if a.quick:
        cases = [(1024, V, 1.0, 0.8, 0, 0.95), (1024, V, 4.0, 0.8, 0, 0.95), (256, V, 1.0, 0.8, 20, 0.9)]
    bins = tuple(int(b) for b in a.bins.split(",") if b)
    rows = [case(g, *c, bins=bins) for c in cases]
    ok = [r for r in rows if "error" not in r]
    same = all(r["kept_equal_old"] for r in ok) and len(ok) == len(rows)
    shows = "; ".join(f"{r['rows']}x{r['vocab']} s{r['logit_scale']:g} k{r['top_k']} p{r['top_p']}: cut "
                      f"{r['filter_cut_ms']:.3f} ms vs old filter {r['old_filter_ms']:.3f} ms (draw "
                      f"{r['gumbel_argmax_ms']:.3f})" for r in ok)
    res = {"cases": rows, "all_kept_equal": same,
           "what_it_shows": f"filter_cut (histogram cut search) vs the threshold-search "
                            f"filter; the kept "
                            f"sets (and the filtered bits) equal on every case without error: {same}. {shows}"}
    print("wrote", record.write("bench_topp_cut_" + record.gpu_tag(), res, a.out))


if __name__ == "__main__":
    main()
