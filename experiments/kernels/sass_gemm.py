"""The GEMM kernel (kernels/triton/gemm.py) as the product launches it, compiled for sm_90 without a GPU: a linear's
forward, dX and dW at the issue's MoE shapes (4,096 tokens: 2,048 -> 768 and 768 -> 2,048), and the experts'
grouped GEMM forward and backward (64 experts of 128 rows, 2,048 -> 768). Registers, spills (STL / LDL), wgmma,
async copies (LDGSTS, TMA) and each loop's instructions from the SASS (cuobjdump; the launches captured and
specialised as at run time: sass.py). A GPU run decides the time.

    PYTHONPATH=. python experiments/kernels/sass_gemm.py [--out DIR]

Run it with the Triton the GPU machine has (3.6; see sass.py). Writes results/sass_gemm_sm90.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402
from sass import captured, cpu_tensor, sass_stats, spec_of  # noqa: E402

from rlalign.kernels.triton import gemm  # noqa: E402

TOKENS, E, PER = 4096, 64, 128
FLAGS = ("TMA", "GATHER", "SWIGLU", "A_M_CONTIG", "B_N_CONTIG", "COUNTS", "GROUP_K", "EVEN_K", "MASK_M", "FLATTEN")


def calls() -> dict:
    """call site -> its captured launches."""
    out = {}
    for k, n in ((2048, 768), (768, 2048)):
        with captured() as got:
            x, w = cpu_tensor(TOKENS, k).requires_grad_(), cpu_tensor(n, k).requires_grad_()
            gemm.linear(x, w).backward(cpu_tensor(TOKENS, n))
        out[f"linear {TOKENS}x{k}->{n} (forward, dX, dW)"] = got
    with captured() as got:
        x, w = cpu_tensor(E * PER, 2048).requires_grad_(), cpu_tensor(E, 768, 2048).requires_grad_()
        gemm.grouped_linear(x, w, [PER] * E).backward(cpu_tensor(E * PER, 768))
    out[f"grouped {E}x{PER} rows 2048->768 (forward, dX, dW)"] = got
    return out


def row(site: str, launch) -> dict:
    st = sass_stats(launch.compile())
    a = launch.args
    r = {"call": site, "kernel": launch.name, "tile": f"{a.get('BLOCK_M')}x{a.get('BLOCK_N')}x{a.get('BLOCK_K')}",
         **launch.options, "flags": {f: a[f] for f in FLAGS if f in a}, "specialisation": spec_of(launch),
         **{k: v for k, v in st.items() if k != "loops"},
         "loops": [{k: lp[k] for k in ("instructions", "spill_store", "spill_load", "wgmma", "async_copy")}
                   for lp in st["loops"]]}
    print(f"{site} {launch.name} {r['tile']} w{r.get('num_warps')} {r['flags']}: {r['reg']} registers, "
          f"{r.get('stack', 0)} B stack, async {r['async_copy']}, loops "
          f"{[(lp['instructions'], lp['spill_store'] + lp['spill_load']) for lp in r['loops']]}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    out = [row(site, launch) for site, got in calls().items() for launch in got if launch.name == "_gemm_kernel"]
    shows = "; ".join(f"{r['call']} {r['tile']} {'TMA' if r['flags'].get('TMA') else 'pointers'}: {r['reg']} "
                      f"registers, {r.get('stack', 0)} B stack, K-loop instructions / spills "
                      f"{[(lp['instructions'], lp['spill_store'] + lp['spill_load']) for lp in r['loops']][:2]}"
                      for r in out)
    record.write("sass_gemm_sm90", {"triton": triton.__version__, "target": "sm_90", "kernels": out,
                                    "what_it_shows": f"Static SASS of the GEMM kernel as launched (Triton "
                                                     f"{triton.__version__}, sm_90, bf16; the JIT's specialisation "
                                                     f"applied): " + shows}, a.out)


if __name__ == "__main__":
    main()
