# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""The one GEMM kernel with its operands loaded by TMA (tensor descriptors made on the device) against pointer
loads and against cuBLAS, at bench-moe-large's shapes: the experts' grouped forward (gate_up [64, 1536, 2048]
over the token rows gathered in place: pointers; down [64, 2048, 768] over sorted rows, device counts or a host
list: both operands by TMA; the sorted gate_up of training, a host list) at 256 / 1,024 / 2,048 / 8,192 tokens
routed top-8 (sweep_grouped_sched's shapes), and the dense linears (lm head [32000, 2048], o_proj [2048, 2048],
q/k/v in one launch, router [64, 2048]) at 256, 2,048 and 8,192 rows. Candidates: "pointers" (every config
without TMA: the kernel before it), "pinned" (the tables as they stand), "tma_all" (TMA in every config); timed
under CUDA graphs (sweep_grouped_sched's capture / interleaved_us: the candidates replayed in turn, median of
REPS) and compared bitwise with the pointers' outputs.

    python experiments/sweep_gemm_tma.py [--tokens 256,1024,2048,8192] [--candidates pointers,pinned,tma_all]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_grouped_sched  # noqa: E402
from bench_vs_vendor import bits_equal  # noqa: E402
from record import RESULTS, write  # noqa: E402
from sweep_grouped_sched import capture, interleaved_us, routed  # noqa: E402

from rlalign.kernels.triton import gemm  # noqa: E402

BF = torch.bfloat16
WHAT = "the GEMM kernel's operands by TMA vs pointer loads vs cuBLAS at bench-moe-large's shapes: time and bits"
TABLES = ("MATMUL_CONFIGS", "MATMUL_SMALL_M", "GROUPED_SMALL_M", "GROUPED_SHORT_K")
PINNED = {name: {BF: getattr(gemm, name)[BF]} for name in TABLES}
CANDIDATES = {"pointers": {"TMA": False}, "pinned": {}, "tma_all": {"TMA": True}}
sweep_grouped_sched.REPS = 15


def _with(cfg, extra: dict):
    """cfg (a config dict or one of the tables' entries) with extra added to every config in it."""
    if isinstance(cfg, dict):
        return dict(cfg, **extra)
    if isinstance(cfg, tuple) and len(cfg) == 3 and isinstance(cfg[2], list):  # MATMUL_SMALL_M
        return (cfg[0], cfg[1], [_with(c, extra) for c in cfg[2]])
    if isinstance(cfg, tuple):  # GROUPED_SHORT_K: (max K, past rows, config)
        return (*cfg[:-1], _with(cfg[-1], extra))
    return [(m, _with(c, extra)) for m, c in cfg]  # GROUPED_SMALL_M


def use(extra: dict) -> None:
    for name in TABLES:
        getattr(gemm, name)[BF] = _with(PINNED[name][BF], extra)
    gemm.clear_plans()


