"""Old vs new GEMM module in one run (issue 12): bits at every M that matters, then decode-step speed.

    python experiments/gemm_decode_check.py OLD_GEMM_PY [--out DIR]

OLD_GEMM_PY is the previous kernels/triton/gemm.py (loaded as a second module: its own kernel,
compiled from its own source). Bits: matmul / linear at M = 1, 7, 33, 64, 65, 100, 256, 257, 300,
1024, 4096 (dense decode shapes and bench-moe-large's N), grouped_linear with host counts and with
device counts (COUNTS mode), ragged counts with empty, single-row and > 64 / > 256-row groups, at
R = 8 .. 32768, and the grouped dX (grouped GEMM over w^T, the training backward): old output ==
new output, torch.equal, every case. Speed: one decode step of bench-moe-large at 256 live rows
(16 layers of q, k, v, o, router, expert gate_up and down in COUNTS mode, the lm head) through the
public functions, from a CUDA graph, median of triton.testing.do_bench, old and new alternately.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import RESULTS, write  # noqa: E402

import rlalign.kernels.triton  # noqa: E402,F401 (the package the old module's relative imports need)
from rlalign.kernels.triton import gemm as NEW  # noqa: E402

BF = torch.bfloat16
PEAK = 4.8e12


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("rlalign.kernels.triton.gemm_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    plans: dict = {}  # its own plan cache: the shared one would hand it the new module's launches (same keys)

    def cached(key, build):
        if key not in plans:
            plans[key] = build()
        return plans[key]

    mod._cached = cached
    return mod


def ragged(R: int, E: int, g: torch.Generator) -> list[int]:
    """R rows over E groups: skewed (a few big groups, empty ones, single rows)."""
    if R <= 0:
        return [0] * E
    w = torch.rand(E, generator=g) ** 3
    w[torch.randperm(E, generator=g)[: E // 8]] = 0
    c = torch.floor(w / w.sum() * R).long()
    c[int(torch.argmax(w))] += R - int(c.sum())
    return c.tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    OLD = load_old(a.old)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    gc = torch.Generator().manual_seed(0)

    def rnd(*shape, s=0.02):
        return (torch.randn(*shape, device=dev, generator=g) * s).to(BF)

    cases, bad = [], []

    def check(label, f):
        with torch.no_grad():
            o, n = f(OLD), f(NEW)
        same = torch.equal(o, n)
        cases.append({"case": label, "bits_equal": same})
        if not same:
            bad.append(label)
            print("DIFF", label, flush=True)

    # dense: matmul / linear
    for K, N in ((2048, 2048), (2048, 512), (2048, 64), (2048, 32000), (768, 2048), (1024, 1536)):
        w = rnd(N, K)
        for M in (1, 7, 33, 64, 65, 100, 256, 257, 300, 1024, 4096):
            x = rnd(M, K, s=1.0)
            check(f"linear M={M} K={K} N={N}", lambda m, x=x, w=w: m.linear(x, w))
            if N <= 2048:
                check(f"matmul M={M} K={K} N={N}", lambda m, x=x, w=w: m.matmul(x, w.t().contiguous()))
    # weight gradients of a linear (K = tokens, the masked K loop): g^T x
    for N, K in ((64, 2048), (128, 2048), (256, 512), (512, 2048)):
        for T in (1, 7, 64, 300, 4096):
            gy, xx = rnd(T, N, s=1.0), rnd(T, K, s=1.0)
            check(f"wgrad T={T} out={N} in={K}", lambda m, gy=gy, xx=xx: m._matmul(gy.t(), xx, False, token_k=True))
    # grouped: host counts and device counts, gate_up and down shapes, and the dX GEMM
    E = 64
    for K, N in ((2048, 1536), (768, 2048)):
        w = rnd(E, N, K)
        for R in (8, 56, 512, 2048, 4096, 8192, 32768):
            x = rnd(R, K, s=1.0)
            for kind in ("uniform", "ragged"):
                if kind == "uniform":
                    ids = torch.randn(R // 8 if R >= 8 else 1, E, generator=gc).topk(8, dim=1).indices.flatten()[:R]
                    counts = torch.bincount(ids, minlength=E).tolist()
                else:
                    counts = ragged(R, E, gc)
                dcounts = torch.tensor(counts, device=dev)
                check(f"grouped host {kind} R={R} K={K} N={N}", lambda m, x=x, w=w, c=counts: m.grouped_linear(x, w, c))
                check(f"grouped device {kind} R={R} K={K} N={N}",
                      lambda m, x=x, w=w, c=dcounts: m.grouped_linear(x, w, c))
                gy = rnd(R, N, s=1.0)
                check(f"grouped dX device {kind} R={R} K={K} N={N}",
                      lambda m, gy=gy, w=w, c=dcounts: m._grouped_mm(gy, w.transpose(1, 2), c))
                check(f"grouped dX host {kind} R={R} K={K} N={N}",
                      lambda m, gy=gy, w=w, c=counts: m._grouped_mm(gy, w.transpose(1, 2), c))
    print(f"bits: {len(cases) - len(bad)}/{len(cases)} cases equal", flush=True)

    # speed: one decode step at 256 live rows
    L, d, inter, T, k = 16, 2048, 768, 256, 8
    wgu = [rnd(E, 2 * inter, d) for _ in range(L)]
    wdn = [rnd(E, d, inter) for _ in range(L)]
    dense_n = [2048, 512, 512, 2048, 64]
    wd = [[rnd(n, d) for n in dense_n] for _ in range(L)]
    head = rnd(32000, d)
    ids = torch.randn(T, E, device=dev, generator=g).topk(k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=E)
    R = T * k
    x, xs, hs = rnd(T, d, s=1.0), rnd(R, d, s=1.0), rnd(R, inter, s=1.0)

    def parts(m):
        return {
            "experts_gate_up": lambda: [m.grouped_linear(xs, wgu[i], counts) for i in range(L)],
            "experts_down": lambda: [m.grouped_linear(hs, wdn[i], counts) for i in range(L)],
            "dense": lambda: [m.linear(x, w) for i in range(L) for w in wd[i]],
            "lm_head": lambda: m.linear(x, head),
        }

    nbytes = {"experts_gate_up": sum(w.numel() * 2 for w in wgu), "experts_down": sum(w.numel() * 2 for w in wdn),
              "dense": sum(w.numel() * 2 for ws in wd for w in ws), "lm_head": head.numel() * 2}
    timing = {}
    with torch.no_grad():
        graphs = {}
        for label, m in (("old", OLD), ("new", NEW)):
            for part, fn in parts(m).items():
                fn()
                torch.cuda.synchronize()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    fn()
                graphs[(label, part)] = gr
        for _rep in range(2):  # old, new, old, new: drift shows as a rep-to-rep change
            for label in ("old", "new"):
                for part in nbytes:
                    t = do_bench(graphs[(label, part)].replay, warmup=5, rep=80, return_mode="median") / 1e3
                    timing.setdefault(part, {}).setdefault(label, []).append(t)
    rows = {}
    print(f"\n{'part':16s} {'old ms':>9s} {'new ms':>9s} {'speedup':>8s} {'old %HBM':>9s} {'new %HBM':>9s}")
    tot = {"old": 0.0, "new": 0.0}
    for part, tt in timing.items():
        o, n = min(tt["old"]), min(tt["new"])
        tot["old"] += o
        tot["new"] += n
        rows[part] = {"old_s": tt["old"], "new_s": tt["new"], "bytes": nbytes[part], "speedup": o / n,
                      "old_fraction_of_hbm_peak": nbytes[part] / o / PEAK,
                      "new_fraction_of_hbm_peak": nbytes[part] / n / PEAK}
        print(f"{part:16s} {o * 1e3:9.3f} {n * 1e3:9.3f} {o / n:8.2f} {100 * nbytes[part] / o / PEAK:8.1f}% "
              f"{100 * nbytes[part] / n / PEAK:8.1f}%")
    allb = sum(nbytes.values())
    print(f"{'decode step':16s} {tot['old'] * 1e3:9.3f} {tot['new'] * 1e3:9.3f} {tot['old'] / tot['new']:8.2f} "
          f"{100 * allb / tot['old'] / PEAK:8.1f}% {100 * allb / tot['new'] / PEAK:8.1f}%")
    print(f"bits: {len(cases) - len(bad)}/{len(cases)} cases equal" + (f"; DIFF: {bad}" if bad else ""))
    print("wrote", write("gemm_decode_check_H200", {
        "bits": {"cases": len(cases), "equal": len(cases) - len(bad), "differing": bad, "all": cases},
        "decode_step_256_rows": rows, "decode_step_total_s": tot, "decode_step_bytes": allb,
        "hbm_peak_bytes_per_s": PEAK, "counts": counts.tolist(),
        "configs_new": {"grouped_rows_per_group_32": NEW._grouped_config(BF, 32),
                        "dense_m256_n2048": NEW._config(BF, 256, 2048),
                        "dense_m256_n32000": NEW._config(BF, 256, 32000)},
        "configs_old": {"grouped_rows_per_group_32": OLD._config(BF, 32), "dense_m256": OLD._config(BF, 256)}}, a.out))
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
