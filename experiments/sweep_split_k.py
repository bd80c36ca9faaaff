# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""What a fixed split of K would buy the decode step's dense linears (bench-moe-large on one GPU): q/k/v,
o_proj, the router and the lm head at M = 256 / 2,048 rows, the pinned kernel (one program reduces a
tile's whole K) against cuBLAS and against split-K at S = 2 / 4 / 8 fixed K ranges: S programs per tile
each reduce K / S into an fp32 partial, a second launch adds the partials in order (((P0 + P1) + P2) ...)
and rounds once. The split is fixed by K alone, so a row's bits still do not depend on M (checked: the
2,048-row output's first 256 rows against the 256-row output), but they are other numbers than today's
(one fp32 chain over K): adopting it changes every linear on both sides. The same numbers in ONE program
(the S partial accumulators reduced one after another in registers, then added in order: what a trainer's
large-M tiles would run, no partials through memory) are timed too and checked bitwise against the
two-launch split. Graph-replayed medians (bench_vs_vendor.graph_ms).

    python experiments/sweep_split_k.py [--rows 256,2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vendor import bits_equal, graph_ms  # noqa: E402
from record import RESULTS, write  # noqa: E402

from rlalign.kernels.triton import gemm  # noqa: E402
from rlalign.kernels.triton.common import num_sms  # noqa: E402

BF = torch.bfloat16
D, VOCAB, EXPERTS = 2048, 32000, 64
SHAPES = {"qkv": [2048, 512, 512], "o_proj": [2048], "router": [EXPERTS], "lm_head": [VOCAB]}  # N of each weight
SPLITS = (2, 4, 8)
TILES = ((64, 128), (128, 128), (64, 64))  # (BLOCK_M, BLOCK_N) of the split kernels
BLOCK_K = 64


@triton.jit
def _split_partial(a_ptr, b_ptr, p_ptr, M, N, KS, sam, sbn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (m, n, s): the fp32 sum over K range s of the tile, written to partial s."""
    pm, pn, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(s * KS, (s + 1) * KS, BK):
        a = tl.load(a_ptr + rm[:, None] * sam + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + rn[None, :] * sbn + (k0 + rk)[:, None], mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(p_ptr + s * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _split_sum(p_ptr, c_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(p_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, S):
        acc = acc + tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
    tl.store(c_ptr + i, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_fused(a_ptr, b_ptr, c_ptr, M, N, KS, sam, sbn, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    """The same numbers in one program: K range 0's sum, then each next range's own sum added in order."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    total = tl.zeros((BM, BN), tl.float32)
    for s in tl.static_range(S):
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(s * KS, (s + 1) * KS, BK):
            a = tl.load(a_ptr + rm[:, None] * sam + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_ptr + rn[None, :] * sbn + (k0 + rk)[:, None], mask=rn[None, :] < N, other=0.0)
            acc = tl.dot(a, b, acc)
        if s == 0:
            total = acc
        else:
            total = total + acc
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], total.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def split_k(x, w, S: int, tile: tuple[int, int], parts: torch.Tensor, out: torch.Tensor):
    M, K = x.shape
    N = w.shape[0]
    BM, BN = tile
    _split_partial[(triton.cdiv(M, BM), triton.cdiv(N, BN), S)](x, w, parts, M, N, K // S, x.stride(0), w.stride(0),
                                                                 BM=BM, BN=BN, BK=BLOCK_K, num_warps=4, num_stages=4)
    _split_sum[(triton.cdiv(M * N, 1024),)](parts, out, M * N, S=S, BLOCK=1024, num_warps=4)
    return out


def split_fused(x, w, S: int, tile: tuple[int, int], out: torch.Tensor):
    M, K = x.shape
    N = w.shape[0]
    BM, BN = tile
    _split_fused[(triton.cdiv(M, BM), triton.cdiv(N, BN))](x, w, out, M, N, K // S, x.stride(0), w.stride(0), S=S,
                                                           BM=BM, BN=BN, BK=BLOCK_K, num_warps=8 if BM >= 128 else 4,
                                                           num_stages=3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,2048")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    rows_list = [int(r) for r in a.rows.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {name: [torch.randn(n, D, generator=g, device="cuda").to(BF) * 0.02 for n in ns]
               for name, ns in SHAPES.items()}
    x_all = torch.randn(max(rows_list), D, generator=g, device="cuda").to(BF)
    rows, firsts = [], {}
    for M in rows_list:
        x = x_all[:M]
        for name, ws in weights.items():
            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            N = w.shape[0]
            pinned = (lambda: torch.cat(gemm.linears(x, ws, [None] * len(ws)), -1)) if len(ws) > 1 else (
                lambda: gemm.linear(x, w))
            r = {"rows": M, "shape": name, "N": N, "K": D, "weight_mb": N * D * 2 / 1e6,
                 "pinned_us": 1e3 * graph_ms([pinned]), "cublas_us": 1e3 * graph_ms([lambda: F.linear(x, w)]),
                 "split": {}}
            if len(ws) > 1:  # the pinned kernel on the weights stacked into one (one problem, the main tiles)
                r["pinned_stacked_us"] = 1e3 * graph_ms([lambda: gemm.linear(x, w)])
                r["pinned_stacked_config"] = str(gemm.small_m_config(BF, M, [N], num_sms(x.device)))
                r["linears_config"] = str(gemm.small_m_config(BF, M, [v.shape[0] for v in ws], num_sms(x.device)))
            for S in SPLITS:
                parts = torch.empty(S, M, N, device="cuda")
                for tile in TILES:
                    out = torch.empty(M, N, dtype=BF, device="cuda")
                    fused = torch.empty(M, N, dtype=BF, device="cuda")
                    us = 1e3 * graph_ms([lambda: split_k(x, w, S, tile, parts, out)])
                    split_k(x, w, S, tile, parts, out)
                    fus = 1e3 * graph_ms([lambda: split_fused(x, w, S, tile, fused)])
                    split_fused(x, w, S, tile, fused)
                    key = f"S{S}_{tile[0]}x{tile[1]}"
                    first = firsts.setdefault((name, S, tile), out[:min(rows_list)].clone())
                    r["split"][key] = {"us": us, "fused_us": fus, "fused_bits_equal": bits_equal(fused, out),
                                       "rows_bits_equal_smallest_m": bits_equal(out[:first.shape[0]], first),
                                       "differs_from_pinned": int((out != pinned()).sum())}
            best = min(r["split"].items(), key=lambda kv: kv[1]["us"])
            r["best_split"] = best[0]
            print(f"M {M:5d} {name:8s} pinned {r['pinned_us']:7.1f} us (stacked {r.get('pinned_stacked_us', 0):.1f})  "
                  f"cublas {r['cublas_us']:7.1f}  best split "
                  f"{best[0]} {best[1]['us']:7.1f} (fused {best[1]['fused_us']:7.1f}, bits = two-launch "
                  f"{best[1]['fused_bits_equal']}, rows = smallest M {best[1]['rows_bits_equal_smallest_m']})",
                  flush=True)
            rows.append(r)
    ok = all(s["fused_bits_equal"] and s["rows_bits_equal_smallest_m"] for r in rows for s in r["split"].values())
    per = {f"{r['rows']} {r['shape']}": f"{r['pinned_us']:.1f} -> {r['split'][r['best_split']]['us']:.1f} us "
           f"({r['best_split']}; one-program {r['split'][r['best_split']]['fused_us']:.1f})" for r in rows}
    shows = (f"Split-K at a fixed K split for bench-moe-large's dense linears (pinned one-program-per-tile kernel -> "
             f"best split, two launches): {per}; fused and two-launch bits equal and rows independent of M: {ok}")
    print("wrote", write("sweep_split_k_h200", {"rows": rows, "all_bits_ok": ok, "what_it_shows": shows}, a.out))


if __name__ == "__main__":
    main()
