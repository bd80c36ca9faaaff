"""The attention kernels (kernels/triton/attention.py) as the product launches them, compiled for sm_90 without a
GPU: the prefill forward and its backward (dK/dV, dQ) at B x T = 8 x 1024, and paged decode (256 rows of 512 keys
in pages of 16, the engine's layout), at the pinned configs and at candidates. Registers, the stack a thread spills
to, spill stores / loads (STL / LDL), wgmma, async copies and each loop's instructions from the SASS (cuobjdump;
the launches captured and specialised as at run time: sass.py). A GPU run decides the time, and whether a candidate
keeps the bits (sweep_attention_tiles.py).

    PYTHONPATH=. python experiments/kernels/sass_attention.py [--out DIR]

Run it with the Triton the GPU machine has (3.6; see sass.py). Writes results/sass_attention_sm90.json.
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
from sass import captured, cpu_tensor, sass_stats, spec_of  # noqa: E402

from rlalign.kernels.triton import attention as at  # noqa: E402

H, HK, D = 32, 8, 128  # GQA 32 / 8, head dim 128 (bench-moe-large, the shapes)
B, T = 8, 1024
ROWS, KEYS, PAGE = 256, 512, 16
# kernel kind -> candidate overrides (constexprs and launch options) beside the pinned config
CANDIDATES = {
    "prefill": [dict(num_warps=8), dict(BLOCK_M=128, num_warps=8)],
    "decode": [dict(num_warps=8)],
    "bwd": [dict(num_warps=8), dict(BLOCK_M=64, BLOCK_N=32, num_warps=8), dict(BLOCK_M=32, BLOCK_N=32)],
    "bwd_dq": [dict(num_warps=8), dict(BLOCK_M=32, BLOCK_N=32)],
}


def launches() -> dict:
    """kind -> the captured launch: prefill forward + backward, and a paged decode step."""
    q = cpu_tensor(B * T, H, D).requires_grad_()
    k, v = cpu_tensor(B * T, HK, D).requires_grad_(), cpu_tensor(B * T, HK, D).requires_grad_()
    pages = ROWS * KEYS // PAGE
    kp, vp = cpu_tensor(pages, PAGE, HK, D), cpu_tensor(pages, PAGE, HK, D)
    table = torch.arange(pages, dtype=torch.int32).reshape(ROWS, KEYS // PAGE)
    with captured() as got:
        o = at.attention_prefill(q, k, v, [i * T for i in range(B + 1)], D**-0.5)
        o.backward(torch.empty_like(o))
        at.attention_paged(cpu_tensor(ROWS, H, D), kp, vp, table, torch.arange(ROWS, dtype=torch.int32),
                           torch.full((ROWS,), KEYS - 1, dtype=torch.int32), D**-0.5)
    fwd = [g for g in got if g.name == "_attn_fwd"]
    by_name = {g.name: g for g in got}
    return {"prefill": fwd[0], "decode": fwd[1], "bwd": by_name["_attn_bwd_dkdv"], "bwd_dq": by_name["_attn_bwd_dq"]}


def row(which: str, kind: str, launch, override: dict) -> dict:
    st = sass_stats(launch.compile(**override))
    cfg = {**{k: launch.args[k] for k in ("BLOCK_M", "BLOCK_N")}, **launch.options, **override}
    r = {"config": which, "kind": kind, **{k: cfg.get(k) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")},
         **{k: v for k, v in st.items() if k != "loops"},
         "loop_instructions": [lp["instructions"] for lp in st["loops"]],
         "loop_spills": [lp["spill_store"] + lp["spill_load"] for lp in st["loops"]]}
    print(f"{which} {kind} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']} s{r['num_stages']}: {r['reg']} registers, "
          f"{r.get('stack', 0)} B stack, STL {r['spill_store']} LDL {r['spill_load']}, wgmma {r['wgmma']}, async "
          f"copies {r['async_copy']}, loops {r['loop_instructions']} (spills {r['loop_spills']})", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    got = launches()
    out = []
    for kind, launch in got.items():
        out.append(row("pinned", kind, launch, {}))
        out += [row("candidate", kind, launch, c) for c in CANDIDATES[kind]]
    shows = "; ".join(f"{r['config']} {r['kind']} {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']}: {r['reg']} "
                      f"registers, {r.get('stack', 0)} B stack, {r['spill_store']} STL / {r['spill_load']} LDL, "
                      f"{r['async_copy']} async copies" for r in out)
    record.write("sass_attention_sm90", {
        "triton": triton.__version__, "target": "sm_90", "G": H // HK, "D": D,
        "specialisation": {kind: spec_of(launch) for kind, launch in got.items()},
        "constexprs": {kind: {k: v for k, v in launch.args.items() if isinstance(v, (bool, int)) and
                              k.isupper()} for kind, launch in got.items()},
        "kernels": out,
        "what_it_shows": f"Static SASS of the attention kernels as launched (Triton {triton.__version__}, sm_90, "
                         f"bf16, GQA {H // HK}, D {D}; the JIT's specialisation applied): " + shows}, a.out)


if __name__ == "__main__":
    main()
