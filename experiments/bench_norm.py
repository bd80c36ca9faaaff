"""RMSNorm forward (plain and with the residual add): the kernel before (one program per row, each row
read twice in chunks of 1024) vs the tree's, bits and speed in one run.

    python experiments/bench_norm.py [--out DIR] [--candidates]

Shapes (bench-moe-large): D 2048 at 256 / 2048 / 8192 rows (the layer norms of a decode step and of a
prefill chunk), D 128 at T x 16 and T x 4 rows for T = 256, 2048, 8192 (the q and k norms). Each
variant runs 16 launches on 16 distinct buffers (a step's 16 layers) captured in one CUDA graph; times
are medians of triton.testing.do_bench of the replay per launch, variants alternating (two rounds, the
faster kept). Bits: each variant's rows alone (first, a run across a program boundary, last) equal to
its rows in the whole batch; old vs new (equal only where the other reduction order happens to round
alike); max |y - reference| against an fp64 reference of the same formula. --candidates: other launch
constants (rows a program, warps) of the new kernel, each checked the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, write  # noqa: E402

from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.kernels.triton import norm  # noqa: E402
from rlalign.kernels.triton.common import Launch  # noqa: E402

BF = torch.bfloat16
PEAK = 4.8e12
LAYERS = 16
EPS = 1e-6
DEV = "cuda"
NORM_CASES = [(2048, r) for r in (256, 2048, 8192)] + [(128, t * h) for t in (256, 2048, 8192) for h in (16, 4)]
NORM_CANDIDATES = {2048: [(1, 4), (1, 8), (2, 16), (4, 16)], 128: [(16, 4), (32, 4), (64, 8), (64, 16)]}


@triton.jit
def _old_row(x_ptr, a_ptr, s_ptr, off, m, RESID: tl.constexpr, STORE: tl.constexpr):
    x = tl.load(x_ptr + off, mask=m, other=0.0)
    if RESID:
        x = (x.to(tl.float32) + tl.load(a_ptr + off, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE:
            tl.store(s_ptr + off, x, mask=m)
    return x.to(tl.float32)


@triton.jit
def _old_rmsnorm_fwd(x_ptr, a_ptr, w_ptr, y_ptr, s_ptr, r_ptr, D, eps, BLOCK: tl.constexpr, RESID: tl.constexpr):
    """The forward before: one program per row, the row read in chunks of BLOCK twice."""
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        x = _old_row(x_ptr, a_ptr, s_ptr, row * D + cols, cols < D, RESID, True)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    tl.store(r_ptr + row, rstd)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        x = _old_row(x_ptr, a_ptr, s_ptr, row * D + cols, cols < D, RESID, False)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        y = (x * rstd).to(w.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=cols < D)


def norm_variant(plan):
    """f(x, a or None, w) -> (y, s) through plan(R, D, resid) -> Launch (s: x when a is None)."""
    def run(x, a, w):
        R, D = x.shape
        y, r = torch.empty_like(x), torch.empty(R, dtype=torch.float32, device=x.device)
        s = x if a is None else torch.empty_like(x)
        plan(R, D, a is not None)(x, x if a is None else a, w, y, s, r)
        return y, s
    return run


def new_norm(x, a, w):
    """The op set's kernels: (y, s)."""
    if a is None:
        return tb.rmsnorm(x, w, EPS), x
    s, y = tb.add_rmsnorm(x, a, w, EPS)
    return y, s


def norm_variants(D: int, candidates: bool) -> dict:
    out = {"old": norm_variant(lambda R, D, resid: Launch(_old_rmsnorm_fwd, (R,), (D, EPS), dict(
               BLOCK=min(1024, triton.next_power_of_2(D)), RESID=resid))),
           "new": new_norm}
    for rows, warps in NORM_CANDIDATES[D] if candidates else ():
        cfg = dict(ROWS=rows, BLOCK=triton.next_power_of_2(D), num_warps=warps)
        out[f"r{rows}w{warps}"] = norm_variant(lambda R, D, resid, cfg=cfg: Launch(
            norm.rmsnorm_fwd_kernel, (triton.cdiv(R, cfg["ROWS"]),), (R, D, EPS), dict(cfg, RESID=resid)))
    return out


def bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def timed(fns: dict) -> tuple[dict, dict]:
    """name -> fn of the LAYERS launches: (per-launch seconds, best of two rounds; each graph's outputs)."""
    graphs, outs = {}, {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            outs[name] = fn()
        gr.replay()
        graphs[name] = gr
    torch.cuda.synchronize()
    times: dict = {}
    for _ in range(2):
        for name, gr in graphs.items():
            t = do_bench(gr.replay, warmup=5, rep=40, return_mode="median") / 1e3 / LAYERS
            times.setdefault(name, []).append(t)
    return {k: min(v) for k, v in times.items()}, outs


def speeds(t: dict, nbytes: int) -> dict:
    return {"us": {k: v * 1e6 for k, v in t.items()}, "speedup_new_vs_old": t["old"] / t["new"],
            "fraction_of_hbm_peak": {k: nbytes / v / PEAK for k, v in t.items()}}


def reference(x, a, w):
    s = x if a is None else (x.float() + a.float()).to(x.dtype)
    sd = s.double()
    return ((sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype).double() * w.double())


def slices(R: int, rows_per_program: int) -> list:
    mid = min(R - 1, rows_per_program + 1)
    return [(0, 1), (max(0, mid - 3), min(R, mid + 5)), (R - 1, R), (3, R)]


def norm_case(D: int, R: int, resid: bool, candidates: bool, g) -> dict:
    sets = [tuple(torch.randn(R, D, device=DEV, generator=g).to(BF) for _ in range(2))
            + ((torch.rand(D, device=DEV, generator=g) + 0.5).to(BF),) for _ in range(LAYERS)]
    variants = norm_variants(D, candidates and not resid)  # the candidates' layouts: timed on the plain norm
    fns = {n: (lambda f=f: [f(x, a if resid else None, w) for x, a, w in sets]) for n, f in variants.items()}
    t, outs = timed(fns)
    x, a, w = sets[0]
    a = a if resid else None
    eager = {n: f(x, a, w) for n, f in variants.items()}
    invariant, err = {}, {}
    for n, f in variants.items():
        ok = all(bits(o, e) for o, e in zip(outs[n][0], eager[n]))  # graph replay == eager
        for lo, hi in slices(R, 64):
            part = f(x[lo:hi], None if a is None else a[lo:hi], w)
            ok = ok and all(bits(p, e[lo:hi]) for p, e in zip(part, eager[n]))
        invariant[n] = ok
        err[n] = float((eager[n][0].double() - reference(x, a, w)).abs().max())
    nbytes = R * D * 2 * (4 if resid else 2) + D * 2 + R * 4
    return {"op": "add_rmsnorm" if resid else "rmsnorm", "D": D, "rows": R, **speeds(t, nbytes),
            "config_new": norm.fwd_config(D), "rows_alone_equal_rows_in_batch": invariant,
            "max_abs_err_vs_fp64_reference": err,
            "new_equals_old": {k: bits(eager["new"][i], eager["old"][i]) for i, k in enumerate(("y", "s"))}}


def summary(rows: list) -> dict:
    def pick(op, D):
        return {str(r["rows"]): round(r["speedup_new_vs_old"], 3) for r in rows if r["op"] == op and r["D"] == D}
    ok = all(all(r["rows_alone_equal_rows_in_batch"].values()) for r in rows)
    return {"speedup_rmsnorm_d2048": pick("rmsnorm", 2048), "speedup_add_rmsnorm_d2048": pick("add_rmsnorm", 2048),
            "speedup_rmsnorm_d128": pick("rmsnorm", 128), "bits_checks_pass": ok,
            "slower_cases": [f"{r['op']} D={r['D']} rows={r['rows']}" for r in rows if r["speedup_new_vs_old"] < 0.97]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--candidates", action="store_true")
    a = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    with torch.no_grad():
        for D, R in NORM_CASES:
            for resid in (False, True) if D == 2048 else (False,):
                rows.append(norm_case(D, R, resid, a.candidates, g))
                print(rows[-1]["op"], D, R, {k: round(v, 2) for k, v in rows[-1]["us"].items()}, flush=True)
                torch.cuda.empty_cache()
    s = summary(rows)
    what = (f"RMSNorm forward on one H200 (16 launches in a CUDA graph, median per launch), the tree's kernel vs "
            f"one program per row: new/old speed rmsnorm D 2048 {s['speedup_rmsnorm_d2048']}, add_rmsnorm D 2048 "
            f"{s['speedup_add_rmsnorm_d2048']}, q/k norms D 128 {s['speedup_rmsnorm_d128']} (by rows); rows alone "
            f"== rows in the batch in every case: {s['bits_checks_pass']}.")
    print("wrote", write("norm_H200", {"summary": s, "rows": rows, "what_it_shows": what,
                                       "hbm_peak_bytes_per_s": PEAK, "layers": LAYERS}, a.out))
    print(f"{'op':12s} {'D':>5s} {'rows':>7s} {'old us':>8s} {'new us':>8s} {'x':>5s} {'new %HBM':>8s}  bits  "
          f"candidates us")
    for r in rows:
        cand = " ".join(f"{k} {v:.2f}" for k, v in r["us"].items() if k not in ("old", "new"))
        print(f"{r['op']:12s} {r['D']:>5} {r['rows']:7d} {r['us']['old']:8.2f} {r['us']['new']:8.2f} "
              f"{r['speedup_new_vs_old']:5.2f} {100 * r['fraction_of_hbm_peak']['new']:7.1f}%  "
              f"{all(r['rows_alone_equal_rows_in_batch'].values())} y==old {r['new_equals_old']['y']}  {cand}")
    print("summary", s)
    if not s["bits_checks_pass"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
