# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""Decode, paged and prefill attention on one GPU, the pinned configs of kernels/triton/attention.py:
bitwise checks (decode == paged == prefill at every position, page sizes 16 and 32, shuffled block
tables, split-K == in-register folds, a negative twin with another chunk size), then times in the
same run: our contiguous decode vs SDPA at B = 1, 8, 64 with 4,096 cached keys (target <= 1.2x SDPA's
time) and per split-K schedule, the paged kernel vs our contiguous decode (target <= 1.1x), prefill vs
SDPA at T = 1024 / 4096 beside the same kernel without key chunks (what split-K costs prefill), and
(when named in --only) the engine's 256-row decode step (16 / 4 heads, page 16, ragged contexts
16..384) with the paged settings of the pinned config and the fp32 config's (a table load per key
block, int64 key offsets). Times: triton.testing.do_bench medians (the host's launch cost included)
and the same call replayed from a CUDA graph (kernel time). Variants are set here, from outside the
kernels: the config tables (ATTN_FWD) and the split-K schedule (attention.chunks_per_program).

    python experiments/kernels/bench_paged_attention.py [--quick] [--sweep] [--only bits,decode,prefill,paged,engine]
        [--out DIR] [--batches 1,8,64] [--warm] [--rounds N]

--warm calls everything once and times nothing: a few such runs in parallel fill triton's cache
before the timed run. --rounds N times the paged and engine rows N times, interleaved, and reports
medians and each round's ratio. --quick: tiny shapes on CPU under TRITON_INTERPRET=1 (checks the
script, times mean nothing). --sweep: instead, time other key-chunk sizes (the constant CHUNK: bits
change with it, timing only) and other decode / prefill tiles (each checked decode == prefill
bitwise first); writes ..._sweep.json. Prints a table; writes results/paged_attention_<gpu>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign.kernels.triton import attention as attn  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROWS: list[dict] = []


def row(section: str, name: str, **kv) -> None:
    ROWS.append({"section": section, "name": name, **kv})
    print(f"{section:8} {name:52} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in kv.items()), flush=True)


WARM = False  # --warm: every call once, no timing (fills triton's cache; a few such runs go in parallel)


def bench(fn) -> float:
    """Median ms: do_bench (CUDA events) on GPU, wall clock on CPU."""
    if WARM:
        fn()
        return float("nan")
    if DEV == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * sorted(ts)[1]


def bench_graph(fn) -> float:
    """Median ms of fn replayed from a CUDA graph; nan on CPU or where capture fails."""
    if DEV != "cuda" or WARM:
        if WARM:
            fn()
        return float("nan")
    import triton.testing

    try:
        fn()
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception as e:  # record, go on
        print("graph capture failed:", type(e).__name__, str(e)[:200])
        return float("nan")


def bits_equal(a, b) -> bool:
    v = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(v), b.view(v))


SIZE_BASED = attn.chunks_per_program


@contextlib.contextmanager
def settings(chunk: int | None = None, spp: int | None = -1, decode: dict | None = None):
    """Within the block: another key-chunk size (bits change with it: timing only), the split-K schedule
    (0 = in registers, k = k chunks per program, None = the size-based schedule; -1 leaves it) or decode
    config entries (tiles, paged settings: the same bits)."""
    table = attn.INTERPRET_ATTN if attn.INTERPRET else attn.ATTN_FWD[torch.bfloat16]
    saved = table["CHUNK"], attn.chunks_per_program, dict(table["decode"])
    if chunk is not None:
        table["CHUNK"] = chunk
    if spp != -1:
        attn.chunks_per_program = SIZE_BASED if spp is None else (lambda *a: spp)
    if decode is not None:
        table["decode"] = dict(table["decode"], **decode)
    try:
        yield
    finally:
        table["CHUNK"], attn.chunks_per_program, table["decode"] = saved


def packed(lens, H, Hk, D, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(sum(lens), h, D, device=DEV, generator=g).bfloat16() for h in (H, Hk, Hk))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return q, k, v, cu


