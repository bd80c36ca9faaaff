"""The dense GEMM kernel (kernels/triton/gemm.py, a plain matmul: one problem, bf16) compiled for sm_90 without a
GPU, at the main config and the half-width one, with tensor descriptors (TMA: the forward GEMMs) and with pointer
loads (a weight gradient, dX, gathered rows, SWIGLU's columns): registers, spills (STL / LDL) and each loop's
instructions, spills and wgmma from the SASS (cuobjdump). A GPU run decides the time.

    PYTHONPATH=. python experiments/kernels/sass_gemm.py [--out DIR]

Run it with the Triton the GPU machine has (3.6; see sass_topp.py). Writes results/sass_gemm_sm90.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402
from sass_topp import compile_sm90, sass_stats  # noqa: E402

from rlalign.kernels.triton import gemm, gemm_configs  # noqa: E402

TYPES = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", prob_ptr="*i64", idx_ptr="*i32", num_tiles="i32", N="i32",
             M1="i32", K1="i32", sam="i32", sak="i32", sbk="i32", sbn="i32", scm="i32", scn="i32", R="i32",
             a_step="i32", b_step="i32", b_e="i32", c_step="i32", c_e="i32", a_rows="i32", b_rows="i32")
# a plain matmul's flags (gemm._gemm_plan: one problem at offset 0, K a multiple of BLOCK_K, K-contiguous operands)
PLAIN = dict(P=1, P2=2, NUM_SMS=132, UPCAST=False, IEEE=False, SINGLE=True, COUNTS=False, GROUP_K=False,
             ALIGNED=True, EVEN_K=True, A_M_CONTIG=False, B_N_CONTIG=False, PER_N=False, FLATTEN=False,
             MASK_M=False, GATHER=0, HALF_TAIL=False, SWIGLU=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    configs = {"main": gemm_configs.MATMUL_CONFIGS[torch.bfloat16],
               "half": gemm_configs.MATMUL_PAST_SMALL_M[torch.bfloat16][0]}
    out = []
    for name, cfg in configs.items():
        for tma in (True, False):
            c = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
            cx = {k: v for k, v in {**PLAIN, **c, "TMA": tma}.items() if k in gemm._gemm_kernel.arg_names}
            st = sass_stats(compile_sm90(gemm._gemm_kernel, TYPES, cx, cfg["num_warps"], cfg["num_stages"]))
            r = {"config": name, "tile": f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}",
                 "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "tma": tma,
                 **{k: v for k, v in st.items() if k != "loops"},
                 "loops": [{k: lp[k] for k in ("instructions", "spill_store", "spill_load", "wgmma")}
                           for lp in st["loops"]]}
            out.append(r)
            print(f"{name} {r['tile']} w{r['num_warps']} TMA {tma}: {r['reg']} registers, {r.get('stack', 0)} B "
                  f"stack, loops {[(lp['instructions'], lp['spill_store'] + lp['spill_load']) for lp in r['loops']]}",
                  flush=True)
    shows = "; ".join(f"{r['config']} {r['tile']} {'TMA' if r['tma'] else 'pointers'}: {r['reg']} registers, "
                      f"{r.get('stack', 0)} B stack, spill instructions per loop "
                      f"{[lp['spill_store'] + lp['spill_load'] for lp in r['loops']]} (loop instructions "
                      f"{[lp['instructions'] for lp in r['loops']]})" for r in out)
    record.write("sass_gemm_sm90", {"triton": triton.__version__, "target": "sm_90", "kernels": out,
                                    "what_it_shows": f"Static SASS of the dense GEMM (Triton {triton.__version__}, "
                                                     f"sm_90, bf16, a plain matmul): " + shows}, a.out)


if __name__ == "__main__":
    main()
