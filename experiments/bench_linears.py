"""q, k, v as three `linear` launches vs one `linears` launch, bits and speed in one run.

    python experiments/bench_linears.py [--out DIR] [--candidates]

Shapes: bench-moe-large (K 2048, N 2048/512/512) and the 30B one (K 2048, N 4096/512/512), M = 1, 8,
16, 32, 64, 128, 256, 512, 4096. Each variant runs 16 layers of distinct weights (the decode step's 16 layers; the
weights do not fit in L2) captured in one CUDA graph; times are medians of triton.testing.do_bench of
the replay, per layer, the variants alternating (two rounds, the faster kept). Bits: every output of
`linears` (eager and replayed) torch.equal to the separate linears'. --candidates: also other configs
of the family (BLOCK_K 64/128, the same MMA chain) for the one launch, to pick its table (each set as
the only member of gemm.MATMUL_SMALL_M's family for its variant).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, write  # noqa: E402

import rlalign.kernels.triton  # noqa: E402,F401
from rlalign.kernels.triton import gemm  # noqa: E402
from rlalign.kernels.triton.common import num_sms  # noqa: E402

BF = torch.bfloat16
PEAK = 4.8e12
LAYERS = 16
SHAPES = {"bench-moe-large": (2048, (2048, 512, 512)), "qwen3-30b": (2048, (4096, 512, 512))}
MS = (1, 8, 16, 32, 64, 128, 256, 512, 4096)
_64x32 = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_stages=6, num_warps=4)
_64x64f = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_stages=4, num_warps=4, FLATTEN=True)
_64x128f = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_stages=4, num_warps=4, FLATTEN=True)
# name -> (config, rows it is tried at); "m": rows past M masked instead of reads of row 0 (MASK_M)
CANDIDATES = {
    "64x32s6": (_64x32, (1, 512)), "64x32s6m": (dict(_64x32, MASK_M=True), (1, 512)),
    "64x64s4f": (_64x64f, (1, 512)), "64x64s4fm": (dict(_64x64f, MASK_M=True), (1, 512)),
    "64x128s4f": (_64x128f, (1, 512)), "64x128s4fm": (dict(_64x128f, MASK_M=True), (1, 512)),
    "main": (dict(gemm.MATMUL_CONFIGS[BF]), (256, 1 << 20)),
}


def bits_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(torch.int16), y.view(torch.int16))
                                    for x, y in zip(a, b))


def graph_of(fn):
    fn()  # warm-up outside the capture: compile, plans
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = fn()
    return gr, out


def make_variants(x, layers, candidates: dict) -> dict:
    """name -> fn running the 16 layers: the separate linears, the one launch with its own config
    ("one"), and with each candidate config (the only entry of the small-M table, at every M)."""
    pinned = gemm.MATMUL_SMALL_M[BF]

    def separate():
        return [[gemm.linear(x, w) for w in ws] for ws in layers]

    def one(cfg=None):
        gemm.MATMUL_SMALL_M[BF] = pinned if cfg is None else (1 << 30, 0, [cfg])
        try:
            return [gemm.linears(x, ws, [None] * 3) for ws in layers]
        finally:
            gemm.MATMUL_SMALL_M[BF] = pinned

    out = {"separate": separate, "one": one}
    m = x.shape[0]
    out.update({name: (lambda cfg=cfg: one(cfg)) for name, (cfg, (lo, hi)) in candidates.items() if lo <= m <= hi})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--candidates", action="store_true")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, bad = [], []
    with torch.no_grad():
        for shape, (K, ns) in SHAPES.items():
            layers = [[(torch.randn(n, K, device="cuda", generator=g) * 0.02).to(BF) for n in ns]
                      for _ in range(LAYERS)]
            wbytes = sum(w.numel() * 2 for ws in layers for w in ws)
            for M in MS:
                x = torch.randn(M, K, device="cuda", generator=g).to(BF)
                ref = [[gemm.linear(x, w) for w in ws] for ws in layers]
                variants = make_variants(x, layers, CANDIDATES if a.candidates else {})
                graphs, same = {}, {}
                for name, fn in variants.items():
                    eager = fn()
                    gr, out = graph_of(fn)
                    gr.replay()
                    torch.cuda.synchronize()
                    same[name] = all(bits_equal(e, r) and bits_equal(o, r) for e, o, r in zip(eager, out, ref))
                    graphs[name] = gr
                    if not same[name]:
                        bad.append(f"{shape} M={M} {name}")
                        print("DIFF", shape, M, name, flush=True)
                times: dict = {}
                for _ in range(2):
                    for name, gr in graphs.items():
                        t = do_bench(gr.replay, warmup=5, rep=40, return_mode="median") / 1e3 / LAYERS
                        times.setdefault(name, []).append(t)
                best = {k: min(v) for k, v in times.items()}
                base = best["separate"]
                row = {"shape": shape, "M": M, "K": K, "N": list(ns),
                       "config_one": gemm.small_m_config(BF, M, list(ns), num_sms(x.device)),
                       "per_layer_s": best, "rounds_s": times, "bits_equal": same,
                       "speedup_vs_separate": {k: base / v for k, v in best.items()},
                       "fraction_of_hbm_peak": {k: (wbytes / LAYERS + M * K * 2 + M * sum(ns) * 2) / v / PEAK
                                                for k, v in best.items()}}
                rows.append(row)
                print(f"{shape:16s} M={M:5d} " + " ".join(f"{k} {v * 1e6:7.2f}us ({base / v:4.2f}x)"
                                                            for k, v in best.items()), flush=True)
                del graphs
                torch.cuda.empty_cache()
    n_cases = sum(len(r["bits_equal"]) for r in rows)
    print(f"bits: {n_cases - len(bad)}/{n_cases} equal" + (f"; DIFF: {bad}" if bad else ""))
    print("wrote", write("linears_H200", {
        "layers": LAYERS, "rows": rows, "candidates": CANDIDATES if a.candidates else {},
        "bits": {"cases": n_cases, "differing": bad}, "hbm_peak_bytes_per_s": PEAK}, a.out))
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
