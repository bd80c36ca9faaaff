"""How often the top-p cut's first window holds the cut at the real vocabulary (kernels/triton/topp.py filter_cut's
passes), against a baseline module (an older topp.py: topp_one_launch.py, whose estimate spreads every bin's values
evenly), under the Triton interpreter: the paths are logic, not timing, so they are the GPU's (up to tl.exp /
tl.log's last bits in the estimate). Every cut is checked key for key against the torch reference
(sampling.filter_cut).

    python experiments/kernels/est_hits.py [--rows 16] [--baseline FILE | --baseline-rev REV] [--cases magnitudes]
        [--name NAME] [--out DIR]

Rows (bf16, 151,936 columns, bench_topp_cut.logits_of on the CPU): normal(0, s) for s 1, 2, 4, zipf, three spikes
over a flat row and student-t(3) at T 0.8 top-p 0.95; zipf also at T 1.0 top-p 0.99, the spikes at T 0.6 top-p 0.9
and 0.99. Writes results/est_hits_interpreter.json.
--cases magnitudes: bf16 rows at the magnitudes of trained models' logits, whose bf16 spacing can exceed the
window's EST_DMIN: normal(0, s) + offset for offsets 0, 8, 16, s 1 and 2, and "levels" rows (normal(0, 1) rounded
to multiples of 0.25) + offset 0 and 16, each at T 0.8 and 1.0, top-p 0.95 and 0.99; the baseline is the product
with the window's floor at EST_DMIN alone (EST_DTYPE_FLOOR off). Writes results/est_hits_magnitudes_interpreter.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_topp_cut import logits_of  # noqa: E402
from probe_topp_split import load_baseline, topp_at  # noqa: E402

from rlalign.kernels import inverse_temperature, sampling  # noqa: E402
from rlalign.kernels.triton import topp  # noqa: E402

V = 151936


STANDARD = [("normal", 1.0, 0.8, 0.95, 0.0), ("normal", 2.0, 0.8, 0.95, 0.0), ("normal", 4.0, 0.8, 0.95, 0.0),
            ("zipf", 1.0, 0.8, 0.95, 0.0), ("zipf", 1.0, 1.0, 0.99, 0.0), ("spikes", 1.0, 0.8, 0.95, 0.0),
            ("spikes", 1.0, 0.6, 0.9, 0.0), ("spikes", 1.0, 0.6, 0.99, 0.0), ("student_t", 1.0, 0.8, 0.95, 0.0)]
MAGNITUDES = [(kind, s, temp, p, off) for kind, s, offs in (("normal", 1.0, (0.0, 8.0, 16.0)),
                                                            ("normal", 2.0, (0.0, 8.0, 16.0)),
                                                            ("levels", 1.0, (0.0, 16.0)))
              for off in offs for temp in (0.8, 1.0) for p in (0.95, 0.99)]


# --cases model: a model's own rows (model_rows) at the rollout benchmarks' sampling and beside it
MODEL = [("model", 1.0, 0.8, 0.95, 0.0), ("model", 1.0, 1.0, 0.95, 0.0), ("model", 1.0, 0.8, 0.99, 0.0)]


def model_rows(name: str, rows: int) -> torch.Tensor:
    """Next-token logits [rows, V] (bf16) of the model `name` at its random weights (build_model seed 0, as
    bench_determinism_tax's rollouts build it), each at the end of a sequence like a rollout's last decode
    step's: a bench_rollout_scale prompt (8-200 random tokens) and 255 more tokens (random: a random-weight
    model's own samples are near uniform). On the CPU with the default kernels: the rows' shape, not their bits."""
    from rlalign import kernels
    from rlalign.config import load_config, model_args
    from rlalign.model import build_model

    args = model_args(load_config([f"model={name}"]))
    model = build_model(args, "bfloat16", seed=0, device="cpu")
    g = torch.Generator().manual_seed(rows)
    out = []
    with torch.no_grad(), kernels.use(mode="default", backend="torch"):
        for n in torch.randint(8, 201, (rows,), generator=g).tolist():
            tokens = torch.randint(2, args.vocab_size, (n + 255,), generator=g)
            out.append(model(tokens, [0, len(tokens)])[-1:].to(torch.bfloat16))
    return torch.cat(out)


class FloorOff:
    """topp's filter_cut with the window's floor at EST_DMIN alone (the dtype's spacing not applied)."""

    def filter_cut(self, *args, **kw):
        floor, topp.EST_DTYPE_FLOOR = topp.EST_DTYPE_FLOOR, False
        try:
            return topp.filter_cut(*args, **kw)
        finally:
            topp.EST_DTYPE_FLOOR = floor


def _label(r: dict) -> str:
    off = f" +{r['offset']:g}" if r["offset"] else ""
    return f"{r['kind']} s{r['logit_scale']:g}{off} T{r['temperature']} p{r['top_p']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--baseline", default=str(Path(__file__).resolve().parent / "topp_one_launch.py"))
    ap.add_argument("--baseline-rev", default="", help="the baseline: kernels/triton/topp.py at this git revision")
    ap.add_argument("--cases", choices=("standard", "magnitudes", "model"), default="standard")
    ap.add_argument("--model", default="qwen3-30b-a3b-rehearsal", help="--cases model: whose logits")
    ap.add_argument("--name", default="", help="the result's name (default by --cases)")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    if a.baseline_rev:
        a.baseline = topp_at(a.baseline_rev)
    torch.manual_seed(0)
    magnitudes = a.cases == "magnitudes"
    cases = MAGNITUDES if magnitudes else MODEL if a.cases == "model" else STANDARD
    baseline = FloorOff() if magnitudes else load_baseline(a.baseline)
    mods = {"product": topp, "baseline": baseline}
    out, t0 = [], time.time()
    rows_of_model = model_rows(a.model, a.rows) if a.cases == "model" else None
    for kind, s, temp, p, off in cases:
        if rows_of_model is not None:
            z = rows_of_model
        else:
            z = logits_of(torch.Generator().manual_seed(len(out)), kind, a.rows, V, s, off)
        scale = inverse_temperature(temp)
        ref = sampling.filter_cut(sampling.temper(z, scale), 0, p)
        row = {"kind": kind, "logit_scale": s, "offset": off, "temperature": temp, "top_p": p, "rows": a.rows}
        for who, mod in mods.items():
            passes = torch.empty(a.rows, dtype=torch.int32)
            cut = mod.filter_cut(z, 0, p, scale, passes=passes)
            row[who] = {"cut_equal_reference": bool(torch.equal(cut, ref)),
                        "rows_by_passes": {str(int(n)): int(c) for n, c in zip(*passes.unique(return_counts=True))}}
        out.append(row)
        print(kind, s, off, temp, p, {w: row[w] for w in mods}, f"{time.time() - t0:.0f} s", flush=True)
    equal = all(r[w]["cut_equal_reference"] for r in out for w in mods)
    first = {w: sum(r[w]["rows_by_passes"].get("1", 0) for r in out) for w in mods}
    total = len(out) * a.rows
    shows = "; ".join(f"{_label(r)}: {r['product']['rows_by_passes'].get('1', 0)} vs "
                      f"{r['baseline']['rows_by_passes'].get('1', 0)}" for r in out)
    base = "the window's floor at EST_DMIN alone" if magnitudes else "the baseline"
    name = a.name or ("est_hits_magnitudes_interpreter" if magnitudes else f"est_hits_{a.model}_interpreter"
                      if a.cases == "model" else "est_hits_interpreter")
    baseline_file = f"kernels/triton/topp.py at {a.baseline_rev}" if a.baseline_rev else a.baseline
    record.write(name, {
        "cases": out, "baseline_file": "topp.py with EST_DTYPE_FLOOR off" if magnitudes else baseline_file,
        "all_cuts_equal_reference": equal, "first_window_rows": first, "rows": total,
        "what_it_shows": f"The top-p cut's first window held the cut in {first['product']} of {total} rows against "
                         f"{first['baseline']} for {base} (interpreter, 151,936 columns; per case, of "
                         f"{a.rows}: {shows}); every cut equal to the torch reference: {equal}."}, a.out)


if __name__ == "__main__":
    main()
