"""The Gumbel-max draw's kernel (kernels/triton/sampling.py gumbel_argmax_kernel: `pinned`) against
variants that must draw the same tokens: `chunks` reduces each 1,024-column chunk to the row's running
best (two block reductions a chunk; the kernel pinned before the lanes); `lanes` keeps a best (value,
first index) per lane and reduces once at the end (exact: max is exact, the first index of the maximum
is the least index among the lanes' firsts); `magic` converts the exact small integers (the hash's 23
bits, the logarithm's exponent) to fp32 by the 1.5 * 2**23 bit trick (an integer add and an exact fp32
subtract) instead of I2F; `split S` runs S programs per row over vocabulary segments and combines their
bests in segment order in a second launch (more programs for few rows). Tokens compared with `chunks`'
on every row (NaN and all -inf rows: the raw kernels' out-of-range id); time under CUDA graphs,
interleaved (sweep_grouped_sched).

    python experiments/sweep_gumbel.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write  # noqa: E402
from sweep_grouped_sched import CALLS, interleaved_us  # noqa: E402

from rlalign.kernels.triton import sampling as ts  # noqa: E402
from rlalign.kernels.triton.common import INTERPRET  # noqa: E402
from rlalign.kernels.triton.sampling import GOLDEN, LOG_CONST, MIX1, MIX2, fo_log, mix64  # noqa: E402


@triton.jit
def _i2f(n):
    """fp32(n), exact, for int32 |n| < 2**22."""
    return (n + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _log_magic(x, SQRT2: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
               C4: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr):
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > SQRT2
    m = tl.where(big, m * 0.5, m)
    ef = _i2f(e + big.to(tl.int32))
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    s2 = s * s
    p = tl.full(s.shape, C0, tl.float32)
    p = p * s2 + C1
    p = p * s2 + C2
    p = p * s2 + C3
    p = p * s2 + C4
    log_m = (p * s2) * s + 2.0 * s
    return ef * LN2_HI + (log_m + ef * LN2_LO)


@triton.jit
def _noise(h, cols, golden, mix1, mix2, MAGIC: tl.constexpr, SQRT2: tl.constexpr, C0: tl.constexpr,
           C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, LN2_HI: tl.constexpr,
           LN2_LO: tl.constexpr):
    hv = mix64(h ^ cols.to(tl.uint64), golden, mix1, mix2)
    if MAGIC:
        k = (hv >> 41).to(tl.int32)
        u = (((k | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) + 0.5) * (1.0 / 8388608.0)
        return -_log_magic(-_log_magic(u, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO), SQRT2, C0, C1, C2, C3, C4,
                           LN2_HI, LN2_LO)
    u = ((hv >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -fo_log(-fo_log(u, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO), SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO)


@triton.jit(do_not_specialize=["seed"])
def _lanes_kernel(z_ptr, ids_ptr, pos_ptr, out_ptr, best_ptr, seed, golden, mix1, mix2, V, SEG,
                  MAGIC: tl.constexpr, SPLIT: tl.constexpr, SQRT2: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr,
                  C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Per lane: the best (value, first index) over its columns of the row's segment [SEG * s, SEG * (s + 1)),
    one reduction at the end. SPLIT: write (value, index, nan) of the segment to best_ptr / out_ptr [B, S]."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    sid = tl.load(ids_ptr + row).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
    h = mix64(seed.to(tl.int64).to(tl.uint64, bitcast=True), golden, mix1, mix2)
    h = mix64(h ^ sid, golden, mix1, mix2)
    h = mix64(h ^ pos, golden, mix1, mix2)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK,), V, tl.int32)
    nan = tl.zeros((BLOCK,), tl.int32)
    lo = seg * SEG
    hi = tl.minimum(lo + SEG, V)
    for v0 in range(lo, hi, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < hi
        z = tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
        g = _noise(h, cols, golden, mix1, mix2, MAGIC, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO)
        x = tl.where(mask, z + g, float("-inf"))
        nan = tl.maximum(nan, (x != x).to(tl.int32))
        x = tl.where(x != x, float("-inf"), x)
        take = x > best
        best_i = tl.where(take, cols, best_i)
        best = tl.where(take, x, best)
    m = tl.max(best, axis=0)
    i = tl.min(tl.where(best == m, best_i, V), axis=0)
    n = tl.max(nan, axis=0)
    if SPLIT:
        S = tl.num_programs(1)
        tl.store(best_ptr + row * S + seg, tl.where(n > 0, float("nan"), m))
        tl.store(out_ptr + row * S + seg, i.to(tl.int64))
    else:
        tl.store(out_ptr + row, tl.where((n > 0) | (m == float("-inf")), V, i).to(tl.int64))


@triton.jit
def _combine_kernel(best_ptr, idx_ptr, out_ptr, V, S: tl.constexpr, SP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SP)
    b = tl.load(best_ptr + row * S + j, mask=j < S, other=float("-inf"))
    i = tl.load(idx_ptr + row * S + j, mask=j < S, other=V)
    n = tl.max((b != b).to(tl.int32), axis=0)
    m = tl.max(tl.where(b != b, float("-inf"), b), axis=0)
    first = tl.min(tl.where(b == m, i, V), axis=0)
    tl.store(out_ptr + row, tl.where((n > 0) | (m == float("-inf")), V, first))


@triton.jit(do_not_specialize=["seed"])
def _chunks_kernel(z_ptr, ids_ptr, pos_ptr, out_ptr, seed, golden, mix1, mix2, V, SQRT2: tl.constexpr,
                   C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                   LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, BLOCK: tl.constexpr):
    """The draw as pinned before the lanes: each BLOCK chunk reduced to the row's running best."""
    row = tl.program_id(0).to(tl.int64)
    sid = tl.load(ids_ptr + row).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
    h = mix64(seed.to(tl.int64).to(tl.uint64, bitcast=True), golden, mix1, mix2)
    h = mix64(h ^ sid, golden, mix1, mix2)
    h = mix64(h ^ pos, golden, mix1, mix2)
    best = float("-inf")
    best_i = V
    nan = 0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
        g = _noise(h, cols, golden, mix1, mix2, False, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO)
        x = tl.where(mask, z + g, float("-inf"))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=0))
        x = tl.where(x != x, float("-inf"), x)
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, cols, V), axis=0)
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, tl.where((nan > 0) | (best == float("-inf")), V, best_i))


