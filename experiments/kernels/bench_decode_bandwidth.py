# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""How close a bench-moe-large decode step's GEMMs stream their weights to what the H200 can read: each
GEMM of the real decode path (the experts' gate_up over the token rows in place, down; q/k/v in one launch,
o, router, lm head; the router's top-k and SwiGLU beside them) timed under a CUDA graph at T tokens (256,
2048: decode steps; 8192: a prefill chunk), its weight bytes / time against a plain device copy of the same
bytes (2 x bytes / time) and a read-only stream (bytes / time). Candidates for the experts: the op set's
grouped GEMM in other configs (x2: two programs per SM) and a standalone kernel loading the weight tiles by
TMA (tma...; A by TMA too where the rows are not gathered). Every candidate's output is compared bitwise
with the pinned path's (a candidate may serve only with the same bits).

    python experiments/kernels/bench_decode_bandwidth.py [--tokens 256,2048,8192] [--out DIR] [--tiny]
    python experiments/kernels/bench_decode_bandwidth.py --warm --tokens 256    compile only (triton's disk cache;
                                                                        several in parallel keep a GPU call short)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

TINY = "--tiny" in sys.argv  # the script's logic on CPU under the interpreter, tiny shapes
WARM = "--warm" in sys.argv  # compile only: every kernel called once, nothing timed
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import bench_vs_vendor  # noqa: E402
from record import RESULTS, gpu_tag, write  # noqa: E402

from rlalign.kernels.torch_deterministic import moe_dispatch as dispatch_torch  # noqa: E402
from rlalign.kernels.triton import common, elementwise, gemm, moe  # noqa: E402

BF = torch.bfloat16
DEV = "cpu" if TINY else "cuda"
bench_vs_vendor.WARM = WARM
# bench-moe-large: d, experts, top-k, expert width, vocab, q / kv widths
D, E, TOPK, INTER, V, NQ, NKV = (2048, 64, 8, 768, 32000, 2048, 512) if not TINY else (64, 4, 2, 32, 96, 64, 16)
WHAT = ("decode-step GEMMs of bench-moe-large: time, weight bytes / time vs a device copy and a read stream of the "
        "same bytes; expert GEMM candidates (configs, TMA weight loads) with their bits against the pinned path")


