"""The top-p / top-k cut's kernels (kernels/triton/topp.py) compiled for sm_90 without a GPU: registers, spills,
shared memory, and each loop's instructions from the SASS (cuobjdump), for each launch, beside a baseline module
(an older topp.py: topp_one_launch.py, the cut in one launch) where given. The streaming passes are bound by
instruction issue (the probes' times follow their counts), so a loop's instructions per chunk are a proxy for its
time; a GPU run decides.

    PYTHONPATH=. python experiments/kernels/sass_topp.py [--baseline FILE] [--out DIR]

Run it with the Triton the GPU machine has (3.6: `pip install triton==3.6.0 torch==2.13.0` into its own venv):
the SASS is that version's. Writes results/sass_topp_sm90.json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_topp_split import load_baseline  # noqa: E402

from rlalign.kernels.triton import topp  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# instruction families counted per loop
FAMILIES = {"fp32": ("FMUL", "FADD", "FFMA"), "vote": ("VOTE",), "barrier": ("BAR",), "load": ("LDG",),
            "atomic": ("ATOM", "RED"), "convert": ("F2I", "I2F", "FRND", "F2F"), "select": ("SEL", "FSEL"),
            "spill_store": ("STL",), "spill_load": ("LDL",), "wgmma": ("HGMMA",), "async_copy": ("LDGSTS", "UTMALDG")}


def compile_sm90(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int = 3):
    """fn compiled for sm_90 (arguments not in types are constexprs), without FMA contraction."""
    names = list(fn.arg_names)
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages,
                                                                              enable_fp_fusion=False))


def sass_stats(kernel) -> dict:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    usage = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    ins = [(int(m.group(1), 16), m.group(3)) for line in sass.splitlines()
           if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9.]+)", line))]
    text = {a: line for line in sass.splitlines() if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line))
            for a in [int(m.group(1), 16)]}
    loops = []
    for a, op in ins:  # a backward branch closes a loop
        m = re.search(r"BRA (?:!?U?P\w+, )?0x([0-9a-f]+)", text[a]) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) <= a:
            start = int(m.group(1), 16)
            ops = Counter(op.split(".")[0] for b, op in ins if start <= b <= a)
            loops.append({"start": hex(start), "instructions": sum(ops.values()),
                          **{fam: sum(ops[o] for o in ops if o.startswith(p)) for fam, p in FAMILIES.items()}})
    whole = Counter(op.split(".")[0] for _, op in ins)
    return {**usage, "instructions": len(ins), **{fam: sum(whole[o] for o in whole if o.startswith(p))
                                                  for fam, p in FAMILIES.items()}, "loops": loops}


def cut_kernels(mod) -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, argument types, constexprs) of the module's launches at its own settings."""
    base = dict(SCALED=True, NB=mod.CUT_BINS, NE=mod.EST_BINS, ESCALE=mod.est_scale(mod.EST_BINS),
                RANK=mod.EST_RANK, DMIN=mod.EST_DMIN, RETRIES=mod.EST_RETRIES, WAYS=mod.CUT_WAYS, PAIR=mod.PAIR_MAX,
                BLOCK=mod.CUT_BLOCK, SBLOCK=mod.CUT_STREAM)
    ptrs = dict(z_ptr="*bf16", work_ptr="*fp32", cnt_ptr="*i32", cut_ptr="*i64", passes_ptr="*i32", state_ptr="*i64",
                fstate_ptr="*fp32", hist_ptr="*i32", bm_ptr="*fp32", pts_ptr="*i32", bounds_ptr="*i64", scale="fp32",
                V="i32", top_k="i32", top_p_bits="i64")
    if not hasattr(mod, "WINDOW_LAUNCHES"):  # the one-launch cut
        k = mod._cut_kernel
        return [(f"one_launch_{n}", k, ptrs, dict(base, BSCALE=mod.bin_scale(mod.CUT_BINS), PASSES=False, **cx))
                for n, cx in (("top_p", dict(HIST=True, DO_K=False, DO_P=True)),
                              ("top_k", dict(HIST=False, DO_K=True, DO_P=False)),
                              ("top_k_top_p", dict(HIST=False, DO_K=True, DO_P=True)))]
    first, window = mod._first_kernel, mod._window_kernel
    out = [("first_top_p", first, ptrs, dict(base, HIST=True, DO_K=False, DO_P=True)),
           ("first_top_k", first, ptrs, dict(base, HIST=False, DO_K=True, DO_P=False)),
           ("first_top_k_top_p", first, ptrs, dict(base, HIST=False, DO_K=True, DO_P=True))]
    out += [(f"window_{'search' if s else ''}{'retry' if r else ''}", window, ptrs,
             dict(base, BSCALE=mod.bin_scale(mod.CUT_BINS), SEARCH=s, RETRY=r, HAS_K=False))
            for s, r in ((True, False), (False, True), (True, True))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="", help="an older topp.py compiled beside the product")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    mods = [("product", topp)] + ([("baseline", load_baseline(a.baseline))] if a.baseline else [])
    kernels = {}
    for who, mod in mods:
        for name, fn, types, cx in cut_kernels(mod):
            st = sass_stats(compile_sm90(fn, types, cx, mod.CUT_WARPS))
            kernels[f"{who}:{name}"] = st
            print(f"{who}:{name}: {st['reg']} registers, {st.get('local', 0)} B local, loops (instructions per "
                  f"chunk) {[lp['instructions'] for lp in st['loops']]}", flush=True)
    shows = "; ".join(f"{n} {k['reg']} registers, loops {[lp['instructions'] for lp in k['loops']][:4]}"
                      for n, k in kernels.items())
    record.write("sass_topp_sm90", {"triton": triton.__version__, "target": "sm_90", "num_warps": topp.CUT_WARPS,
                                    "baseline_file": a.baseline, "kernels": kernels,
                                    "what_it_shows": f"Static SASS of the cut's kernels (Triton {triton.__version__}, "
                                                     f"sm_90, {topp.CUT_WARPS} warps): " + shows}, a.out)


if __name__ == "__main__":
    main()