def _s64(seed: int) -> int:
    return (seed & ts.U64) - (1 << 64) if (seed & ts.U64) >= (1 << 63) else seed & ts.U64


def chunks(block: int = 1024, warps: int = 4):
    """The chunk-reduced draw (rows without a token give V)."""
    def run(z, ids, pos, seed):
        out = torch.empty(z.shape[0], dtype=torch.long, device=z.device)
        opts = {} if INTERPRET else dict(enable_fp_fusion=False, num_warps=warps)
        _chunks_kernel[(z.shape[0],)](z, ids, pos, out, _s64(seed), GOLDEN, MIX1, MIX2, z.shape[1], BLOCK=block,
                                      **LOG_CONST, **opts)
        return out
    return run


def pinned(z, ids, pos, seed):
    """The product kernel, without the wrapper's device assert."""
    B, V = z.shape
    out = torch.empty(B, dtype=torch.long, device=z.device)
    opts = {} if INTERPRET else dict(enable_fp_fusion=False)
    ts.gumbel_argmax_kernel[(B,)](z, ids, pos, out, out, _s64(seed), GOLDEN, MIX1, MIX2, 1.0, V, SCALED=False,
                                   LOGPROB=False, DRAW_BLOCK=ts.DRAW_BLOCK, BLOCK=1024, **LOG_CONST, **opts)
    return out


def variant(magic: bool, block: int, warps: int, split: int = 1):
    def run(z, ids, pos, seed):
        B, V = z.shape
        s64 = _s64(seed)
        seg = triton.cdiv(triton.cdiv(V, split), block) * block
        S = triton.cdiv(V, seg)
        out = torch.empty(B, dtype=torch.long, device=z.device)
        opts = {} if INTERPRET else dict(num_warps=warps, enable_fp_fusion=False)
        if S == 1:
            _lanes_kernel[(B, 1)](z, ids, pos, out, out, s64, GOLDEN, MIX1, MIX2, V, seg, MAGIC=magic, SPLIT=False,
                                  BLOCK=block, **opts, **LOG_CONST)
            return out
        best = torch.empty(B, S, dtype=torch.float32, device=z.device)
        idx = torch.empty(B, S, dtype=torch.long, device=z.device)
        _lanes_kernel[(B, S)](z, ids, pos, idx, best, s64, GOLDEN, MIX1, MIX2, V, seg, MAGIC=magic, SPLIT=True,
                              BLOCK=block, **opts, **LOG_CONST)
        _combine_kernel[(B,)](best, idx, out, V, S=S, SP=triton.next_power_of_2(S))
        return out
    return run


CANDIDATES = {"chunks": chunks(), "pinned": pinned, "chunks w8": chunks(1024, 8), "chunks b2048 w8": chunks(2048, 8),
              "lanes b512": variant(False, 512, 4), "magic+lanes b512": variant(True, 512, 4),
              "lanes b512 split4": variant(False, 512, 4, 4), "lanes b512 split8": variant(False, 512, 4, 8)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for V in (32000, 151936):
        for B in (256, 2048):
            z = (torch.randn(B, V, generator=g, device="cuda") * 0.05).bfloat16()  # the noise decides
            z[0, 5] = float("nan")
            z[1] = float("-inf")
            z[2, 100:] = float("-inf")
            z[3, 7] = float("inf")
            ids = torch.randint(0, 2**40, (B,), generator=g, device="cuda")
            pos = torch.randint(0, 4096, (B,), generator=g, device="cuda")
            seed = 2**63 + 11
            ref = chunks()(z, ids, pos, seed)
            row = {"rows": B, "vocab": V, "tokens_equal": {}, "us": {}}
            graphs = {}
            for name, fn in CANDIDATES.items():
                row["tokens_equal"][name] = bool(torch.equal(fn(z, ids, pos, seed), ref))
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2):
                    for _ in range(CALLS):
                        fn(z, ids, pos, seed)
                graphs[name] = g2
            row["us"] = interleaved_us(graphs)
            del graphs
            rows.append(row)
            print(f"B={B:5d} V={V:6d} " + "  ".join(
                f"{n} {u:.1f}{'' if row['tokens_equal'][n] else ' DIFFER'}" for n, u in row["us"].items()), flush=True)
            write(f"sweep_gumbel_{gpu}", {"rows": rows, "calls_per_replay": CALLS, "candidates": list(CANDIDATES),
                                          "what_it_shows": "Gumbel-max draw kernel variants: us per call, tokens "
                                                           "against the pinned kernel (bf16 logits * 0.05)"}, a.out)


if __name__ == "__main__":
    main()