def graph_us(fn) -> float:
    """Median us per call of fn replayed from a CUDA graph (wall clock per call on the CPU)."""
    return 1e3 * bench_vs_vendor.graph_ms([fn])


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PROGS: tl.constexpr):
    """A read-only stream: program p sums blocks p, p + PROGS, ... of x (one small store each)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(pid * BLOCK, n, PROGS * BLOCK):
        acc += tl.load(x_ptr + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def stream_refs(nbytes: int) -> dict:
    """GB/s of a device copy (2 x bytes / time) and of a read-only stream over nbytes."""
    n = nbytes // 2 // 8192 * 8192
    src = torch.randn(n, device=DEV).to(BF)
    dst = torch.empty_like(src)
    progs = 4 * common.num_sms(src.device)
    out = torch.empty(progs * 8192, dtype=torch.float32, device=DEV)
    copy_us = graph_us(lambda: dst.copy_(src))
    read_us = graph_us(lambda: _read_kernel[(progs,)](src, out, n, BLOCK=8192, PROGS=progs))
    return {"bytes": 2 * n, "copy_us": copy_us, "copy_GBps": 2 * 2 * n / copy_us / 1e3,
            "read_us": read_us, "read_GBps": 2 * n / read_us / 1e3}


@triton.jit(do_not_specialize=["R"])
def _tma_grouped(a_ptr, b_desc, c_ptr, cnt_ptr, idx_ptr, a_desc, R, N, K, sam,
                 P: tl.constexpr, P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_SMS: tl.constexpr, GATHER: tl.constexpr, A_TMA: tl.constexpr,
                 FLATTEN: tl.constexpr, UPCAST: tl.constexpr):
    """The op set's COUNTS-mode grouped GEMM (rows sorted by group, sizes on the device; GATHER = k: sorted row
    i is row idx[i] // k of a) with the weight tile [BLOCK_N, BLOCK_K] of expert p loaded by TMA from w viewed as
    [E * N, K] (N a multiple of BLOCK_N), and A_TMA: A's tile too, from a [R, K] (rows past the group are
    read and never stored). The same K chunks in the same order into one fp32 accumulator."""
    pid = tl.program_id(0)
    num_pid_n = N // BLOCK_N
    pr = tl.arange(0, P2)
    cnt = tl.maximum(tl.load(cnt_ptr + pr, mask=pr < P, other=0).to(tl.int32), 0)
    csum = tl.cumsum(cnt, 0)
    ends = tl.minimum(csum, R)
    starts = tl.minimum(csum - cnt, R)
    cnt = ends - starts
    tiles = tl.cdiv(cnt, BLOCK_M) * num_pid_n
    firsts = tl.cumsum(tiles, 0) - tiles
    num_tiles = tl.sum(tiles, 0)
    for tile in tl.range(pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        p = tl.sum((firsts <= tile).to(tl.int32), 0) - 1
        here = pr == p
        local = tile - tl.sum(tl.where(here, firsts, 0), 0)
        s_p = tl.sum(tl.where(here, starts, 0), 0)
        c_p = tl.sum(tl.where(here, cnt, 0), 0)
        num_pid_m = tl.cdiv(c_p, BLOCK_M)
        pid_m = local % num_pid_m
        pid_n = local // num_pid_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ram = tl.where(rm < c_p, rm, 0)
        if GATHER > 0:
            ram = tl.load(idx_ptr + s_p + ram) // GATHER
        else:
            ram = s_p + ram
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if A_TMA:
                a = a_desc.load([s_p + pid_m * BLOCK_M, k0])
            else:
                a = tl.load(a_ptr + ram[:, None] * sam + (k0 + rk)[None, :])
            b = b_desc.load([p * N + pid_n * BLOCK_N, k0])
            if UPCAST:  # the interpreter: its bf16 tl.dot is not usable
                acc += common.host_free_dot(a, b.T)
            else:
                acc = tl.dot(a, b.T, acc)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + (s_p + rm)[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < c_p) & (rn[None, :] < N))


def tma_grouped(x, w, counts, rows, cfg: dict):
    """grouped_mm(x, w, counts, order, TOPK) through _tma_grouped (w [E, N, K] contiguous, K % BLOCK_K == 0)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    R = x.shape[0] if rows is None else rows.numel()
    Ex, N, K = w.shape
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    b_desc = TensorDescriptor.from_tensor(w.view(Ex * N, K), [bn, bk])
    a_tma = cfg.get("A_TMA", False) and rows is None
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk]) if a_tma else b_desc
    sms = common.num_sms(x.device) * cfg.get("PER_SM", 1)
    bound = (triton.cdiv(R, bm) + min(Ex, R)) * (N // bn)
    _tma_grouped[(min(sms, bound),)](
        x, b_desc, out, counts, counts if rows is None else rows, a_desc, R, N, K, x.stride(0),
        P=Ex, P2=max(2, triton.next_power_of_2(Ex)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_SMS=sms,
        GATHER=0 if rows is None else TOPK, A_TMA=a_tma, FLATTEN=cfg.get("FLATTEN", False), UPCAST=TINY,
        num_stages=cfg["num_stages"], num_warps=cfg["num_warps"])
    return out


def _g(bm, bn, bk, s, w, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_stages=s, num_warps=w, **kw)


# name -> (kind, config): "pinned" = the op set as it stands; "cfg" = its kernel in that config; "tma" = the TMA
# variant above. PER_SM: persistent programs per SM (two fit where a config's stages take <= ~110 KB).
SMALL = {  # (a 64 x 256 tile's 40 KB per stage: 4 stages fit in the SM's 227 KB; 2 programs: <= ~110 KB each)
    "pinned": ("pinned", None),
    "64x256k64s4w4": ("cfg", _g(64, 256, 64, 4, 4)),
    "64x128k128s4w4": ("cfg", _g(64, 128, 128, 4, 4)),
    "64x128k64s4w4x2": ("cfg", _g(64, 128, 64, 4, 4, PER_SM=2)),
    "tma64x256k64s4w4": ("tma", _g(64, 256, 64, 4, 4)),
    "tma64x128k64s4w4x2": ("tma", _g(64, 128, 64, 4, 4, PER_SM=2)),
}
LARGE = {
    "pinned": ("pinned", None),
    "128x256k64s3w8f": ("cfg", _g(128, 256, 64, 3, 8, FLATTEN=True)),
    "64x256k64s4w8": ("cfg", _g(64, 256, 64, 4, 8)),  # 64-row tiles: less padding past each expert's rows
    "tma128x256k64s4w8": ("tma", _g(128, 256, 64, 4, 8, A_TMA=True)),
    "tma128x256k64s3w8f": ("tma", _g(128, 256, 64, 3, 8, FLATTEN=True, A_TMA=True)),
}
if TINY:
    SMALL = LARGE = {"pinned": ("pinned", None), "16x16k16s2w4x2": ("cfg", _g(16, 16, 16, 2, 4, PER_SM=2)),
                     "tma16x16k16s2w4": ("tma", _g(16, 16, 16, 2, 4, A_TMA=True))}
CANDIDATES = {**SMALL, **LARGE}


def with_grouped(cfg: dict | None, fn):
    """fn() with every grouped-GEMM bucket in cfg (None: the pinned tables)."""
    saved = gemm.GROUPED_SMALL_M[BF], gemm.GROUPED_SHORT_K[BF]
    if cfg is not None:
        gemm.GROUPED_SMALL_M[BF], gemm.GROUPED_SHORT_K[BF] = [(1 << 30, cfg)], None
    try:
        return fn()
    finally:
        gemm.GROUPED_SMALL_M[BF], gemm.GROUPED_SHORT_K[BF] = saved


def expert_rows(T: int, g: torch.Generator) -> dict:
    """The experts' operands at T tokens, routed top-k at random (counts on the device, as in a decode graph)."""
    ids = torch.rand(T, E, generator=g, device=DEV).topk(TOPK, dim=1).indices
    order, dest, counts = dispatch_torch(ids.reshape(-1), E)
    x = torch.randn(T, D, generator=g, device=DEV).to(BF)
    gu = (torch.randn(E, 2 * INTER, D, generator=g, device=DEV) * 0.02).to(BF)
    dn = (torch.randn(E, D, INTER, generator=g, device=DEV) * 0.02).to(BF)
    return dict(x=x, order=order, dest=dest, counts=counts, rows=order, gu=gu, dn=dn)


def expert_rows_table(T: int, ops: dict, candidates: list[str]) -> list[dict]:
    """gate_up (token rows gathered) and down (sorted rows) per candidate: us, GB/s of weights, bits."""
    x, gu, dn, counts, rows = ops["x"], ops["gu"], ops["dn"], ops["counts"], ops["rows"]
    h = moe.moe_slot_linear(x, ops["order"], ops["dest"], TOPK, gu, counts)
    hs = elementwise.swiglu_halves(h)
    cases = {"experts gate_up": (lambda: moe.moe_slot_linear(x, ops["order"], ops["dest"], TOPK, gu, counts), x, gu,
                                 rows),
             "experts down": (lambda: gemm.grouped_linear(hs, dn, counts), hs, dn, None)}
    out = []
    for name, (pinned, a, w, idx) in cases.items():
        ref = pinned().clone()
        wbytes = w.numel() * w.element_size()
        row = {"tokens": T, "shape": name, "weight_bytes": wbytes}
        for cname in candidates:
            kind, cfg = CANDIDATES[cname]
            if kind == "pinned":
                fn = pinned
            elif kind == "cfg":
                fn = (lambda cfg=cfg: with_grouped(cfg, pinned))
            else:
                fn = (lambda cfg=cfg: tma_grouped(a, w, counts, idx, cfg))
            try:
                same = bool(torch.equal(fn().view(torch.int16), ref.view(torch.int16)))
                us = graph_us(fn)
                row[cname] = {"us": us, "weight_GBps": wbytes / us / 1e3, "bits_equal_pinned": same}
            except Exception as e:  # noqa: BLE001 - out of shared memory, an API a version lacks, ...
                row[cname] = {"error": f"{type(e).__name__}: {e}"[:200]}
        out.append(row)
        ok = sorted((v["us"], k) for k, v in row.items() if isinstance(v, dict) and "us" in v)
        print(f"T={T:5d} {name:16s} " + "  ".join(
            f"{k} {u:.1f}us {row[k]['weight_GBps']:.0f}GB/s{'' if row[k]['bits_equal_pinned'] else ' BITDIFF'}"
            for u, k in ok[:6]), flush=True)
        print("   errors:", {k: v["error"][:80] for k, v in row.items() if isinstance(v, dict) and "error" in v},
              flush=True)
    return out


def dense_table(T: int, g: torch.Generator) -> list[dict]:
    """The decode step's other GEMMs and small ops at T rows: us and weight GB/s (pinned path)."""
    x = torch.randn(T, D, generator=g, device=DEV).to(BF)
    ws = {n: (torch.randn(r, D, generator=g, device=DEV) * 0.02).to(BF)
          for n, r in (("q", NQ), ("k", NKV), ("v", NKV), ("o", D), ("router", E), ("lm_head", V))}
    logits = gemm.linear(x, ws["router"])
    h = torch.randn(T * TOPK, 2 * INTER, generator=g, device=DEV).to(BF)
    cases = {"qkv": (lambda: gemm.linears(x, [ws["q"], ws["k"], ws["v"]], [None] * 3), ("q", "k", "v")),
             "o_proj": (lambda: gemm.linear(x, ws["o"]), ("o",)),
             "router": (lambda: gemm.linear(x, ws["router"]), ("router",)),
             "lm_head": (lambda: gemm.linear(x, ws["lm_head"]), ("lm_head",)),
             "route top-k": (lambda: moe.moe_route(logits, TOPK, True), ()),
             "swiglu_halves": (lambda: elementwise.swiglu_halves(h), ())}
    out = []
    for name, (fn, names) in cases.items():
        wbytes = sum(ws[n].numel() * 2 for n in names)
        us = graph_us(fn)
        out.append({"tokens": T, "shape": name, "us": us, "weight_bytes": wbytes,
                    "weight_GBps": wbytes / us / 1e3 if wbytes else None})
        print(f"T={T:5d} {name:16s} {us:8.1f} us" + (f"  {wbytes / us / 1e3:6.0f} GB/s of weights" if wbytes else ""),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,2048,8192" if not TINY else "8")
    ap.add_argument("--candidates", default="", help="names (default: SMALL up to 512 tokens, else LARGE)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default=None, help="result name (default decode_bandwidth_<card>, e.g. _h200)")
    ap.add_argument("--tiny", action="store_true", help="the script's logic on CPU (interpreter, tiny shapes)")
    ap.add_argument("--warm", action="store_true", help="compile only (nothing timed, nothing written)")
    a = ap.parse_args()
    a.name = a.name or f"decode_bandwidth_{gpu_tag()}"
    res: dict = {"what_it_shows": WHAT, "candidates": {k: v[1] for k, v in CANDIDATES.items()}}
    with torch.no_grad():
        res["stream"] = stream_refs(2 * E * INTER * D * 2)  # the gate_up weights' bytes
        print("stream refs", res["stream"], flush=True)
        res["experts"], res["dense"] = [], []
        for T in (int(t) for t in a.tokens.split(",")):
            g = torch.Generator(device=DEV).manual_seed(T)
            names = a.candidates.split(",") if a.candidates else list(SMALL if T <= 512 else LARGE)
            res["experts"] += expert_rows_table(T, expert_rows(T, g), names)
            res["dense"] += dense_table(T, g)
            if not a.warm:
                print("wrote", write(a.name, res, a.out), flush=True)


if __name__ == "__main__":
    main()
