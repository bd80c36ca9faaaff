# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""The grouped (expert) GEMM's schedules at 256-8,192 tokens of bench-moe-large (gate_up [64, 1536, 2048]
over the token rows gathered in place, down [64, 2048, 768]), counts on the device as in the decode graphs.
Tokens are routed top-8 by the router GEMM over hidden rows that share a component (the experts' loads
uneven, as a model's are) and, as a second case, by iid logits. Each schedule is timed under a CUDA graph
(CALLS launches per replay; the candidates' graphs replayed in turn, REPS rounds, median) and its output compared
bitwise with the main config's: a schedule may serve a bucket only with the same bits. "old": the tables
before the half-high last tiles, a program per tile and the short-K bucket.

    python experiments/sweep_grouped_sched.py [--tokens 256,1024,2048,4096,8192] [--out DIR] [--warm I/N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vendor import bits_equal  # noqa: E402
from record import RESULTS, write  # noqa: E402

from rlalign.kernels.triton import gemm, gemm_configs  # noqa: E402

BF = torch.bfloat16
WHAT = "grouped GEMM schedules at 1,024-8,192 tokens: time and bits against the main config's"
MAIN = dict(gemm.MATMUL_CONFIGS[BF])
PINNED = (list(gemm.GROUPED_SMALL_M[BF]), gemm.GROUPED_SHORT_K[BF])
OLD = ([(32, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_stages=4, num_warps=4, PER_SM=2)),
        (128, dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_stages=4, num_warps=4)),
        (256, dict(MAIN, num_stages=4))], None)  # past: the main config
SMALL = dict(OLD[0][0][1])
GRID = gemm_configs.TILE_PER_PROGRAM
CANDIDATES = {  # the tables (GROUPED_SMALL_M's, GROUPED_SHORT_K's) or one config for every size
    "old": OLD,
    "pinned": PINNED,
    "main": MAIN,
    "main_s4": dict(MAIN, num_stages=4),
    "half": dict(MAIN, HALF_TAIL=True),
    "half_s4": dict(MAIN, num_stages=4, HALF_TAIL=True),
    "grid_s4": dict(MAIN, num_stages=4, PER_SM=GRID),  # a program per tile (grid = the bound on the tiles)
    "half_grid": dict(MAIN, HALF_TAIL=True, PER_SM=GRID),
    "half_grid_s4": dict(MAIN, num_stages=4, HALF_TAIL=True, PER_SM=GRID),
    "flat": dict(MAIN, FLATTEN=True),
    "small_flat": dict(SMALL, FLATTEN=True),  # <= 32 rows per expert (256 tokens)
    "small_flat_s3": dict(SMALL, FLATTEN=True, num_stages=3),
}
FEW_ROWS = ("old", "pinned", "main", "small_flat", "small_flat_s3")  # at 256 tokens
CALLS, REPS = 10, 7


def use(cand) -> None:
    table, short = cand if isinstance(cand, tuple) else ([(2**31, cand)], None)
    gemm.GROUPED_SMALL_M[BF], gemm.GROUPED_SHORT_K[BF] = table, short


def capture(fn):
    """A CUDA graph of CALLS calls of fn (warmed: one call before)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    return g


def interleaved_us(graphs: dict) -> dict:
    """Median us per call of each graph, replayed in turn REPS times (the order rotated each time): every
    candidate sees the same clocks and power state on average (a candidate timed alone after an idle GPU
    runs faster)."""
    names = list(graphs)
    for g in graphs.values():
        g.replay()
    ts = {n: [] for n in names}
    for rep in range(REPS):
        order = names[rep % len(names):] + names[:rep % len(names)]
        evs = []
        for n in order:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graphs[n].replay()
            e1.record()
            evs.append((n, e0, e1))
        torch.cuda.synchronize()
        for n, e0, e1 in evs:
            ts[n].append(1e3 * e0.elapsed_time(e1) / CALLS)
    return {n: sorted(v)[len(v) // 2] for n, v in ts.items()}


def routed(T: int, how: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [64], order [8 T]) of T tokens routed top-8: the dispatch's int64 tensors."""
    d, E, k = 2048, 64, 8
    if how == "router":
        h = torch.randn(T, d, generator=g, device="cuda") + 0.5 * torch.randn(d, generator=g, device="cuda")
        wr = torch.randn(E, d, generator=g, device="cuda") * 0.02
        logits = h @ wr.t()
    else:
        logits = torch.randn(T, E, generator=g, device="cuda")
    ids = logits.topk(k, dim=1).indices.reshape(-1)
    return torch.bincount(ids, minlength=E), torch.argsort(ids, stable=True)


def shapes(T: int, how: str, g: torch.Generator, dx: bool = False) -> tuple[dict, dict]:
    d, E, k, inter = 2048, 64, 8, 768
    counts, order = routed(T, how, g)
    c = counts.tolist()
    info = {"min": min(c), "max": max(c), "mean": sum(c) / E,
            "tail_le_64": sum(1 for v in c if 0 < v % 128 <= 64), "tail_gt_64": sum(1 for v in c if v % 128 > 64)}
    xt = torch.randn(T, d, generator=g, device="cuda").to(BF)
    h = torch.randn(T * k, inter, generator=g, device="cuda").to(BF)
    gu = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") * 0.02).to(BF)
    dn = (torch.randn(E, d, inter, generator=g, device="cuda") * 0.02).to(BF)
    fns = {"gate_up": lambda: gemm.grouped_mm(xt, gu, counts, order, k),
           "down": lambda: gemm.grouped_mm(h, dn, counts)}
    if dx:  # the backward's dX of both: weights read N-contiguous (training's micro-batches)
        g_up = torch.randn(T * k, 2 * inter, generator=g, device="cuda").to(BF)
        g_dn = torch.randn(T * k, d, generator=g, device="cuda").to(BF)
        fns["gate_up_dx"] = lambda: gemm.grouped_mm(g_up, gu.transpose(1, 2), counts)
        fns["down_dx"] = lambda: gemm.grouped_mm(g_dn, dn.transpose(1, 2), counts)
    return fns, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048,4096,8192")
    ap.add_argument("--routing", default="router,iid")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="sweep_grouped_sched_h200")
    ap.add_argument("--dx", action="store_true", help="also the dX GEMMs (N-contiguous weights)")
    ap.add_argument("--warm", default="", help="I/N: compile only every N-th (shape, candidate) from the I-th")
    a = ap.parse_args()
    warm = tuple(int(v) for v in a.warm.split("/")) if a.warm else None
    rows, n = [], 0
    with torch.no_grad():
        for how in a.routing.split(","):
            for T in (int(t) for t in a.tokens.split(",")):
                fns, info = shapes(T, how, torch.Generator(device="cuda").manual_seed(T), a.dx)
                for name, fn in fns.items():
                    use(MAIN)
                    ref = fn().clone()
                    row = {"routing": how, "tokens": T, "shape": name, "counts": info}
                    names = [c for c in a.candidates.split(",") if (c in FEW_ROWS) == (T <= 256) or c in FEW_ROWS[:3]]
                    graphs = {}
                    for cname in names:
                        n += 1
                        if warm is not None:
                            if n % warm[1] == warm[0]:
                                use(CANDIDATES[cname])
                                fn()
                            continue
                        use(CANDIDATES[cname])
                        try:
                            row[cname] = {"bits_equal_main": bits_equal(fn(), ref)}
                            graphs[cname] = capture(fn)
                        except Exception as e:  # noqa: BLE001 - out of shared memory, ...
                            row[cname] = {"error": f"{type(e).__name__}: {e}"[:160]}
                    for cname, us in (interleaved_us(graphs) if graphs else {}).items():
                        row[cname]["us"] = us
                    del graphs
                    if warm is not None:
                        continue
                    rows.append(row)
                    write(a.name, {"rows": rows, "candidates": CANDIDATES, "what_it_shows": WHAT}, a.out)
                    ok = sorted((v["us"], k) for k, v in row.items() if isinstance(v, dict) and "us" in v)
                    print(f"{how:6s} T={T:5d} {name:8s} counts {info['min']}-{info['max']} | "
                          + "  ".join(f"{k} {u:.1f}{'' if row[k]['bits_equal_main'] else ' BITDIFF'}" for u, k in ok),
                          flush=True)
    use(PINNED)
    if warm is not None:
        return
    summary = {f"{r['routing']}_{r['tokens']}_{r['shape']}": {
        "old_us": r["old"].get("us"), "new_us": r["pinned"].get("us"),
        "bits_equal": r["old"].get("bits_equal_main") is True and r["pinned"].get("bits_equal_main") is True}
        for r in rows if "old" in r and "pinned" in r}
    out = {"rows": rows, "candidates": CANDIDATES, "summary": summary,
           "what_it_shows": WHAT}
    print("wrote", write(a.name, out, a.out))
    print(f"{'case':28s} {'old us':>8s} {'new us':>8s} {'ratio':>6s} bits")
    for k, v in summary.items():
        if v["old_us"] and v["new_us"]:
            print(f"{k:28s} {v['old_us']:8.1f} {v['new_us']:8.1f} {v['new_us'] / v['old_us']:6.3f} "
                  f"{'equal' if v['bits_equal'] else 'DIFFER'}")


if __name__ == "__main__":
    main()
