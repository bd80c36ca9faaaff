# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""The experts' gate_up GEMM with the SwiGLU in its epilogue (grouped_mm(..., swiglu=True), the kernels'
moe_slot_swiglu) against the GEMM writing [R, 2I] and swiglu_halves reading it back, bench-moe-large's
gate_up [64, 1536, 2048] over the token rows gathered in place (routed top-8 by a router GEMM, counts on the
device as in the decode graphs). Bits: the fused output against swiglu_halves(GEMM) with torch.equal on the raw
bits, on the timed inputs and on inputs holding inf / NaN entries and rows whose products overflow. Time: each
variant under a CUDA graph (sweep_grouped_sched's CALLS launches a replay), the graphs replayed in turn
(interleaved_us), median.

    python experiments/bench_swiglu_fused.py [--tokens 256,1024,2048,4096,8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vendor import bits_equal  # noqa: E402
from record import RESULTS, write  # noqa: E402
from sweep_grouped_sched import capture, interleaved_us, routed  # noqa: E402

from rlalign.kernels.triton import elementwise, gemm  # noqa: E402

BF = torch.bfloat16
WHAT = "gate_up GEMM + swiglu_halves vs the SwiGLU in the GEMM's epilogue: bits and time under CUDA graphs"


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """x with an inf, a -inf and a NaN entry in three rows and two rows of +-3e38 (the GEMM's sums overflow)."""
    x = x.clone()
    x[0, 5], x[1, 17], x[2, 1000] = float("inf"), float("-inf"), float("nan")
    x[3], x[4] = 3e38, -3e38
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048,4096,8192")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="bench_swiglu_fused_h200")
    a = ap.parse_args()
    d, E, k, inter = 2048, 64, 8, 768
    rows = []
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(0)
        gu = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") * 0.02).to(BF)
        for T in (int(t) for t in a.tokens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(T)
            counts, order = routed(T, "router", g)
            xt = torch.randn(T, d, generator=g, device="cuda").to(BF)
            xs = with_specials(xt)
            fns = {"gemm": lambda x=xt: gemm.grouped_mm(x, gu, counts, order, k),
                   "gemm_swiglu": lambda x=xt: elementwise.swiglu_halves(gemm.grouped_mm(x, gu, counts, order, k)),
                   "fused": lambda x=xt: gemm.grouped_mm(x, gu, counts, order, k, swiglu=True)}
            ref, ref_s = fns["gemm_swiglu"](), fns["gemm_swiglu"](xs)
            hc = counts.tolist()
            xg = xs.index_select(0, order // k)
            row = {"tokens": T, "counts": {"min": min(hc), "max": max(hc)},
                   "bits_equal": bits_equal(fns["fused"](), ref),
                   "bits_equal_specials": bits_equal(fns["fused"](xs), ref_s),
                   "specials_nonfinite": int((~ref_s.float().isfinite()).sum()),
                   "bits_equal_host_counts": bits_equal(gemm.grouped_mm(xg, gu, hc, swiglu=True),
                                                        elementwise.swiglu_halves(gemm.grouped_mm(xg, gu, hc)))}
            graphs = {n: capture(f) for n, f in fns.items()}
            row["us"] = interleaved_us(graphs)
            del graphs
            rows.append(row)
            us = row["us"]
            print(f"T={T:5d} counts {row['counts']['min']}-{row['counts']['max']} bits "
                  f"{row['bits_equal']}/{row['bits_equal_specials']}/{row['bits_equal_host_counts']} "
                  f"(nonfinite {row['specials_nonfinite']}) | gemm {us['gemm']:.1f} "
                  f"gemm+swiglu {us['gemm_swiglu']:.1f} "
                  f"fused {us['fused']:.1f} us ({us['fused'] / us['gemm_swiglu']:.3f}x)", flush=True)
    print("wrote", write(a.name, {"rows": rows, "what_it_shows": WHAT}, a.out))


if __name__ == "__main__":
    main()