def grouped_cases(T: int, g: torch.Generator):
    d, E, k, inter = 2048, 64, 8, 768
    counts, order = routed(T, "router", g)
    xt = torch.randn(T, d, generator=g, device="cuda").to(BF)
    h = torch.randn(T * k, inter, generator=g, device="cuda").to(BF)
    gu = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") * 0.02).to(BF)
    dn = (torch.randn(E, d, inter, generator=g, device="cuda") * 0.02).to(BF)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xg = xt[order // k].contiguous()  # cuBLAS needs the gathered copy (not timed: its rows given)
    vendor = {}
    if hasattr(torch, "_grouped_mm"):
        vendor = {"gate_up": lambda: torch._grouped_mm(xg, gu.transpose(1, 2), offs=offs),
                  "down": lambda: torch._grouped_mm(h, dn.transpose(1, 2), offs=offs)}
    host = counts.tolist()
    vendor["gate_up_sorted"] = vendor.get("gate_up")
    return ({"gate_up": lambda: gemm.grouped_mm(xt, gu, counts, order, k),
             "down": lambda: gemm.grouped_mm(h, dn, counts),
             "down_host": lambda: gemm.grouped_mm(h, dn, host),
             "gate_up_sorted": lambda: gemm.grouped_mm(xg, gu, host)}, vendor,
            {"min": int(counts.min()), "max": int(counts.max())})


def dense_cases(M: int, g: torch.Generator):
    d, V = 2048, 32000
    x = torch.randn(M, d, generator=g, device="cuda").to(BF)
    ws = {"lm_head": V, "o_proj": d, "router": 64}
    w = {n: (torch.randn(r, d, generator=g, device="cuda") * 0.02).to(BF) for n, r in ws.items()}
    qkv = [(torch.randn(r, d, generator=g, device="cuda") * 0.02).to(BF) for r in (2048, 512, 512)]
    ours = {n: (lambda w=w[n]: gemm.linear(x, w)) for n in ws}
    ours["qkv"] = lambda: torch.cat([y.reshape(-1) for y in gemm.linears(x, qkv, [None] * 3)])
    vendor = {n: (lambda w=w[n]: torch.nn.functional.linear(x, w)) for n in ws}
    vendor["qkv"] = lambda: [torch.nn.functional.linear(x, q) for q in qkv]
    return ours, vendor, {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048,8192")
    ap.add_argument("--rows", default="256,2048,8192", help="dense linears' M")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--dense", default="lm_head,o_proj,qkv,router")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: no new case past this")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="sweep_gemm_tma_h200")
    a = ap.parse_args()
    t0 = time.time()
    cands = a.candidates.split(",")
    cases = [("grouped", int(t)) for t in a.tokens.split(",")] + [("dense", int(m)) for m in a.rows.split(",")]
    rows = []
    with torch.no_grad():
        for kind, n in cases:
            g = torch.Generator(device="cuda").manual_seed(n)
            ours, vendor, info = grouped_cases(n, g) if kind == "grouped" else dense_cases(n, g)
            for shape, fn in ours.items():
                if kind == "dense" and shape not in a.dense.split(","):
                    continue
                if time.time() - t0 > a.budget:
                    print(f"budget: {kind} {n} {shape} skipped", flush=True)
                    continue
                use(CANDIDATES["pointers"])
                ref = fn().clone()
                row = {"kind": kind, "rows": n, "shape": shape, "counts": info}
                graphs = {}
                for c in cands:
                    use(CANDIDATES[c])
                    try:
                        row[c] = {"bits_equal_pointers": bits_equal(fn(), ref)}
                        graphs[c] = capture(fn)
                    except Exception as e:  # noqa: BLE001 - a compile error, out of shared memory, ...
                        row[c] = {"error": f"{type(e).__name__}: {e}"[:300]}
                if vendor.get(shape) is not None:
                    try:
                        graphs["cublas"] = capture(vendor[shape])
                        row["cublas"] = {}
                    except Exception as e:  # noqa: BLE001
                        row["cublas"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                for c, us in (interleaved_us(graphs) if graphs else {}).items():
                    row[c]["us"] = us
                del graphs
                use(CANDIDATES["pinned"])
                rows.append(row)
                write(a.name, {"rows": rows, "candidates": CANDIDATES, "what_it_shows": WHAT}, a.out)
                ok = sorted((v["us"], k) for k, v in row.items() if isinstance(v, dict) and "us" in v)
                bad = [k for k, v in row.items() if isinstance(v, dict) and "error" in v]
                print(f"{kind:7s} {n:5d} {shape:8s} | "
                      + "  ".join(f"{k} {u:.1f}{'' if row[k].get('bits_equal_pointers', True) else ' BITDIFF'}"
                                  for u, k in ok) + (f" | errors {bad}" if bad else "")
                      + f"  [{time.time() - t0:.0f} s]", flush=True)
    for r in rows:
        for k, v in r.items():
            if isinstance(v, dict) and "error" in v:
                print(f"{r['kind']} {r['rows']} {r['shape']} {k}: {v['error']}")
    summary = {f"{r['kind']}_{r['rows']}_{r['shape']}": {
        "pointers_us": r["pointers"].get("us"), "pinned_us": r["pinned"].get("us"),
        "bits_equal": all(v.get("bits_equal_pointers") is True for k, v in r.items() if k in CANDIDATES)}
        for r in rows if "pointers" in r and "pinned" in r}
    print(f"{'case':30s} {'pointers':>9s} {'pinned':>9s} {'ratio':>6s} bits")
    for k, v in summary.items():
        if v["pointers_us"] and v["pinned_us"]:
            print(f"{k:30s} {v['pointers_us']:9.1f} {v['pinned_us']:9.1f} {v['pinned_us'] / v['pointers_us']:6.3f} "
                  f"{'equal' if v['bits_equal'] else 'DIFFER'}")
    out = {"rows": rows, "candidates": CANDIDATES, "summary": summary, "what_it_shows": WHAT}
    print("wrote", write(a.name, out, a.out))


if __name__ == "__main__":
    main()
