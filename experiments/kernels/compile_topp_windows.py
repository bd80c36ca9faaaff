"""Whether every launch of the top-p / top-k cut (kernels/triton/topp.py filter_cut) compiles for sm_90 under each
window setting the tests sweep (tests/test_triton_topp.py's WINDOWS: the product's estimated window, tiny windows,
the exact bins alone, the key search's levels only, its pairs only), for top-p alone and after top-k, beside a
baseline module (an older topp.py: a file, or kernels/triton/topp.py at a git revision) where given. No GPU: the
launches are captured as the JIT specialises them (sass.py) and compiled to a cubin. Run it with the Triton the GPU
machine has (3.6; see sass.py): that Triton's passes can fail where a newer one compiles, and a GPU run of the tests
then fails at the compile.

    PYTHONPATH=. python experiments/kernels/compile_topp_windows.py [--baseline FILE | --baseline-rev REV] [--out DIR]

Writes results/compile_topp_windows_sm90.json: per module, setting and launch, "ok" or the error's last line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_topp_split import load_baseline, topp_at  # noqa: E402
from sass import captured, cpu_tensor  # noqa: E402

from rlalign.kernels.triton import topp  # noqa: E402

ROWS, VOCAB = 64, 151936
NAMES = ("EST_RANK", "EST_DMIN", "EST_DTYPE_FLOOR", "EST_RETRIES", "PAIR_MAX")


def windows(mod) -> dict[str, tuple]:
    """tests/test_triton_topp.py's WINDOWS, read from the module compiled (a baseline may lack a setting)."""
    product = (mod.EST_RANK, mod.EST_DMIN, getattr(mod, "EST_DTYPE_FLOOR", True))
    return {"estimated": (*product, mod.EST_RETRIES, mod.PAIR_MAX), "tiny": (0, 0.0, False, 2, mod.PAIR_MAX),
            "exact_bins": (0, 0.0, False, 0, mod.PAIR_MAX), "levels": (*product, mod.EST_RETRIES, 0),
            "pairs": (*product, mod.EST_RETRIES, 1 << 20)}


def compiled(mod, top_k: int, setting: tuple) -> dict[str, str]:
    """launch name -> "ok" or the compile error's last line, with the module's window constants set to setting."""
    saved = {n: getattr(mod, n) for n in NAMES if hasattr(mod, n)}
    for n, v in zip(NAMES, setting):
        if n in saved:
            setattr(mod, n, v)
    try:
        with captured() as got:
            mod.filter_cut(cpu_tensor(ROWS, VOCAB), top_k=top_k, top_p=0.95, scale=1.25)
    finally:
        for n, v in saved.items():
            setattr(mod, n, v)
    out = {}
    for i, launch in enumerate(got):
        try:
            launch.compile()
            out[f"{i}:{launch.name}"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded: which launch fails, and how
            out[f"{i}:{launch.name}"] = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="", help="an older topp.py compiled beside the product")
    ap.add_argument("--baseline-rev", default="", help="or kernels/triton/topp.py at this git revision")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    if a.baseline_rev:
        a.baseline = topp_at(a.baseline_rev)
    mods = [("product", topp)] + ([("baseline", load_baseline(a.baseline))] if a.baseline else [])
    results, failed = {}, {}
    for who, mod in mods:
        for wname, setting in windows(mod).items():
            for cut, top_k in (("top_p", 0), ("top_k_top_p", 50)):
                got = compiled(mod, top_k, setting)
                results[f"{who}:{wname}:{cut}"] = got
                bad = [k for k, v in got.items() if v != "ok"]
                failed.setdefault(who, []).extend(f"{wname}:{cut}:{k}" for k in bad)
                print(f"{who}:{wname}:{cut}: {got}", flush=True)
    shows = "; ".join(f"{who}: {len(f)} launches failed" + (f" ({', '.join(f)})" if f else "")
                      for who, f in failed.items())
    record.write("compile_topp_windows_sm90", {
        "triton": triton.__version__, "target": "sm_90", "rows": ROWS, "vocab": VOCAB,
        "settings": {who: windows(mod) for who, mod in mods},
        "baseline": (f"kernels/triton/topp.py at {a.baseline_rev}" if a.baseline_rev else a.baseline),
        "launches": results,
        "failed": failed,
        "what_it_shows": f"Every launch of the cut compiled for sm_90 by Triton {triton.__version__} under each "
                         f"window setting of tests/test_triton_topp.py (top-p alone and after top-k 50): {shows}."},
        a.out)


if __name__ == "__main__":
    main()