def paged_cache(k_rows, lens, page_size, seed, fill=float("nan")):
    """Rows [sum(lens), Hk, D] into shuffled pages; (pages, block table int32, seq_idx, positions)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    off = 0
    for s, c in enumerate(need):
        table[s, :c] = perm[off : off + c].to(torch.int32)
        off += c
    table = table.to(DEV)
    seq_idx = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)]).to(DEV)
    pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    slot = table[seq_idx, pos // page_size].long() * page_size + pos % page_size
    pages = torch.full((num_pages, page_size, *k_rows.shape[1:]), fill, device=DEV, dtype=k_rows.dtype)
    pages.flatten(0, 1)[slot] = k_rows
    return pages, table, seq_idx, pos


def check_bits(q: bool) -> None:
    H, Hk, D = (4, 2, 16) if q else (32, 8, 128)
    T = 70 if q else 4096
    scale = 1 / math.sqrt(D)
    qq, kk, vv, cu = packed([T], H, Hk, D, 0)
    pre = attn.attention_prefill(qq, kk, vv, cu, scale)
    lengths = torch.arange(1, T + 1, device=DEV)
    for mode, spp in (("split-K, 1 chunk a program", 1), ("split-K, 4 chunks a program", 4), ("in registers", 0)):
        with settings(spp=spp):
            dec = attn.attention_decode(qq, kk[None].expand(T, -1, -1, -1), vv[None].expand(T, -1, -1, -1), lengths,
                                        scale)
        bad = sum(not bits_equal(dec[t], pre[t]) for t in range(T))
        row("bitwise", f"decode ({mode}) vs prefill, every position T={T}", positions_differing=bad)
    kc, vc = kk[None].contiguous(), vv[None].contiguous()
    probe = sorted({0, 1, 255, 256, 257, 1000, T // 2, T - 1} & set(range(T)))
    bad = sum(not bits_equal(attn.attention_decode(qq[t : t + 1], kc, vc, lengths[t : t + 1], scale)[0], pre[t])
              for t in probe)
    row("bitwise", f"decode batch of 1 vs prefill at {len(probe)} positions", positions_differing=bad)
    chunk = attn.INTERPRET_ATTN["CHUNK"] if attn.INTERPRET else attn.ATTN_FWD[torch.bfloat16]["CHUNK"]
    with settings(chunk=2 * chunk):
        other = attn.attention_prefill(qq, kk, vv, cu, scale)
    row("bitwise", "negative twin: prefill with 2x the chunk vs decode", positions_differing=sum(
        not bits_equal(other[t], pre[t]) for t in range(T)))
    lens = [1, 5, 40, 70] if q else [1, 77, 1000, 4096, 255, 2500]
    qq, kk, vv, cu = packed(lens, H, Hk, D, 1)
    pre = attn.attention_prefill(qq, kk, vv, cu, scale)
    perm = torch.randperm(len(pre), generator=torch.Generator().manual_seed(2)).to(DEV)
    for ps in (16, 32):
        kp, table, seq_idx, pos = paged_cache(kk, lens, ps, 3)
        vp = paged_cache(vv, lens, ps, 3)[0]
        for mode, spp in (("split-K", 1), ("in registers", 0)):
            with settings(spp=spp):
                out = attn.attention_paged(qq[perm], kp, vp, table, seq_idx[perm], pos[perm], scale)
            bad = int((out.view(torch.int16) != pre[perm].view(torch.int16)).flatten(1).any(1).sum())
            row("bitwise", f"paged page={ps} ({mode}) vs prefill, {len(pre)} rows of {len(lens)} seqs",
                rows_differing=bad)


def speed_decode(q: bool, chunks: tuple = (None,)) -> None:
    H, Hk, D, C = (4, 2, 16, 64) if q else (32, 8, 128, 4096)
    scale = 1 / math.sqrt(D)
    for B in ([2] if q else [1, 8, 64]):
        g = torch.Generator(device=DEV).manual_seed(B)
        qd = torch.randn(B, H, D, device=DEV, generator=g).bfloat16()
        kc, vc = (torch.randn(B, C, Hk, D, device=DEV, generator=g).bfloat16() for _ in range(2))
        lens = torch.full((B,), C, device=DEV)
        kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
        sdpa = lambda: F.scaled_dot_product_attention(qd[:, :, None], kt, vt, enable_gqa=True)
        t_sdpa, g_sdpa = bench(sdpa), bench_graph(sdpa)
        ours = lambda: attn.attention_decode(qd, kc, vc, lens, scale)
        for chunk in chunks:  # None: the pinned chunk (and the rows after); "pinned": it alone
            with settings(chunk=chunk if isinstance(chunk, int) else None):
                t, gt = bench(ours), bench_graph(ours)
            tag = f" chunk={chunk}" if isinstance(chunk, int) else ""
            row("speed", f"decode B={B} H={H}/{Hk} D={D} cache={C}{tag}", ours_ms=t, sdpa_ms=t_sdpa,
                time_ratio=t / t_sdpa, graph_ours_ms=gt, graph_sdpa_ms=g_sdpa, graph_time_ratio=gt / g_sdpa)
        if chunks == (None,):
            ref = ours()
            if not q and B < 64:
                for spp in (1, 2, 4):  # each split-K schedule
                    with settings(spp=spp):
                        same = bits_equal(ours(), ref)
                        gt = bench_graph(ours)
                    row("sched", f"decode B={B} chunks/program={spp}", graph_ours_ms=gt, graph_time_ratio=gt / g_sdpa,
                        bitwise_equal=same)


ROUNDS = 1  # --rounds: timed rows interleaved this many times (medians reported)
BATCHES = [1, 8, 64]  # --batches
# the paged settings timed: the pinned bf16 ones and the fp32 config's (a table load per key block, int64
# offsets) on the same bf16 data
_FP32 = attn.ATTN_FWD[torch.float32]["decode"]
PAGED_SETTINGS = [("pinned", {}), ("table load per key block, int64 key offsets",
                                   dict(PAGED_PRE_MAX=_FP32["PAGED_PRE_MAX"], PAGED_OFF32=_FP32["PAGED_OFF32"]))]


def speed_paged(q: bool) -> None:
    """Each of PAGED_SETTINGS: bits vs prefill (ragged, shuffled pages 16 / 32, split-K and in registers),
    then CUDA-graph times vs our contiguous decode at B = 1, 8, 64 (the contiguous kernel timed before and
    after each B's paged rows: its drift)."""
    H, Hk, D = (4, 2, 16) if q else (32, 8, 128)
    scale = 1 / math.sqrt(D)
    lens = [1, 5, 40, 70] if q else [1, 77, 1000, 4096, 255, 2500]
    qq, kk, vv, cu = packed(lens, H, Hk, D, 1)
    pre = attn.attention_prefill(qq, kk, vv, cu, scale)
    perm = torch.randperm(len(pre), generator=torch.Generator().manual_seed(2)).to(DEV)
    for ps in (16, 32):
        kp, table, seq_idx, pos = paged_cache(kk, lens, ps, 3)
        vp = paged_cache(vv, lens, ps, 3)[0]
        for name, decode in PAGED_SETTINGS:
            for spp in (1, 4, 0):
                try:
                    with settings(spp=spp, decode=decode):
                        out = attn.attention_paged(qq[perm], kp, vp, table, seq_idx[perm], pos[perm], scale)
                    bad = int((out.view(torch.int16) != pre[perm].view(torch.int16)).flatten(1).any(1).sum())
                except Exception as e:
                    bad = f"{type(e).__name__}: {e}"[:200]
                row("pbits", f"page={ps} chunks/program={spp}: {name}", rows_differing=bad)
    C = 64 if q else 4096
    for B in ([2] if q else BATCHES):
        g = torch.Generator(device=DEV).manual_seed(B)
        qd = torch.randn(B, H, D, device=DEV, generator=g).bfloat16()
        kc, vc = (torch.randn(B, C, Hk, D, device=DEV, generator=g).bfloat16() for _ in range(2))
        lens_b = torch.full((B,), C, device=DEV)
        ours = lambda: attn.attention_decode(qd, kc, vc, lens_b, scale)
        ref = ours()
        cases = []  # (ps, name, decode settings, call, bits equal to contiguous)
        for ps in (16, 32):
            kp, table, seq_idx, pos = paged_cache(kc.flatten(0, 1), [C] * B, ps, B)
            vp = paged_cache(vc.flatten(0, 1), [C] * B, ps, B)[0]
            rows = torch.arange(1, B + 1, device=DEV) * C - 1
            sidx, ppos = seq_idx[rows].contiguous(), pos[rows].contiguous()
            paged = (lambda kp, vp, table, sidx, ppos: lambda: attn.attention_paged(qd, kp, vp, table, sidx, ppos,
                                                                                    scale))(kp, vp, table, sidx, ppos)
            for name, decode in PAGED_SETTINGS:
                try:
                    with settings(decode=decode):
                        same = bits_equal(paged(), ref)
                except Exception as e:
                    row("paged", f"B={B} page={ps}: {name}", error=f"{type(e).__name__}: {e}"[:200])
                    continue
                cases.append((ps, name, decode, paged, same))
        # rounds: the contiguous kernel, then every case; a round after another (drift and noise show as spread)
        t_cont, t_case = [], [[] for _ in cases]
        for _ in range(ROUNDS):
            t_cont.append(bench_graph(ours))
            for c, case in enumerate(cases):
                with settings(decode=case[2]):
                    t_case[c].append(bench_graph(case[3]))
        g_cont = _median(t_cont)
        for (ps, name, _, _, same), ts in zip(cases, t_case):
            gp = _median(ts)
            row("paged", f"B={B} page={ps}: {name}", graph_paged_ms=gp, graph_contiguous_ms=g_cont,
                graph_time_ratio=gp / g_cont, bitwise_equal_contiguous=same,
                **({"ratios_per_round": [round(a / b, 4) for a, b in zip(ts, t_cont)]} if ROUNDS > 1 else {}))
        g_after = bench_graph(ours)
        row("paged", f"B={B} contiguous decode again (drift)", graph_contiguous_ms=g_after,
            vs_first=g_after / g_cont, **({"contiguous_ms_per_round": t_cont} if ROUNDS > 1 else {}))


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


# the engine's decode step: (name, decode settings, chunks per program: None = the size-based schedule)
ENGINE_VARIANTS = [(name, decode, None) for name, decode in PAGED_SETTINGS] + [("split-K, 1 chunk a program", {}, 1)]


def speed_engine(q: bool) -> None:
    """The engine's decode step at 256 rows (bench-moe-large: 16 / 4 heads, D 128, page 16), every
    row its own sequence at its last position, contexts uniform in 16..384 (the table 24 pages wide):
    bits vs prefill, then graph times of ENGINE_VARIANTS beside our contiguous decode over the same keys,
    and the time the K/V bytes take at 4.8 TB/s."""
    H, Hk, D, B, lo, hi, ps = (4, 2, 16, 8, 1, 40, 16) if q else (16, 4, 128, 256, 16, 384, 16)
    scale = 1 / math.sqrt(D)
    lens = torch.randint(lo, hi + 1, (B,), generator=torch.Generator().manual_seed(12)).tolist()
    qq, kk, vv, cu = packed(lens, H, Hk, D, 12)
    pre = attn.attention_prefill(qq, kk, vv, cu, scale)
    last = torch.tensor(cu[1:], device=DEV) - 1
    kp, table, seq_idx, pos = paged_cache(kk, lens, ps, 13)
    vp = paged_cache(vv, lens, ps, 13)[0]
    qd, sidx, ppos, ref = qq[last].contiguous(), seq_idx[last].contiguous(), pos[last].contiguous(), pre[last]
    kc = torch.zeros(B, hi, Hk, D, device=DEV, dtype=kk.dtype)
    vc = torch.zeros_like(kc)
    for b, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
        kc[b, : e - a], vc[b, : e - a] = kk[a:e], vv[a:e]
    lens_t = torch.tensor(lens, device=DEV)
    cont = lambda: attn.attention_decode(qd, kc, vc, lens_t, scale)
    paged = lambda: attn.attention_paged(qd, kp, vp, table, sidx, ppos, scale)
    kv_bytes = sum(lens) * Hk * D * 2 * kk.element_size()
    row("engine", f"B={B} H={H}/{Hk} D={D} page={ps} contexts {lo}..{hi} (mean {sum(lens) / B:.0f})",
        kv_mb=kv_bytes / 1e6, hbm_us_at_4_8_tb_s=kv_bytes / 4.8e6, contiguous_equal_prefill=bits_equal(cont(), ref))
    cases = []
    for name, decode, spp in ENGINE_VARIANTS:
        with settings(decode=decode, spp=spp):
            same = bits_equal(paged(), ref)
        cases.append((name, decode, spp, same))
    t_cont, t_case = [], [[] for _ in cases]
    for _ in range(ROUNDS):
        t_cont.append(bench_graph(cont))
        for c, case in enumerate(cases):
            with settings(decode=case[1], spp=case[2]):
                t_case[c].append(bench_graph(paged))
    g_cont = _median(t_cont)
    row("engine", f"B={B} contiguous decode (same keys)", graph_ms=g_cont)
    for (name, _, _, same), ts in zip(cases, t_case):
        gp = _median(ts)
        row("engine", f"B={B} paged: {name}", graph_ms=gp, vs_contiguous=gp / g_cont,
            vs_pinned=gp / _median(t_case[0]), bitwise_equal_prefill=same, ms_per_round=ts)


def speed_prefill(q: bool, chunks: tuple = (None,)) -> None:
    D = 16 if q else 128
    for T in ([32] if q else [1024, 4096]):
        B, H = (1, 2) if q else (4, 16)
        qq, kk, vv = (torch.randn(B * T, H, D, device=DEV).bfloat16() for _ in range(3))
        cu = [i * T for i in range(B + 1)]
        sq, sk, sv = (t.view(B, T, H, D).transpose(1, 2) for t in (qq, kk, vv))
        sdpa = lambda: F.scaled_dot_product_attention(sq, sk, sv, is_causal=True)
        ours = lambda: attn.attention_prefill(qq, kk, vv, cu, 1 / math.sqrt(D))
        t_sdpa, g_sdpa = bench(sdpa), bench_graph(sdpa)
        for chunk in chunks + ((1 << 20,) if chunks == (None,) else ()):
            with settings(chunk=chunk if isinstance(chunk, int) else None):
                t, gt = bench(ours), bench_graph(ours)
            tag = (" without key chunks" if chunk == 1 << 20 else f" chunk={chunk}") if isinstance(chunk, int) else ""
            row("speed", f"prefill B={B} H={H} T={T} D={D}{tag}", ours_ms=t, sdpa_ms=t_sdpa,
                speed_vs_sdpa=t_sdpa / t, graph_speed_vs_sdpa=g_sdpa / gt)


DECODE_TILES = [dict(BLOCK_M=64, num_stages=s, num_warps=4) for s in (2, 4)]
PREFILL_TILES = [dict(BLOCK_M=m, num_stages=s, num_warps=w) for m, s, w in ((128, 4, 8), (64, 3, 4))]


def sweep_schedules(q: bool) -> None:
    """Decode times per split-K schedule (chunks per program; 0 = in registers): the same bits, so the
    fastest is free to pick (attention.chunks_per_program)."""
    H, Hk, D, C = (4, 2, 16, 64) if q else (32, 8, 128, 4096)
    for B in ([2] if q else [1, 8, 64]):
        g = torch.Generator(device=DEV).manual_seed(B)
        qd = torch.randn(B, H, D, device=DEV, generator=g).bfloat16()
        kc, vc = (torch.randn(B, C, Hk, D, device=DEV, generator=g).bfloat16() for _ in range(2))
        lens = torch.full((B,), C, device=DEV)
        kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
        g_sdpa = bench_graph(lambda: F.scaled_dot_product_attention(qd[:, :, None], kt, vt, enable_gqa=True))
        ours = lambda: attn.attention_decode(qd, kc, vc, lens, 1 / math.sqrt(D))
        ref = ours()
        for spp in (None, 1, 2, 4, 8, 0):
            with settings(spp=spp):
                same = bits_equal(ours(), ref)
                t, gt = bench(ours), bench_graph(ours)
            row("sched", f"decode B={B} chunks/program={'auto' if spp is None else spp}", ours_ms=t,
                graph_ours_ms=gt, graph_time_ratio=gt / g_sdpa, bitwise_equal=same)


def sweep_tiles(q: bool) -> None:
    """Each decode / prefill tile with the pinned blocks and chunks: decode == prefill bits over every
    position of T = 1024 first (a tile that moves bits is out), then the times."""
    H, Hk, D, T = (4, 2, 16, 40) if q else (32, 8, 128, 1024)  # --quick: the code path only (the interpreter's tiles)
    qq, kk, vv, cu = packed([T], H, Hk, D, 7)
    lengths = torch.arange(1, T + 1, device=DEV)
    table = attn.ATTN_FWD[torch.bfloat16]
    saved = dict(table["decode"]), dict(table["prefill"])

    def bad():
        pre = attn.attention_prefill(qq, kk, vv, cu, 0.1)
        with settings(spp=1):
            dec = attn.attention_decode(qq, kk[None].expand(T, -1, -1, -1), vv[None].expand(T, -1, -1, -1), lengths,
                                        0.1)
        return sum(not bits_equal(dec[t], pre[t]) for t in range(T))

    try:
        for tile in DECODE_TILES[: 1 if q else None]:
            table["decode"] = dict(saved[0], **tile)
            row("sweep", f"decode tile {tile}", decode_vs_prefill_bad=bad())
            speed_decode(q, ("pinned",))
        table["decode"] = saved[0]
        for tile in PREFILL_TILES[: 1 if q else None]:
            table["prefill"] = dict(saved[1], **tile)
            row("sweep", f"prefill tile {tile}", decode_vs_prefill_bad=bad())
            speed_prefill(q, ("pinned",))
    finally:
        table["decode"], table["prefill"] = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated steps: bits, decode, prefill, paged, engine")
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default=None, help="paged step: batch sizes timed (1,8,64)")
    ap.add_argument("--warm", action="store_true", help="call everything once, time nothing, write nothing")
    ap.add_argument("--rounds", type=int, default=1, help="paged / engine steps: timed rounds, interleaved")
    a = ap.parse_args()
    global WARM, BATCHES, ROUNDS
    WARM, ROUNDS = a.warm, a.rounds
    BATCHES = [int(x) for x in a.batches.split(",")] if a.batches else BATCHES
    if a.sweep:
        sizes = (16, 64) if a.quick else (128, 512)
        steps = [("schedules", sweep_schedules), ("decode chunks", lambda q: speed_decode(q, sizes)),
                 ("prefill chunks", lambda q: speed_prefill(q, sizes)), ("tiles", sweep_tiles)]
    else:
        steps = [("bits", check_bits), ("decode", speed_decode), ("prefill", speed_prefill), ("paged", speed_paged),
                 ("engine", speed_engine)]
        if not a.only:
            steps = steps[:-1]  # the engine step runs when named (--only ...,engine)
        if a.only:
            steps = [s for s in steps if s[0] in a.only.split(",")]
    for name, step in steps:
        try:
            step(a.quick)
        except Exception as e:  # record and go on: one failing step must not hide the others
            row("error", name, error=f"{type(e).__name__}: {e}"[:300])
    gpu = "h200" if DEV == "cuda" and "H200" in torch.cuda.get_device_name(0) else (
        torch.cuda.get_device_name(0).replace(" ", "_") if DEV == "cuda" else "cpu")
    cfg = {str(k): v for k, v in attn.ATTN_FWD.items()}
    if WARM:
        return
    name = f"paged_attention_{gpu}" + ("_quick" if a.quick else "") + ("_sweep" if a.sweep else "")
    schedule = {"split_max_partials": attn.SPLIT_MAX_PARTIALS, "split_programs_per_sm": attn.SPLIT_PROGRAMS_PER_SM}
    path = record.write(name, {"config": cfg, "schedule": schedule, "rows": ROWS}, a.out)
    print("\n" + "\n".join(f"{r['section']:8} {r['name']:60} " + "  ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k not in ("section", "name"))
        for r in ROWS))
    print("wrote", path)


if __name__ == "__main__":
    main()
