"""The MoE layer's row-local launches of a decode (or prefill) step of bench-moe-large — router
(softmax + top-8 of 64), dispatch (counting sort of the 8 rows per token) and combine (8 expert rows
per token summed in fp32, d 2048, read through dest) — timed inside CUDA graphs
(triton.testing.do_bench_cudagraph, median) against a baseline copy of the kernels, and checked
bitwise equal to it: router weights (as int32 bits, NaN rows included) and ids, dispatch's order,
dest and counts, the combine's output bits.

    python experiments/bench_moe_ops.py --baseline DIR [--out DIR]

DIR holds the baseline kernels/triton/dispatch.py and moe.py (e.g. `git show REV:kernels/triton/moe.py`).
Writes experiments/results/moe_ops_<gpu>.json with a "summary": the new launches' microseconds per MoE
layer at 2,048 tokens and whether every output equalled the baseline's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, write  # noqa: E402

from rlalign.kernels.triton import dispatch, moe  # noqa: E402

E, K, D = 64, 8, 2048
OPS = ("route", "dispatch", "combine")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1, the checks only, no times


def _baseline(folder: Path, name: str):
    """The module folder/name.py imported inside rlalign.kernels.triton (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location(f"rlalign.kernels.triton.baseline_{name}", folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    plans = {}
    mod.cached = lambda key, build: plans[key] if key in plans else plans.setdefault(key, build())
    return mod  # its launch plans in a cache of its own: both versions key their plans alike


def _us(fn) -> float:
    fn()
    if DEV == "cpu":
        return float("nan")
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16) if x.element_size() == 2 else x


def _same(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True))


def _logits(tokens: int, g) -> torch.Tensor:
    z = torch.randn(tokens, E, generator=g, device=DEV).bfloat16()
    z[1::7] = (z[1::7] * 2).round() / 2  # exact ties among the top 8
    return z


def _route_check(old, tokens: int, g) -> dict:
    """Router outputs equal to the baseline's with renormalisation on and off, finite and NaN/inf rows,
    at the shipped warps and with 4 warps per row."""
    z = _logits(tokens, g)
    z[3, 5], z[4, 0], z[5] = float("nan"), float("inf"), float("-inf")
    out = {}
    for warps in ("shipped", 4):
        same = True
        for renorm in (True, False):
            want = old.moe_route(z, K, renorm)
            if warps == 4:
                shipped, moe.route_warps = moe.route_warps, lambda b: 4
            got = moe.moe_route(z, K, renorm)
            if warps == 4:
                moe.route_warps = shipped
            same &= _same(want, got)
            finite = got[1][6:] < E
            same &= bool(finite.all())
        out[f"route_equal_{warps}_warps"] = same
    return out


def _case(old_moe, old_dispatch, tokens: int, g) -> dict:
    z = _logits(tokens, g)
    route = [lambda m=m: m.moe_route(z, K, True) for m in (old_moe, moe)]
    w, ids = route[1]()
    flat = ids.reshape(-1)
    disp = [lambda m=m: m.moe_dispatch(flat, E) for m in (old_dispatch, dispatch)]
    order, dest, counts = disp[1]()
    y = torch.randn(tokens * K, D, generator=g, device=DEV).bfloat16()
    comb = [lambda m=m: m.moe_combine_rows(y, w, dest) for m in (old_moe, moe)]
    row = {"tokens": tokens, "rows": tokens * K}
    for name, (old_fn, new_fn) in (("route", route), ("dispatch", disp), ("combine", comb)):
        want, got = old_fn(), new_fn()
        want, got = (want,) if torch.is_tensor(want) else want, (got,) if torch.is_tensor(got) else got
        row[f"{name}_equal"] = _same(want, got)
        row[f"{name}_old_us"] = _us(old_fn)
        row[f"{name}_new_us"] = _us(new_fn)
    shipped, moe.route_warps = moe.route_warps, lambda b: 4
    row["route_4_warps_us"] = _us(route[1])
    moe.route_warps = shipped
    row.update(_route_check(old_moe, tokens, g))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, type=Path, help="folder with the baseline dispatch.py and moe.py")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 8192])
    a = ap.parse_args()
    old_moe, old_dispatch = _baseline(a.baseline, "moe"), _baseline(a.baseline, "dispatch")
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = [_case(old_moe, old_dispatch, tokens, g) for tokens in a.tokens]
    equal = all(r[f"{op}_equal"] and r["route_equal_shipped_warps"] for r in rows for op in OPS)
    at = {r["tokens"]: r for r in rows}.get(2048, rows[-1])
    summary = {"equal": equal, **{f"{op}_us_2048": round(at[f"{op}_new_us"], 2) for op in OPS},
               **{f"{op}_old_us_2048": round(at[f"{op}_old_us"], 2) for op in OPS}}
    gpu = torch.cuda.get_device_name(0).replace(" ", "_") if DEV == "cuda" else "cpu"
    path = write(f"moe_ops_{gpu}", {"what": "MoE router, dispatch and combine per layer, inside CUDA graphs, "
                                            "vs the baseline kernels (us, median), outputs bitwise equal",
                                    "experts": E, "top_k": K, "d": D, "results": rows, "summary": summary}, a.out)
    print(f"{'tokens':>6} {'op':>8} {'old us':>8} {'new us':>8} {'x':>5} equal")
    for r in rows:
        for op in OPS:
            o, n = r[f"{op}_old_us"], r[f"{op}_new_us"]
            print(f"{r['tokens']:6d} {op:>8} {o:8.2f} {n:8.2f} {o / n:5.2f} {r[f'{op}_equal']}")
        print(f"{r['tokens']:6d} route bits (NaN/inf rows, renorm on/off): shipped warps "
              f"{r['route_equal_shipped_warps']}, 4 warps {r['route_equal_4_warps']} ({r['route_4_warps_us']:.2f} us)")
    print("summary", summary, "wrote", path)


if __name__ == "__main__":
    main()
