# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""The GEMMs of a bench-moe-large decode step at many rows (T tokens): the expert GEMMs (gate_up
[64, 1536, 2048], down [64, 2048, 768]) over 8 T rows routed top-8 at random, counts on the device as
in the decode graphs, and the dense linears (q/k/v in one launch, o, the lm head) at M = T. Each
candidate config is timed under a CUDA graph and its output compared bitwise with the main config's
(a candidate may serve a bucket only with the same bits); cuBLAS (dense) and torch._grouped_mm
(experts) as the vendor marks.

    python experiments/sweep_decode_gemm.py [--tokens 1024,2048,4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vendor import bits_equal, graph_ms  # noqa: E402
from record import RESULTS, write  # noqa: E402

from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.kernels.triton import gemm  # noqa: E402

BF = torch.bfloat16
WHAT = "decode-step GEMMs at many rows: candidate configs, time and bits against the main config's"
MAIN = dict(gemm.MATMUL_CONFIGS[BF])


def _g(bm, bn, bk, s, w, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_stages=s, num_warps=w, **kw)


CANDIDATES = {  # "pinned": the op set's own tables (what a decode step runs today)
    "pinned": None,
    "main": MAIN,
    "128x256k64s4w8": _g(128, 256, 64, 4, 8),
    "128x256k64s3w8f": _g(128, 256, 64, 3, 8, FLATTEN=True),
    "128x128k64s4w8": _g(128, 128, 64, 4, 8),
    "128x128k64s4w4": _g(128, 128, 64, 4, 4),
    "128x128k128s3w8f": _g(128, 128, 128, 3, 8, FLATTEN=True),
    "64x256k64s4w4": _g(64, 256, 64, 4, 4),
    "64x128k128s4w4f": _g(64, 128, 128, 4, 4, FLATTEN=True),
}


SAVED = (dict(gemm.MATMUL_CONFIGS[BF]), gemm.MATMUL_SMALL_M[BF], gemm.GROUPED_SMALL_M[BF], gemm.GROUPED_SHORT_K[BF])
TABLES: list = []


def use(cfg: dict | None) -> None:
    """Every GEMM of the op set in cfg (main config, no small-M or grouped buckets); None: the pinned tables."""
    if cfg is None:
        gemm.MATMUL_CONFIGS[BF], gemm.MATMUL_SMALL_M[BF], gemm.GROUPED_SMALL_M[BF], gemm.GROUPED_SHORT_K[BF] = (
            dict(SAVED[0]), *SAVED[1:])
    else:  # a new small-M table object each time: linear's plans are keyed by its id (kept alive: no reuse)
        gemm.MATMUL_CONFIGS[BF] = dict(cfg)
        gemm.MATMUL_SMALL_M[BF] = (0, 0, SAVED[1][2])
        TABLES.append(gemm.MATMUL_SMALL_M[BF])
        gemm.GROUPED_SMALL_M[BF], gemm.GROUPED_SHORT_K[BF] = [], None


def shapes(T: int, g: torch.Generator) -> dict:
    """name -> (our fn, vendor fn) at T tokens."""
    d, E, k, inter, V = 2048, 64, 8, 768, 32000
    ids = torch.rand(T, E, generator=g, device="cuda").topk(k, dim=1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(T * k, d, generator=g, device="cuda").to(BF)
    h = torch.randn(T * k, inter, generator=g, device="cuda").to(BF)
    gu = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") * 0.02).to(BF)
    dn = (torch.randn(E, d, inter, generator=g, device="cuda") * 0.02).to(BF)
    xt = torch.randn(T, d, generator=g, device="cuda").to(BF)
    wq, wk, wv, wo = ((torch.randn(n, d, generator=g, device="cuda") * 0.02).to(BF) for n in (d, 512, 512, d))
    wr = (torch.randn(E, d, generator=g, device="cuda") * 0.02).to(BF)
    lm = (torch.randn(V, d, generator=g, device="cuda") * 0.02).to(BF)
    gmm = getattr(torch, "_grouped_mm", None)

    def vendor_grouped(a, w):
        return (lambda: gmm(a, w.transpose(1, 2), offs=offs)) if gmm is not None else None

    return {
        "experts gate_up": (lambda: tb.grouped_linear(x, gu, counts), vendor_grouped(x, gu)),
        "experts down": (lambda: tb.grouped_linear(h, dn, counts), vendor_grouped(h, dn)),
        "qkv": (lambda: torch.cat([y.reshape(-1) for y in tb.linears(xt, [wq, wk, wv], [None] * 3)]),
                lambda: torch.cat([(xt @ w.t()).reshape(-1) for w in (wq, wk, wv)])),
        "o_proj": (lambda: tb.linear(xt, wo), lambda: xt @ wo.t()),
        "router": (lambda: tb.linear(xt, wr), lambda: xt @ wr.t()),
        "lm_head": (lambda: tb.linear(xt, lm), lambda: xt @ lm.t()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048,4096")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="sweep_decode_gemm_h200")
    a = ap.parse_args()
    rows = []
    with torch.no_grad():
        for T in (int(t) for t in a.tokens.split(",")):
            g = torch.Generator(device="cuda").manual_seed(T)
            for name, (ours, vendor) in shapes(T, g).items():
                use(MAIN)
                ref = ours().clone()
                row = {"tokens": T, "shape": name}
                try:
                    row["vendor_us"] = 1e3 * graph_ms([vendor]) if vendor is not None else None
                except Exception as e:  # noqa: BLE001 - a vendor op may not take these shapes
                    row["vendor_us"], row["vendor_error"] = None, f"{type(e).__name__}: {e}"[:160]
                for cname in a.candidates.split(","):
                    use(CANDIDATES[cname])
                    try:
                        same = bits_equal(ours(), ref)
                        row[cname] = {"us": 1e3 * graph_ms([ours]), "bits_equal_main": same}
                    except Exception as e:  # noqa: BLE001 - out of shared memory, ...
                        row[cname] = {"error": f"{type(e).__name__}: {e}"[:160]}
                rows.append(row)
                write(a.name, {"rows": rows, "candidates": CANDIDATES, "what_it_shows": WHAT}, a.out)
                ok = sorted((v["us"], k) for k, v in row.items() if isinstance(v, dict) and "us" in v)
                print(f"T={T:5d} {name:16s} vendor {row['vendor_us'] or float('nan'):8.1f} us  pinned "
                      f"{row['pinned'].get('us', float('nan')):8.1f} us  | "
                      + "  ".join(f"{k} {u:.1f}{'' if row[k]['bits_equal_main'] else ' BITDIFF'}" for u, k in ok[:5]),
                      flush=True)
    use(None)
    print("wrote", write(a.name, {"rows": rows, "candidates": CANDIDATES, "what_it_shows": WHAT}, a.out))


if __name__ == "__main__":
    main()
