"""The attention kernels (kernels/triton/attention.py: the forward in prefill and paged-decode modes, the backward's
dK/dV and dQ) compiled for sm_90 without a GPU, at the pinned configs and at candidates: registers, the local
memory a thread spills to, the spill stores / loads (STL / LDL), the wgmma instructions, async copies, and each
loop's instructions from the SASS (cuobjdump). A kernel at 255 registers that spills in its key loop moves its
tiles through local memory every block; a GPU run decides the time, and whether a candidate keeps the bits
(sweep_attention_tiles.py).

    PYTHONPATH=. python experiments/kernels/sass_attention.py [--out DIR]

Run it with the Triton the GPU machine has (3.6; see sass_topp.py). Writes results/sass_attention_sm90.json.
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

from rlalign.kernels.triton import attention as at  # noqa: E402

BF = torch.bfloat16
G, D = 4, 128  # GQA 32 / 8, head dim 128 (bench-moe-large, the shapes)
FWD_TYPES = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", lse_ptr="*fp32", work_ptr="*i32",
                 seq_ptr="*i32", bt_ptr="*i32", mp_ptr="*fp32", lp_ptr="*fp32", ap_ptr="*fp32", cnt_ptr="*i32",
                 NC="i32", SPP="i32", sqn="i32", sqh="i32", skp="i32", skn="i32", skh="i32", son="i32", soh="i32",
                 sbt="i32", qk_scale="fp32")
BWD_TYPES = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", do_ptr="*bf16", lse_ptr="*fp32", delta_ptr="*fp32",
                 dk_ptr="*bf16", dv_ptr="*bf16", dq_ptr="*bf16", work_ptr="*i32", H="i32", scale="fp32",
                 qk_scale="fp32")
# (kind, BLOCK_M, BLOCK_N, num_warps): candidates beside the pinned configs
FWD_CANDIDATES = [("prefill", 64, 64, 8), ("prefill", 128, 64, 8), ("decode", 64, 64, 8)]
BWD_CANDIDATES = [("bwd", 32, 64, 8), ("bwd", 64, 32, 8), ("bwd", 32, 32, 4),
                  ("bwd_dq", 64, 32, 8), ("bwd_dq", 32, 32, 4), ("bwd_dq", 64, 64, 8)]


def fwd_stats(kind: str, block_m: int, block_n: int, warps: int, stages: int) -> dict:
    """The forward in prefill (MODE 0) or paged decode (MODE 2, pages of 16, the table preloaded) mode."""
    cx = dict(at._FWD_DEFAULTS, G=G, D=D, PAGE=1 if kind == "prefill" else 16, MODE=0 if kind == "prefill" else 2,
              SPLIT=False, UPCAST=False, IEEE=False, BLOCK_M=block_m, BLOCK_N=block_n,
              CHUNK=at.ATTN_FWD[BF]["CHUNK"])
    return sass_stats(compile_sm90(at._attn_fwd, FWD_TYPES, cx, warps, num_stages=stages))


def bwd_stats(kind: str, block_m: int, block_n: int, warps: int, stages: int) -> dict:
    fn = at._attn_bwd_dkdv if kind == "bwd" else at._attn_bwd_dq
    cx = dict(G=G, D=D, UPCAST=False, IEEE=False, BLOCK_M=block_m, BLOCK_N=block_n)
    return sass_stats(compile_sm90(fn, BWD_TYPES, cx, warps, num_stages=stages))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    rows = []
    for kind in ("prefill", "decode"):
        c = at._attn_cfg(kind, BF)
        rows.append(("pinned", kind, c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]))
    for kind in ("bwd", "bwd_dq"):
        c = at.ATTN_BWD[BF][kind]
        rows.append(("pinned", kind, c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]))
    rows += [("candidate", k, m, n, w, 3) for k, m, n, w in FWD_CANDIDATES + BWD_CANDIDATES]
    out = []
    for which, kind, m, n, w, s in rows:
        st = (fwd_stats if kind in ("prefill", "decode") else bwd_stats)(kind, m, n, w, s)
        r = {"config": which, "kind": kind, "BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s,
             **{k: v for k, v in st.items() if k != "loops"},
             "loop_instructions": [lp["instructions"] for lp in st["loops"]],
             "loop_spills": [lp["spill_store"] + lp["spill_load"] for lp in st["loops"]]}
        out.append(r)
        print(f"{which} {kind} {m}x{n} w{w} s{s}: {r['reg']} registers, {r.get('stack', 0)} B stack, "
              f"STL {r['spill_store']} LDL {r['spill_load']}, wgmma {r['wgmma']}, async copies {r['async_copy']}, "
              f"loops {r['loop_instructions']} (spills {r['loop_spills']})", flush=True)
    shows = "; ".join(f"{r['config']} {r['kind']} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']}: {r['reg']} "
                      f"registers, {r.get('stack', 0)} B stack, {r['spill_store']} STL / {r['spill_load']} LDL, "
                      f"{r['wgmma']} wgmma" for r in out)
    record.write("sass_attention_sm90", {"triton": triton.__version__, "target": "sm_90", "G": G, "D": D,
                                         "kernels": out, "what_it_shows": f"Static SASS of the attention kernels "
                                                                          f"(Triton {triton.__version__}, sm_90, "
                                                                          f"bf16, GQA {G}, D {D}): " + shows}, a.out)


if __name__ == "__main__":
    main()
