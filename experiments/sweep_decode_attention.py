# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""Paged decode attention of a bench-moe-large step at many rows (16 / 4 heads, D 128, page 16,
shuffled pages, ragged contexts): the pinned decode config against launch variants (warps, stages,
the block-table preload) and split-K over every chunk, each checked bitwise against the pinned one
(scheduling only: the same bits), timed under a CUDA graph; the bandwidth each reaches on the keys
and values it reads. --prefill: a prefill step's prompt
rows (8,192 rows of prompts of 8-200 tokens) one program per row against the prefill tiles that
read the pages through the block table (`runs`), bits and time.

    python experiments/sweep_decode_attention.py [--rows 256,2048] [--ctx 8-456] [--prefill] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_vendor  # noqa: E402
from bench_vs_vendor import bits_equal, graph_ms  # noqa: E402
from record import RESULTS, write  # noqa: E402

from rlalign.kernels.triton import attention  # noqa: E402

BF = torch.bfloat16
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1, tiny shapes
SCHEDULE = attention.chunks_per_program
WHAT = "paged decode attention at many rows: launch variants, time and bits against the pinned config's"
H, HK, D, PAGE = 16, 4, 128, 16
PINNED = dict(attention.ATTN_FWD[BF]["decode"])
# the first variant is the reference every other one is checked against bitwise
VARIANTS = {
    "pinned": {},
    "w8": dict(num_warps=8),
    "pre_s2": dict(PAGED_PRE_STAGES=2),
    "pre_s4": dict(PAGED_PRE_STAGES=4),
    "nopre_s3": dict(PAGED_PRE_MAX=0, PAGED_STAGES=3),
    "nopre_s5": dict(PAGED_PRE_MAX=0),
    "rows_minor": dict(HEADS_MINOR=False),
    "heads_minor_s4": dict(PAGED_PRE_STAGES=4),
    "split1": dict(SPLIT1=True),  # split-K: a program per 256-key chunk, the row's last one folds them
}


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 normal values drawn on the device from a generator seeded by g (host draws of GBs are slow)."""
    dg = torch.Generator(device=DEV).manual_seed(int(torch.randint(1 << 30, (1,), generator=g)))
    return torch.randn(*shape, generator=dg, device=DEV).to(BF)


def case(N: int, lo: int, hi: int, g: torch.Generator):
    ctx = torch.randint(lo, hi + 1, (N,), generator=g)
    width = -(-hi // PAGE)
    pages = int(sum(-(-int(c) // PAGE) for c in ctx))
    perm = torch.randperm(pages, generator=g)
    table = torch.zeros(N, width, dtype=torch.int32)
    o = 0
    for i, c in enumerate(ctx.tolist()):
        n = -(-c // PAGE)
        table[i, :n] = perm[o:o + n].int()
        o += n
    k = randn(g, pages, PAGE, HK, D)
    v = randn(g, pages, PAGE, HK, D)
    q = randn(g, N, H, D)
    pos = (ctx - 1).to(DEV)
    seq = torch.arange(N).to(DEV)
    kv_bytes = int(ctx.sum()) * HK * D * 2 * 2
    return (q, k, v, table.to(DEV), seq, pos), kv_bytes


def eager_ms(fn, n: int = 7) -> float:
    """Median ms of fn() launched eagerly (as the engine runs prefill steps: their tiles' work tables
    are copied from the host per call, which a CUDA graph would not redo)."""
    fn()
    if DEV == "cpu":
        return float("nan")
    ts = []
    for _ in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return sorted(ts)[n // 2]


def prefill_case(rows: int, g: torch.Generator) -> dict:
    """One prefill step's prompt rows over shuffled pages: one program per row vs prefill tiles (runs)."""
    lens = []
    while sum(lens) < rows:
        lens.append(min(int(torch.randint(8, 201, (1,), generator=g)), rows - sum(lens)))
    width = max(-(-n // PAGE) for n in lens)
    pages = sum(-(-n // PAGE) for n in lens)
    perm = torch.randperm(pages, generator=g)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    o, seq, pos, runs = 0, [], [], []
    for s, n in enumerate(lens):
        c = -(-n // PAGE)
        table[s, :c] = perm[o:o + c].int()
        o += c
        runs.append((len(seq), n, 0, s))
        seq += [s] * n
        pos += list(range(n))
    k = randn(g, pages, PAGE, HK, D)
    v = randn(g, pages, PAGE, HK, D)
    q = randn(g, rows, H, D)
    args = (q, k, v, table.to(DEV), torch.tensor(seq).to(DEV), torch.tensor(pos).to(DEV), D ** -0.5)
    flops = 4 * H * D * sum(n * (n + 1) // 2 for n in lens)
    out = {"rows": rows, "prompts": len(lens), "causal_flops": flops}
    ref = attention.attention_paged(*args).clone()
    for name, r in (("rows", None), ("tiles", runs)):
        try:
            same = bits_equal(attention.attention_paged(*args, runs=r), ref)
            us = 1e3 * eager_ms(lambda: attention.attention_paged(*args, runs=r))
            out[name] = {"us": us, "tflop_s": flops / us / 1e6, "bits_equal_rows": same}
        except Exception as e:  # noqa: BLE001 - a compile error is a result here
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,2048")
    ap.add_argument("--ctx", default="8-456,200-456,136-328", help="LO-HI,...: contexts uniform in [LO, HI]")
    ap.add_argument("--prefill", type=int, default=0, help="also a prefill step of this many prompt rows")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="sweep_decode_attention_h200")
    ap.add_argument("--only", default="", help="VARIANT,...: these variants only")
    ap.add_argument("--warm", action="store_true", help="compile only (fills Triton's cache), write nothing")
    a = ap.parse_args()
    bench_vs_vendor.WARM = a.warm or DEV == "cpu"
    variants = {n: VARIANTS[n] for n in (a.only.split(",") if a.only else VARIANTS)}
    rows = []
    g = torch.Generator().manual_seed(0)
    for N in (int(x) for x in a.rows.split(",")):
        for span in a.ctx.split(","):
            lo, hi = (int(x) for x in span.split("-"))
            (q, k, v, table, seq, pos), kv_bytes = case(N, lo, hi, g)

            def call():
                return attention.attention_paged(q, k, v, table, seq, pos, D ** -0.5)

            ref = None
            row = {"rows": N, "ctx": [lo, hi], "kv_bytes": kv_bytes}
            for name, over in variants.items():
                over = dict(over)
                split1 = over.pop("SPLIT1", False)
                attention.ATTN_FWD[BF]["decode"] = dict(PINNED, **over)
                attention.chunks_per_program = (lambda *_: 1) if split1 else SCHEDULE
                try:
                    out = call()
                    if ref is None:
                        ref = out.clone()
                    same = bits_equal(out, ref)
                    us = 1e3 * graph_ms([call])
                    row[name] = {"us": us, "tb_s": kv_bytes / us / 1e6, "bits_equal_pinned": same}
                except Exception as e:  # noqa: BLE001 - out of resources, ...
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:160]}
            attention.ATTN_FWD[BF]["decode"] = dict(PINNED)
            attention.chunks_per_program = SCHEDULE
            rows.append(row)
            if a.warm:
                continue
            write(a.name, {"rows": rows, "variants": variants, "what_it_shows": WHAT}, a.out)
            print(f"rows {N:5d} ctx {lo:4d}-{hi:4d} kv {kv_bytes / 1e9:6.3f} GB | " + "  ".join(
                f"{n} {r['us']:.1f}us {r['tb_s']:.2f}TB/s{'' if r['bits_equal_pinned'] else ' BITDIFF'}"
                if "us" in r else f"{n} ERR" for n, r in row.items() if isinstance(r, dict)), flush=True)
    result = {"rows": rows, "variants": variants, "what_it_shows": WHAT}
    if a.prefill:
        result["prefill"] = prefill_case(a.prefill, g)
        if not a.warm:
            write(a.name, result, a.out)
        print("prefill", result["prefill"], flush=True)
    print("done", a.name)


if __name__ == "__main__":
    main()
