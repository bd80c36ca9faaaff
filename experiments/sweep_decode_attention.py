# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""Paged decode attention of a bench-moe-large step at many rows (16 / 4 heads, D 128, page 16,
shuffled pages, ragged contexts): the pinned decode config against launch variants (warps, stages,
the block-table preload), each checked bitwise against the pinned one (scheduling only: the same
bits), timed under a CUDA graph; the bandwidth each reaches on the keys and values it reads.

    python experiments/sweep_decode_attention.py [--rows 256,2048] [--ctx 8-456] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vendor import bits_equal, graph_ms  # noqa: E402
from record import RESULTS, write  # noqa: E402

from rlalign.kernels.triton import attention  # noqa: E402

BF = torch.bfloat16
WHAT = "paged decode attention at many rows: launch variants, time and bits against the pinned config's"
H, HK, D, PAGE = 16, 4, 128, 16
PINNED = dict(attention.ATTN_FWD[BF]["decode"])
VARIANTS = {
    "pinned": {},
    "w8": dict(num_warps=8),
    "pre_s2": dict(PAGED_PRE_STAGES=2),
    "pre_s4": dict(PAGED_PRE_STAGES=4),
    "nopre_s3": dict(PAGED_PRE_MAX=0, PAGED_STAGES=3),
    "nopre_s5": dict(PAGED_PRE_MAX=0),
    "w8_pre_s4": dict(num_warps=8, PAGED_PRE_STAGES=4),
}


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
    k = torch.randn(pages, PAGE, HK, D, generator=g).to(BF).cuda()
    v = torch.randn(pages, PAGE, HK, D, generator=g).to(BF).cuda()
    q = torch.randn(N, H, D, generator=g).to(BF).cuda()
    pos = (ctx - 1).cuda()
    seq = torch.arange(N).cuda()
    kv_bytes = int(ctx.sum()) * HK * D * 2 * 2
    return (q, k, v, table.cuda(), seq, pos), kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,2048")
    ap.add_argument("--ctx", default="8-456,200-456", help="LO-HI,...: contexts uniform in [LO, HI]")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="sweep_decode_attention_h200")
    a = ap.parse_args()
    rows = []
    g = torch.Generator().manual_seed(0)
    for N in (int(x) for x in a.rows.split(",")):
        for span in a.ctx.split(","):
            lo, hi = (int(x) for x in span.split("-"))
            (q, k, v, table, seq, pos), kv_bytes = case(N, lo, hi, g)

            def call():
                return attention.attention_paged(q, k, v, table, seq, pos, D ** -0.5)

            attention.ATTN_FWD[BF]["decode"] = dict(PINNED)
            ref = call().clone()
            row = {"rows": N, "ctx": [lo, hi], "kv_bytes": kv_bytes}
            for name, over in VARIANTS.items():
                attention.ATTN_FWD[BF]["decode"] = dict(PINNED, **over)
                try:
                    same = bits_equal(call(), ref)
                    us = 1e3 * graph_ms([call])
                    row[name] = {"us": us, "tb_s": kv_bytes / us / 1e6, "bits_equal_pinned": same}
                except Exception as e:  # noqa: BLE001 - out of resources, ...
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:160]}
            attention.ATTN_FWD[BF]["decode"] = dict(PINNED)
            rows.append(row)
            write(a.name, {"rows": rows, "variants": VARIANTS, "what_it_shows": WHAT}, a.out)
            print(f"rows {N:5d} ctx {lo:4d}-{hi:4d} kv {kv_bytes / 1e9:6.3f} GB | " + "  ".join(
                f"{n} {r['us']:.1f}us {r['tb_s']:.2f}TB/s{'' if r['bits_equal_pinned'] else ' BITDIFF'}"
                if "us" in r else f"{n} ERR" for n, r in row.items() if isinstance(r, dict)), flush=True)
    print("done", a.name)


if __name__ == "__main__":
    main()
