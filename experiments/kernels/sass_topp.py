"""The top-p / top-k cut's kernels (kernels/triton/topp.py) as the product launches them, compiled for sm_90 without
a GPU: registers, spills, shared memory, and each loop's instructions from the SASS (cuobjdump; the launches
captured at 1,024 rows of 151,936 bf16 logits and specialised as at run time: sass.py), for each launch, beside a
baseline module (an older topp.py: topp_one_launch.py, the cut in one launch) where given. The streaming passes are
bound by instruction issue (the probes' times follow their counts), so a loop's instructions per chunk are a proxy
for its time; a GPU run decides.

    PYTHONPATH=. python experiments/kernels/sass_topp.py [--baseline FILE] [--out DIR]

Run it with the Triton the GPU machine has (3.6; see sass.py). Writes results/sass_topp_sm90.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_topp_split import load_baseline  # noqa: E402
from sass import captured, cpu_tensor, sass_stats, spec_of  # noqa: E402

from rlalign.kernels.triton import topp  # noqa: E402

ROWS, VOCAB = 1024, 151936
# filter settings: (name, top_k, top_p, scale); T 0.8 is scale 1.25
CUTS = (("top_p", 0, 0.95, 1.25), ("top_k", 50, 1.0, 1.25), ("top_k_top_p", 50, 0.95, 1.25))


def cut_launches(mod) -> list[tuple[str, object]]:
    """(name, launch) of the module's filter_cut under each setting of CUTS, as it launches them."""
    out = []
    for name, k, p, scale in CUTS:
        with captured() as got:
            mod.filter_cut(cpu_tensor(ROWS, VOCAB), top_k=k, top_p=p, scale=scale)
        out += [(f"{name}:{launch.name}" + (f"_{i}" if sum(g.name == launch.name for g in got) > 1 else ""), launch)
                for i, launch in enumerate(got)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="", help="an older topp.py compiled beside the product")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    mods = [("product", topp)] + ([("baseline", load_baseline(a.baseline))] if a.baseline else [])
    kernels = {}
    for who, mod in mods:
        for name, launch in cut_launches(mod):
            st = sass_stats(launch.compile())
            kernels[f"{who}:{name}"] = dict(st, num_warps=launch.options.get("num_warps"),
                                            specialisation=spec_of(launch))
            print(f"{who}:{name}: {st['reg']} registers, {st.get('local', 0)} B local, {st.get('stack', 0)} B stack, "
                  f"loops (instructions per chunk) {[lp['instructions'] for lp in st['loops']]}", flush=True)
    shows = "; ".join(f"{n} {k['reg']} registers, loops {[lp['instructions'] for lp in k['loops']][:4]}"
                      for n, k in kernels.items())
    record.write("sass_topp_sm90", {"triton": triton.__version__, "target": "sm_90", "num_warps": topp.CUT_WARPS,
                                    "rows": ROWS, "vocab": VOCAB, "cuts": CUTS, "baseline_file": a.baseline,
                                    "kernels": kernels,
                                    "what_it_shows": f"Static SASS of the cut's kernels as launched (Triton "
                                                     f"{triton.__version__}, sm_90; the JIT's specialisation "
                                                     f"applied): " + shows}, a.out)


if __name__ == "__main__":
    main()
