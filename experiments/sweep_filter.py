"""The top-k / top-p filter's launch constants on one GPU: the row program's warps, its search block and
ways (FILTER_WAYS x FILTER_BLOCK comparisons a level), the streaming chunk, each variant timed against the
pinned one on the engine's cases (bf16 logits read in place and tempered, kernels.sampling's cases).
The search's answer is exact (integer sums), so every variant must give the pinned output's bits: checked.

    python experiments/sweep_filter.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, write  # noqa: E402

from rlalign.kernels import (
    sampling,  # noqa: E402
    temper,  # noqa: E402
)
from rlalign.kernels.triton import sampling as ts  # noqa: E402

NAMES = ("FILTER_WARPS", "FILTER_BLOCK", "FILTER_WAYS", "FILTER_STREAM")
VARIANTS = [(8, 256, 16, 2048), (8, 256, 16, 1024), (4, 128, 16, 2048), (4, 256, 16, 2048), (8, 256, 8, 2048),
            (8, 512, 16, 2048), (8, 256, 16, 4096)]
CASES = [(2048, 32000, 1.0, 0.8, 0, 0.95), (2048, 32000, 4.0, 0.8, 0, 0.95), (256, 32000, 1.0, 0.8, 0, 0.95),
         (256, 151936, 1.0, 0.7, 20, 0.9)]  # rows, vocab, logit scale, temperature, top-k, top-p


def label(v: tuple) -> str:
    return "w{}_b{}_ways{}_s{}".format(*v)


def use(v: tuple) -> None:
    for name, value in zip(NAMES, v):
        setattr(ts, name, value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B, V, scale, temp, k, p in CASES:
        z = (torch.randn(B, V, generator=g, device="cuda") * 2.0 * scale).bfloat16()
        use(VARIANTS[0])
        pinned = ts.filter_logits(z, k, p, 1.0 / temp)
        ref = sampling.filter_logits(temper(z, 1.0 / temp), k, p) if B * V <= 2048 * 32000 else None
        row = {"rows": B, "vocab": V, "logit_scale": scale, "temperature": temp, "top_k": k, "top_p": p,
               "pinned_equals_torch": None if ref is None else bool(torch.equal(pinned.view(torch.int32),
                                                                                 ref.view(torch.int32))),
               "variants": {}}
        for v in VARIANTS:
            use(v)
            out = ts.filter_logits(z, k, p, 1.0 / temp)
            ms = triton.testing.do_bench(lambda z=z, k=k, p=p, s=1.0 / temp: ts.filter_logits(z, k, p, s), warmup=10,
                                         rep=60)
            row["variants"][label(v)] = {
                "ms": ms, "bits_equal_pinned": bool(torch.equal(out.view(torch.int32), pinned.view(torch.int32)))}
        use(VARIANTS[0])
        base = row["variants"][label(VARIANTS[0])]["ms"]
        print(f"{B} x {V} s{scale} T{temp} k{k} p{p} torch-equal {row['pinned_equals_torch']}: " + "  ".join(
            f"{n} {r['ms'] / base:.2f}{'' if r['bits_equal_pinned'] else '!'}" for n, r in row["variants"].items())
              + f"  (pinned {base:.3f} ms)", flush=True)
        rows.append(row)
    equal = all(r["bits_equal_pinned"] for row in rows for r in row["variants"].values())
    best = {f"{r['rows']}x{r['vocab']} s{r['logit_scale']} k{r['top_k']} p{r['top_p']}":
            min(r["variants"].items(), key=lambda kv: kv[1]["ms"])[0] for r in rows}
    shows = (f"The filter's launch constants (warps, search block, ways, stream chunk) against "
             f"the pinned {label(VARIANTS[0])}; every variant's output "
             f"bitwise equal to the pinned one: {equal}; fastest per case: {best}")
    print("wrote", write("sweep_filter_h200", {"cases": rows, "all_bits_equal": equal, "what_it_shows": shows}, a.out))


if __name__ == "__main__":
    main()
