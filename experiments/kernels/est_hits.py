"""How often the top-p cut's first window holds the cut at the real vocabulary, by the estimate's sampling
(kernels/triton/topp.py EST_EVERY: the estimate counts every k-th column), under the Triton interpreter: the paths
are logic, not timing, so they are the GPU's (up to tl.exp / tl.log's last bits in the estimate). Every cut is
checked key for key against the torch reference (sampling.filter_cut).

    python experiments/kernels/est_hits.py [--rows 16] [--every 1,2,4] [--out DIR]

Rows (bf16, 151,936 columns, as bench_topp_cut.py's): normal(0, s) for s 1, 2, 4; zipf; three spikes over a flat
row; student-t(3); at T 0.8 top-p 0.95, and the spikes and zipf rows also at T 0.6 top-p 0.9.
Writes results/est_hits_interpreter.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign.kernels import inverse_temperature, sampling  # noqa: E402
from rlalign.kernels.triton import topp  # noqa: E402

V = 151936


def rows_of(kind: str, s: float, B: int, g: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        z = torch.randn(B, V, generator=g) * s
    elif kind == "zipf":
        rank = torch.rand(B, V, generator=g).argsort(-1).float()
        z = -s * torch.log1p(rank) + 0.5 * torch.randn(B, V, generator=g)
    elif kind == "spikes":
        z = torch.randn(B, V, generator=g)
        z.scatter_(1, torch.randint(0, V, (B, 3), generator=g), 4 + 6 * torch.rand(B, 3, generator=g))
    else:
        z = torch.distributions.StudentT(3.0).sample((B, V)) * s
    return z.bfloat16()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--every", default="1,2,4")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    torch.manual_seed(0)
    cases = [("normal", 1.0, 0.8, 0.95), ("normal", 2.0, 0.8, 0.95), ("normal", 4.0, 0.8, 0.95),
             ("zipf", 1.0, 0.8, 0.95), ("zipf", 1.0, 0.6, 0.9), ("spikes", 1.0, 0.8, 0.95), ("spikes", 1.0, 0.6, 0.9),
             ("student_t", 1.0, 0.8, 0.95)]
    everys = [int(e) for e in a.every.split(",")]
    saved, out, t0 = topp.EST_EVERY, [], time.time()
    for kind, s, temp, p in cases:
        z = rows_of(kind, s, a.rows, torch.Generator().manual_seed(len(out)))
        scale = inverse_temperature(temp)
        ref = sampling.filter_cut(sampling.temper(z, scale), 0, p)
        row = {"kind": kind, "logit_scale": s, "temperature": temp, "top_p": p, "rows": a.rows, "by_every": {}}
        for every in everys:
            topp.EST_EVERY = every
            passes = torch.empty(a.rows, dtype=torch.int32)
            cut = topp.filter_cut(z, 0, p, scale, passes=passes)
            row["by_every"][str(every)] = {
                "cut_equal_reference": bool(torch.equal(cut, ref)),
                "rows_by_passes": {str(int(n)): int(c) for n, c in zip(*passes.unique(return_counts=True))}}
        topp.EST_EVERY = saved
        out.append(row)
        print(kind, s, temp, p, row["by_every"], f"{time.time() - t0:.0f} s", flush=True)
    equal = all(e["cut_equal_reference"] for r in out for e in r["by_every"].values())
    first = {e: sum(r["by_every"][str(e)]["rows_by_passes"].get("1", 0) for r in out) for e in everys}
    total = len(out) * a.rows
    held = ", ".join(f"{first[e]} of {total} rows counting every {e}-th column" for e in everys)
    record.write("est_hits_interpreter", {
        "cases": out, "all_cuts_equal_reference": equal, "first_window_rows_by_every": first, "rows_per_every": total,
        "what_it_shows": f"The top-p cut's first window held the cut in {held} (interpreter, 151,936 columns); "
                         f"every cut equal to the torch reference: {equal}."}, a.out)

if __name__ == "__main__":
    main()
