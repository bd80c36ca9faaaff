"""Triton backend of the deterministic op set (GPU; CPU tensors under TRITON_INTERPRET=1).

The contract is the torch reference's: the bits of an output row depend only on that row's
inputs. Each kernel keeps it the same way:
  matmul     persistent tiles, no split-K: every output element reduces K in BLOCK_K chunks,
             in order, with the same tl.dot instruction for every M (a pinned config per dtype and
             M bucket below, the buckets measured bitwise equal; no autotuning). Linear forward,
             both backward GEMMs and the grouped expert GEMMs use it.
  rmsnorm    one program per row; the weight gradient goes through private per-program partial
             sums, then one ordered reduction (no atomics).
  logprobs   one program per row: max, sum of exp and the gather over the vocabulary in fixed
             BLOCK_V chunks; backward per row.
  attention  one kernel for causal prefill and for decode: a query row reduces its keys in blocks
             of BLOCK_N, block 0, 1, 2, ..., with the same online-softmax update; blocks past a
             row's position are fully masked and change nothing, so decode == prefill bitwise.
             Backward (FA2-style, no atomics): one program per key block owns dK/dV (summing the
             GQA heads and query blocks in order), one per query block owns dQ.
RoPE, the router (softmax + top-k, ties to the lowest id), SwiGLU and the MoE combine have fused
row-local kernels too. The expert GEMM is ONE launch over rows sorted by expert (the matmul kernel
over a table of problems), forward, dX and dW (no atomics). Backward operands are read in place
(M- or N-contiguous), never transposed copies.

Under the interpreter, tl.dot on bf16 operands returns garbage (triton 3.6/3.9), so operands are
upcast to fp32 there, and smaller tiles are used; interpreted bits are not comparable to GPU bits.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# the contract: one matmul config per dtype (and one for the interpreter), never autotuned
MATMUL_CONFIGS = {
    torch.bfloat16: dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_stages=3, num_warps=8),
    torch.float16: dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_stages=3, num_warps=8),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_stages=3, num_warps=4),
}
INTERPRET_MATMUL = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=4)
# Narrower tiles for small M (more tiles than SMs without split-K), keyed by dtype: [(max M, config)].
# A config may join only if every element still reduces K in the same order through the same chain
# of k16 MMAs into one fp32 accumulator (BLOCK_K 64 or 128 cut that chain at different points, not
# reorder it), and its rows measured bitwise equal to the main config's for M = 1..8192
# on the GPU (experiments/bench_triton.py --only matmul_sweep; v7-v9: 0 rows differing for every
# candidate, BLOCK_K 64 or 128; v9, CUDA-graph kernel times: M=64 0.67x, M=256 0.71x cuBLAS, against
# 0.17x / 0.31x with the main config).
_SMALL = [(64, dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_stages=6, num_warps=4)),
          (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_stages=3, num_warps=4))]
MATMUL_SMALL_M: dict = {torch.bfloat16: _SMALL, torch.float16: _SMALL}
# attention: prefill and decode share BLOCK_N (the key blocks a row reduces over, in order);
# their tile heights may differ: both use wgmma tiles (BLOCK_M >= 64), bitwise equal on the H200
# (decode with BLOCK_M=16 takes mma.sync and was NOT: 3-10 of 700 positions differed,
# results/triton_NVIDIA_H200_v7.json). Picked by experiments/bench_triton.py's sweeps. fp32 tiles
# take twice the shared memory: fewer stages.
ATTN_FWD = {  # v8 sweep: prefill 0.78x SDPA at T=1k and 4k, decode 1.05x SDPA's time at B=64
    torch.bfloat16: dict(BLOCK_N=64, prefill=dict(BLOCK_M=128, num_stages=3, num_warps=8),
                         decode=dict(BLOCK_M=64, num_stages=2, num_warps=4)),
    torch.float32: dict(BLOCK_N=64, prefill=dict(BLOCK_M=64, num_stages=2, num_warps=4),
                        decode=dict(BLOCK_M=64, num_stages=2, num_warps=4)),
}
ATTN_FWD[torch.float16] = ATTN_FWD[torch.bfloat16]
ATTN_BWD = {  # bwd: the dK/dV kernel (a key block per program), bwd_dq: the dQ kernel (a query block)
    torch.bfloat16: dict(bwd=dict(BLOCK_M=32, BLOCK_N=64, num_stages=3, num_warps=4),
                         bwd_dq=dict(BLOCK_M=64, BLOCK_N=32, num_stages=3, num_warps=4)),
    torch.float32: dict(bwd=dict(BLOCK_M=32, BLOCK_N=64, num_stages=2, num_warps=4),
                        bwd_dq=dict(BLOCK_M=64, BLOCK_N=32, num_stages=2, num_warps=4)),
}
ATTN_BWD[torch.float16] = ATTN_BWD[torch.bfloat16]
INTERPRET_ATTN = dict(prefill=dict(BLOCK_M=32, BLOCK_N=16), decode=dict(BLOCK_M=16, BLOCK_N=16),
                      bwd=dict(BLOCK_M=16, BLOCK_N=16), bwd_dq=dict(BLOCK_M=16, BLOCK_N=16))
ROW_BLOCK = 1024  # rmsnorm / logprob chunk along the row
SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def for_tensor(x: torch.Tensor):
    """This module, if it can run on x's device; otherwise a clear error."""
    if x.is_cuda or INTERPRET:
        return _module()
    raise RuntimeError(
        "kernels.backend=triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); "
        "use kernels.backend=torch or auto on this device"
    )


def _module():
    import sys

    return sys.modules[__name__]


def _check(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype not in SUPPORTED:
            raise TypeError(f"triton {name}: dtype {t.dtype} is not supported ({', '.join(map(str, SUPPORTED))})")
    devs = {t.device for t in ts}
    if len(devs) > 1:
        raise ValueError(f"triton {name}: tensors on different devices {sorted(map(str, devs))}")


def _num_sms(device) -> int:
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_CACHE: OrderedDict = OrderedDict()  # work tables and GEMM launch plans, by content (LRU)


def _cached(key: tuple, build):
    """build() once per key (LRU of 1024): a training step calls the same shapes layer after layer,
    so the host work per launch is one lookup and no host-to-device copy."""
    v = _CACHE.get(key)
    if v is None:
        v = _CACHE[key] = build()
        if len(_CACHE) > 1024:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return v


def _table(key: tuple, build, device) -> torch.Tensor:
    """The device tensor of build() -> (list of int rows, dtype), cached by key."""
    def make():
        rows, dtype = build()
        return torch.tensor(rows, dtype=dtype).to(device, non_blocking=True)
    return _cached((key, device), make)


# --- matmul and grouped (expert) matmul: one kernel ---------------------------------------------
@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, prob_ptr, num_tiles, N, M1, K1, sam, sak, sbk, sbn, scm, scn,
                 P: tl.constexpr, P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, UPCAST: tl.constexpr,
                 IEEE: tl.constexpr, ALIGNED: tl.constexpr, EVEN_K: tl.constexpr, A_M_CONTIG: tl.constexpr,
                 B_N_CONTIG: tl.constexpr, SINGLE: tl.constexpr):
    """Persistent GEMM over P problems (P = 1: a plain matmul; P = experts: the grouped expert GEMM).
    Problem p (a row of prob_ptr: first tile, M_p, K_p, a_off, b_off, c_off) is
    C[c_off + m, n] = sum_k A[a_off + m, k] B[b_off + k, n]. Every output element reduces its K_p
    in BLOCK_K chunks, in order, with the same tl.dot: a row's bits depend on its own data only,
    never on M_p, on the other problems or on which program computed it. Operands come in any
    strides (K-, M- or N-contiguous); the host says which hints hold (EVEN_K: every K_p is a multiple
    of BLOCK_K, so K needs no mask; A_M_CONTIG / B_N_CONTIG: that dim is contiguous and a multiple of
    16 long, so clamped rows never split a vector). SINGLE: one problem given as M1, K1 (no table);
    the same tiles and instructions."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    if not SINGLE:
        pr = tl.arange(0, P2)
        firsts = tl.load(prob_ptr + pr * 6, mask=pr < P, other=num_tiles)
    for tile in tl.range(pid, num_tiles, NUM_SMS):
        if SINGLE:
            local = tile
            M = M1
            K = K1
            a_base = a_ptr
            b_base = b_ptr
            c_base = c_ptr
        else:
            p = tl.sum((firsts <= tile).to(tl.int32)) - 1  # the problem this tile belongs to
            row = prob_ptr + p * 6
            local = (tile - tl.load(row)).to(tl.int32)
            M = tl.load(row + 1).to(tl.int32)
            K = tl.load(row + 2).to(tl.int32)
            a_off = tl.load(row + 3)
            b_off = tl.load(row + 4)
            c_off = tl.load(row + 5)
            if ALIGNED:  # the host checked: every offset is a multiple of 16 elements
                a_off = tl.multiple_of(a_off, 16)
                b_off = tl.multiple_of(b_off, 16)
                c_off = tl.multiple_of(c_off, 16)
            a_base = a_ptr + a_off
            b_base = b_ptr + b_off
            c_base = c_ptr + c_off
        if EVEN_K:
            K = tl.multiple_of(K, BLOCK_K)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        group = local // in_group
        first_m = group * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (local % size_m)
        pid_n = (local % in_group) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ram = tl.where(rm < M, rm, 0)  # rows past M read row 0: computed, never stored
        rbn = tl.where(rn < N, rn, 0)
        if A_M_CONTIG:
            ram = tl.max_contiguous(tl.multiple_of(ram, 16), 16)
        if B_N_CONTIG:
            rbn = tl.max_contiguous(tl.multiple_of(rbn, 16), 16)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K in order, BLOCK_K at a time: the same for every M
            rk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                a = tl.load(a_base + ram[:, None] * sam + rk[None, :] * sak)
                b = tl.load(b_base + rk[:, None] * sbk + rbn[None, :] * sbn)
            else:
                a = tl.load(a_base + ram[:, None] * sam + rk[None, :] * sak, mask=rk[None, :] < K, other=0.0)
                b = tl.load(b_base + rk[:, None] * sbk + rbn[None, :] * sbn, mask=rk[:, None] < K, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c_base + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _config(dtype, m: int | None = None) -> dict:
    """The pinned config for dtype; m (rows, or rows per problem) picks a small-M one if any."""
    if INTERPRET:
        return dict(INTERPRET_MATMUL)
    for max_m, cfg in MATMUL_SMALL_M.get(dtype, ()):
        if m is not None and m <= max_m:
            return dict(cfg)
    return dict(MATMUL_CONFIGS[dtype])


def _gemm(a, b, c, problems: list[tuple[int, int, int, int, int]], N: int, strides: tuple, cfg: dict) -> None:
    """Launch _gemm_kernel over problems (M_p, K_p, a_off, b_off, c_off); strides (sam, sak, sbk, sbn,
    scm, scn) are shared by all problems; a, b, c are the base tensors the offsets index. The plan
    (tile table on the device, grid, layout flags) is cached: the host work per call is one lookup."""
    if max(a.numel(), b.numel(), c.numel()) >= 2**31:
        raise ValueError(f"triton matmul: operands of {max(a.numel(), b.numel(), c.numel())} elements "
                         "exceed the kernel's 32-bit tile offsets")
    key = ("gemm", tuple(problems), N, strides, tuple(cfg.values()), a.dtype, a.device)
    table, grid, kw = _cached(key, lambda: _gemm_plan(a, problems, N, strides, cfg))
    if table is not None:
        _gemm_kernel[grid](a, b, c, table, *kw["args"], *strides, **kw["meta"])


def _gemm_plan(a, problems, N, strides, cfg):
    rows, first = [], 0
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    for M_p, K_p, ao, bo, co in problems:
        rows.append((first, M_p, K_p, ao, bo, co))
        first += triton.cdiv(M_p, cfg["BLOCK_M"]) * n_tiles
    if first == 0:
        return None, None, None
    sam, sak, sbk, sbn = strides[:4]
    flags = dict(
        ALIGNED=all(v % 16 == 0 for r in rows for v in r[3:]),
        EVEN_K=all(r[2] % cfg["BLOCK_K"] == 0 for r in rows),
        A_M_CONTIG=sam == 1 and sak != 1 and all(r[1] % 16 == 0 for r in rows),
        B_N_CONTIG=sbn == 1 and sbk != 1 and N % 16 == 0,
    )
    single = len(rows) == 1 and rows[0][3:] == (0, 0, 0)
    # one problem at offset 0 (a plain matmul) needs no table: M, K as arguments (the pointer slot
    # then takes any tensor, never read)
    table = torch.tensor(rows, dtype=torch.int64).to(a.device, non_blocking=True) if not single else a
    sms = _num_sms(a.device)
    meta = dict(P=len(rows), P2=max(2, triton.next_power_of_2(len(rows))), NUM_SMS=sms, UPCAST=INTERPRET,
                IEEE=a.dtype == torch.float32, SINGLE=single, **flags, **cfg)
    M1, K1 = (rows[0][1], rows[0][2]) if single else (0, 0)
    return table, (min(sms, first),), {"args": (first, N, M1, K1), "meta": meta}


def _usable(t: torch.Tensor) -> torch.Tensor:
    """A 2-D operand the kernel can read in place: one of its dims contiguous (else a copy)."""
    return t if 1 in t.stride() or t.numel() <= 1 else t.contiguous()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N] -> [M, N] in a's dtype, fp32 accumulation; any strides. Bits of a row of
    the result are independent of M (fixed config, no split-K)."""
    _check("matmul", a, b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"triton matmul: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if a.dtype != b.dtype:
        raise TypeError(f"triton matmul: dtypes differ ({a.dtype} vs {b.dtype})")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    cfg = _config(a.dtype, M)
    a, b = _usable(a), _usable(b)  # read in place: K-, M- or N-contiguous operands, same bits
    _gemm(a, b, c, [(M, a.shape[1], 0, 0, 0)], N, (a.stride(0), a.stride(1), b.stride(0), b.stride(1), N, 1), cfg)
    return c


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        return matmul(x2, w.t())

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        g = g.to(x2.dtype)
        gx = matmul(g, w) if ctx.needs_input_grad[0] else None
        gw = matmul(g.t(), x2).to(w.dtype) if ctx.needs_input_grad[1] else None  # K = tokens, in order
        return gx, gw


def linear(x, w, bias=None):
    _check("linear", x, w)
    x2 = x.reshape(-1, x.shape[-1])
    y = _Linear.apply(x2, w.to(x.dtype)) if torch.is_grad_enabled() else matmul(x2, w.to(x.dtype).t())
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)


def _starts(counts: list[int]) -> list[int]:
    """First row of each group of rows sorted by group."""
    out, s = [], 0
    for c in counts:
        out.append(s)
        s += c
    return out


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of x [R, K] sorted by group, group e times w[e]^T (w [E, N, K], any strides) -> [R, N],
    ONE launch. Every row's bits equal matmul(row, w[e]^T): same kernel, same config, same K order."""
    R, N = x.shape[0], w.shape[1]
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return out
    groups = sum(1 for c in counts if c)
    cfg = _config(x.dtype, -(-R // max(groups, 1)))
    if w.stride(2) != 1 and w.stride(1) != 1:
        w = w.contiguous()
    x = _usable(x)
    st = _starts(counts)
    probs = [(c, x.shape[1], s * x.stride(0), e * w.stride(0), s * N) for e, (c, s) in enumerate(zip(counts, st)) if c]
    _gemm(x, w, out, probs, N, (x.stride(0), x.stride(1), w.stride(2), w.stride(1), N, 1), cfg)
    return out


def _grouped_wgrad(g: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """dW[e] = g_e^T x_e for rows sorted by group: [E, N, K] in ONE launch, no atomics: each program
    owns a tile of one expert's dW and reduces that expert's rows in order, BLOCK_K at a time (the
    chunks of matmul(g_e^T, x_e)). Read in place: g^T is an M-contiguous A, x an N-contiguous B."""
    E, N, K = len(counts), g.shape[1], x.shape[1]
    dw = torch.empty(E, N, K, dtype=x.dtype, device=x.device)
    g, x = g.contiguous(), x.contiguous()
    probs = [(N, c, s * N, s * K, e * N * K) for e, (c, s) in enumerate(zip(counts, _starts(counts)))]
    _gemm(g, x, dw, probs, K, (1, N, K, 1, K, 1), _config(x.dtype))
    return dw


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return _grouped_mm(x, w, counts)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous().to(x.dtype)
        gx = _grouped_mm(g, w.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
        gw = _grouped_wgrad(g, x, ctx.counts).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def grouped_linear(x, w, counts: list[int]):
    """Expert GEMMs over rows sorted by expert ([R, K] x [E, N, K] -> [R, N]): one launch forward,
    one for dX, one for dW (plus the layout copies)."""
    _check("grouped_linear", x, w)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or len(counts) != w.shape[0] \
            or sum(counts) != x.shape[0]:
        raise ValueError(f"triton grouped_linear: x {tuple(x.shape)}, w {tuple(w.shape)} and counts "
                         f"(len {len(counts)}, sum {sum(counts)}) do not fit")
    counts = [int(c) for c in counts]
    w = w.to(x.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _GroupedLinear.apply(x, w, counts)
    return _grouped_mm(x, w, counts)


# --- rmsnorm -------------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_fwd(x_ptr, w_ptr, y_ptr, r_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    tl.store(r_ptr + row, rstd)
    for d0 in range(0, D, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        # as the reference: normalise, round to the dtype, then scale (the product of two
        # dtype values is exact in fp32, so one rounding at the store matches a dtype multiply)
        y = (x * rstd).to(w.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def _rmsnorm_bwd(x_ptr, w_ptr, g_ptr, r_ptr, c_ptr, dx_ptr, pw_ptr, R, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: dx for rows [p*ROWS, (p+1)*ROWS) and its private partial of dw (no atomics), summed
    over its rows in order in registers, one column chunk at a time."""
    p = tl.program_id(0)
    for i in range(ROWS):  # pass 1: each row's c = sum(g w x) rstd^3 / D
        row = p * ROWS + i
        if row < R:
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for d0 in range(0, D, BLOCK):
                cols = d0 + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
                g = tl.load(g_ptr + row * D + cols, mask=cols < D, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
                acc += g * w * x
            rstd = tl.load(r_ptr + row)
            tl.store(c_ptr + row, tl.sum(acc, axis=0) * rstd * rstd * rstd / D)
    for d0 in range(0, D, BLOCK):  # pass 2: dx, and the dw partial over the rows in order
        cols = d0 + tl.arange(0, BLOCK)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        pw = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(ROWS):
            row = p * ROWS + i
            m = (cols < D) & ((cols * 0 + row) < R)
            rstd = tl.load(r_ptr + tl.minimum(row, R - 1))  # rows past R: x = g = 0, they add 0
            c = tl.load(c_ptr + tl.minimum(row, R - 1))
            x = tl.load(x_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * D + cols, (g * w * rstd - x * c).to(dx_ptr.dtype.element_ty), mask=m)
            pw = pw + g * x * rstd
        tl.store(pw_ptr + p * D + cols, pw, mask=cols < D)


_NORM_ROWS = 16  # rows per backward program: fixes the grouping of the dw partial sums


@triton.jit
def _colsum_kernel(x_ptr, out_ptr, P, D, BLOCK: tl.constexpr):
    """out[d] = x[0, d] + x[1, d] + ... + x[P-1, d], in that order (fp32)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(P):
        acc = acc + tl.load(x_ptr + p * D + cols, mask=cols < D, other=0.0)
    tl.store(out_ptr + cols, acc, mask=cols < D)


def _colsum(x: torch.Tensor) -> torch.Tensor:
    P, D = x.shape
    out = torch.empty(D, dtype=torch.float32, device=x.device)
    _colsum_kernel[(triton.cdiv(D, 256),)](x.contiguous(), out, P, D, BLOCK=256)
    return out


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, eps):
        R, D = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(R, dtype=torch.float32, device=x2.device)
        if R:
            _rmsnorm_fwd[(R,)](x2, w.to(x2.dtype), y, rstd, D, eps, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(D)))
        ctx.save_for_backward(x2, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x2, w, rstd = ctx.saved_tensors
        R, D = x2.shape
        dx = torch.empty_like(x2)
        progs = triton.cdiv(R, _NORM_ROWS)
        partial = torch.empty(max(progs, 1), D, dtype=torch.float32, device=x2.device)
        if R:
            cbuf = torch.empty(R, dtype=torch.float32, device=x2.device)
            _rmsnorm_bwd[(progs,)](x2, w.float(), g.contiguous(), rstd, cbuf, dx, partial, R, D, ROWS=_NORM_ROWS,
                                   BLOCK=min(ROW_BLOCK, triton.next_power_of_2(D)))
        else:
            partial.zero_()
        dw = _colsum(partial)  # one ordered reduction of the private partials
        return dx, dw.to(w.dtype), None


def rmsnorm(x, w, eps: float):
    _check("rmsnorm", x, w)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return _RMSNorm.apply(x2, w, eps).reshape(x.shape)


# --- token logprobs ------------------------------------------------------------------------------
@triton.jit
def _logprob_fwd(z_ptr, t_ptr, out_ptr, lse_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
        m = tl.maximum(m, z)
    mx = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
        s += tl.exp(z - mx)
    lse = mx + tl.log(tl.sum(s, axis=0))
    tok = tl.load(t_ptr + row)
    zt = tl.load(z_ptr + row * V + tok)
    tl.store(out_ptr + row, zt - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logprob_bwd(z_ptr, t_ptr, lse_ptr, g_ptr, dz_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    tok = tl.load(t_ptr + row)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
        d = g * (tl.where(cols == tok, 1.0, 0.0) - tl.exp(z - lse))
        tl.store(dz_ptr + row * V + cols, d, mask=cols < V)


class _LogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, tokens):
        N, V = z.shape
        out = torch.empty(N, dtype=torch.float32, device=z.device)
        lse = torch.empty(N, dtype=torch.float32, device=z.device)
        if N:
            _logprob_fwd[(N,)](z, tokens, out, lse, V, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)))
        ctx.save_for_backward(z, tokens, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        z, tokens, lse = ctx.saved_tensors
        dz = torch.empty_like(z)
        if z.shape[0]:
            _logprob_bwd[(z.shape[0],)](z, tokens, lse, g.contiguous().float(), dz, z.shape[1],
                                        BLOCK=min(ROW_BLOCK, triton.next_power_of_2(z.shape[1])))
        return dz, None


def log_softmax_gather(z, tokens):
    """z [N, V] fp32 (tempered/filtered) -> log p(tokens) [N] fp32, one program per row."""
    _check("log_softmax_gather", z)
    return _LogProb.apply(z.float().contiguous(), tokens.contiguous())


# --- attention -------------------------------------------------------------------------------------
@triton.jit
def _attn_block(q, k_ptr, v_ptr, kbase, j0, n_keys, qpos, skn, rd, m_i, l_i, acc, qk_scale,
                BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """One key block's online-softmax update (scores in log2 units). MASKED=False is taken only for
    blocks whose keys are all valid for every tile row: the same values as the masked form (a
    where() that keeps every score), so a row's bits do not depend on which form its block took
    (the kernel runs without FMA contraction, so both forms round the same operations)."""
    rn = j0 + tl.arange(0, BLOCK_N)
    if MASKED:
        kmask = rn < n_keys
        k = tl.load(k_ptr + kbase + rn[:, None] * skn + rd[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + kbase + rn[:, None] * skn + rd[None, :], mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kbase + rn[:, None] * skn + rd[None, :])
        v = tl.load(v_ptr + kbase + rn[:, None] * skn + rd[None, :])
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(kmask[None, :] & (rn[None, :] <= qpos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, work_ptr, C, sqn, sqh, skn, skh, son, soh, qk_scale,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                 IEEE: tl.constexpr, PACK_HEADS: tl.constexpr):
    """Work item w = (q_row0, n_q, q_pos0, k_row0, n_keys). Prefill: program axis 0 is the query head
    and tile rows are positions q_pos0.. of rows q_row0..; decode (PACK_HEADS): axis 0 is the kv head
    and tile rows are its G query heads at position q_pos0 of row q_row0 (the GQA group shares one
    K/V stream). Either way each tile row attends keys k_row0.. up to its position, in BLOCK_N
    blocks, in order, through the same instructions: a row's bits depend neither on the packing nor
    on BLOCK_M (BLOCK_N is shared by prefill and decode; the tile height is not)."""
    a0 = tl.program_id(0)
    w = tl.program_id(1)
    if PACK_HEADS:  # decode: work_ptr holds the sequence lengths; sequence w's cache rows start at w*C
        n_keys = tl.load(work_ptr + w).to(tl.int32)
        q_row0 = w
        q_pos0 = n_keys - 1
        k_row0 = w * C
    else:
        q_row0 = tl.load(work_ptr + w * 5)
        n_q = tl.load(work_ptr + w * 5 + 1)
        q_pos0 = tl.load(work_ptr + w * 5 + 2)
        k_row0 = tl.load(work_ptr + w * 5 + 3)
        n_keys = tl.load(work_ptr + w * 5 + 4)
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D)
    if PACK_HEADS:
        hk = a0
        qrow = q_row0 + rm * 0
        qhead = hk * G + rm
        qpos = q_pos0 + rm * 0
        qmask = rm < G
        H = tl.num_programs(0) * G
    else:
        hk = a0 // G
        qrow = q_row0 + rm
        qhead = a0 + rm * 0
        qpos = q_pos0 + rm
        qmask = rm < n_q
        H = tl.num_programs(0)
    q = tl.load(q_ptr + qrow[:, None] * sqn + qhead[:, None] * sqh + rd[None, :], mask=qmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    kbase = k_row0 * skn + hk * skh
    n_full = (tl.minimum(q_pos0 + 1, n_keys) // BLOCK_N) * BLOCK_N  # keys every tile row may see
    for j0 in range(0, n_full, BLOCK_N):
        m_i, l_i, acc = _attn_block(q, k_ptr, v_ptr, kbase, j0, n_keys, qpos, skn, rd, m_i, l_i, acc, qk_scale,
                                    BLOCK_N, UPCAST, IEEE, False)
    for j0 in range(n_full, n_keys, BLOCK_N):
        m_i, l_i, acc = _attn_block(q, k_ptr, v_ptr, kbase, j0, n_keys, qpos, skn, rd, m_i, l_i, acc, qk_scale,
                                    BLOCK_N, UPCAST, IEEE, True)
    o = acc / l_i[:, None]
    tl.store(o_ptr + qrow[:, None] * son + qhead[:, None] * soh + rd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=qmask[:, None])
    tl.store(lse_ptr + qrow * H + qhead, m_i + tl.log2(l_i), mask=qmask)  # log2 units, for the backward


LOG2E = 1.4426950408889634


def _attn_cfg(kind: str, dtype) -> dict:
    """kind: prefill | decode | bwd. Prefill and decode share BLOCK_N (the key blocks, i.e. the
    reduction order); their tile heights and warps may differ."""
    if INTERPRET:
        return dict(INTERPRET_ATTN[kind])
    if kind in ("bwd", "bwd_dq"):
        return dict(ATTN_BWD[dtype][kind])
    return dict(BLOCK_N=ATTN_FWD[dtype]["BLOCK_N"], **ATTN_FWD[dtype][kind])


def _no_fma() -> dict:
    return {} if INTERPRET else {"enable_fp_fusion": False}


def _attn_launch(q, k, v, work, scale: float, pack_heads: bool = False, cache_len: int = 0):
    """q [R, H, D]; k, v [Rk, Hk, D] -> (o, lse2 [R, H]). Prefill: work is an int32 table of items
    (q_row0, n_q, q_pos0, k_row0, n_keys); decode (pack_heads): work is the lengths [B] and sequence
    b's cache rows start at b * cache_len."""
    R, H, D = q.shape
    if D & (D - 1) or D < 16:
        raise ValueError(f"triton attention: head_dim={D} must be a power of two >= 16")
    o = torch.empty_like(q)
    lse = torch.empty(R, H, dtype=torch.float32, device=q.device)
    if work.shape[0] == 0:
        return o, lse
    cfg = _attn_cfg("decode" if pack_heads else "prefill", q.dtype)
    G = H // k.shape[1]
    if pack_heads and G > cfg["BLOCK_M"]:
        raise ValueError(f"triton attention decode: {G} query heads per kv head exceed BLOCK_M={cfg['BLOCK_M']}")
    _attn_kernel[(k.shape[1] if pack_heads else H, work.shape[0])](
        q, k, v, o, lse, work, cache_len, q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0),
        o.stride(1), scale * LOG2E, G=G, D=D, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32,
        PACK_HEADS=pack_heads, **cfg, **_no_fma())
    return o, lse


@triton.jit
def _attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, work_ptr, H, scale, qk_scale,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Program (key block, kv head): dK, dV of its keys, summed over the G query heads and the query
    blocks in order. It owns its output rows: no atomics."""
    w = tl.program_id(0)
    hk = tl.program_id(1)
    s0 = tl.load(work_ptr + w * 3)
    T = tl.load(work_ptr + w * 3 + 1)
    n0 = tl.load(work_ptr + w * 3 + 2)
    Hk = H // G
    rn = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, D)
    kmask = rn < T
    k = tl.load(k_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
    v = tl.load(v_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    for g in range(G):
        h = hk * G + g
        for m0 in range((n0 // BLOCK_M) * BLOCK_M, T, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            qmask = rm < T
            q = tl.load(q_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None], other=0.0)
            do = tl.load(do_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None],
                         other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
            delta = tl.load(delta_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
            if IEEE:
                st = tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale  # [BN, BM], log2 units
            else:
                st = tl.dot(k, tl.trans(q)) * qk_scale
            valid = kmask[:, None] & qmask[None, :] & (rn[:, None] <= rm[None, :])
            pt = tl.where(valid, tl.exp2(st - lse[None, :]), 0.0)
            if IEEE:
                dv += tl.dot(pt, do, input_precision="ieee")
                dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
            else:
                dv += tl.dot(pt.to(do.dtype), do)
                dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            if IEEE:
                dk += tl.dot(dst, q, input_precision="ieee")
            else:
                dk += tl.dot(dst.to(q.dtype), q)
    tl.store(dk_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], (dk * scale).to(dk_ptr.dtype.element_ty),
             mask=kmask[:, None])
    tl.store(dv_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=kmask[:, None])


@triton.jit
def _attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, work_ptr, scale, qk_scale,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Program (query block, head): dQ over its keys in order."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    Hk = H // G
    hk = h // G
    s0 = tl.load(work_ptr + w * 3)
    T = tl.load(work_ptr + w * 3 + 1)
    m0 = tl.load(work_ptr + w * 3 + 2)
    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D)
    qmask = rm < T
    q = tl.load(q_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None], other=0.0)
    do = tl.load(do_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
    delta = tl.load(delta_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
    dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for n0 in range(0, tl.minimum(T, m0 + BLOCK_M), BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        kmask = rn < T
        k = tl.load(k_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
            dp = tl.dot(do, tl.trans(v))
        valid = qmask[:, None] & kmask[None, :] & (rn[None, :] <= rm[:, None])
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds, k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=qmask[:, None])


@triton.jit
def _rowdot(a_ptr, b_ptr, out_ptr, R, D: tl.constexpr, ROWS: tl.constexpr):
    """out[r] = sum_d a[r, d] b[r, d] in fp32 (the backward's delta = rowsum(dO * O)); one fixed
    reduction per row, whatever the number of rows."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    m = (r < R)[:, None]
    a = tl.load(a_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, tl.sum(a * b, axis=1), mask=r < R)


class _Attention(torch.autograd.Function):
    """Forward and backward in Triton; the backward owns every output row (no atomics)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ctx.cu, ctx.scale = cu_seqlens, scale
        bm = _attn_cfg("prefill", q.dtype)["BLOCK_M"]

        def items():
            work = []
            for b in range(len(cu_seqlens) - 1):
                s0, T = cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b]
                work += [(s0 + m0, min(bm, T - m0), m0, s0, min(T, m0 + bm)) for m0 in range(0, T, bm)]
            # longest first: the last wave is the short items; rows [0, 5) keep an empty table 2-D
            return sorted(work, key=lambda t: -t[4]) or torch.zeros(0, 5).tolist(), torch.int32

        work = _table(("attn", tuple(cu_seqlens), bm), items, q.device)
        o, lse = _attn_launch(q, k, v, work, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        g = g.contiguous().to(q.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        N, H, D = q.shape
        delta = torch.empty(N, H, dtype=torch.float32, device=q.device)
        if N:
            _rowdot[(triton.cdiv(N * H, 16),)](g, o, delta, N * H, D=D, ROWS=16)
        kv_cfg, q_cfg = _attn_cfg("bwd", q.dtype), _attn_cfg("bwd_dq", q.dtype)
        bn, bm = kv_cfg["BLOCK_N"], q_cfg["BLOCK_M"]
        cu = tuple(ctx.cu)

        def items(step, key):
            def build():
                work = []
                for b in range(len(cu) - 1):
                    s0, T = cu[b], cu[b + 1] - cu[b]
                    work += [(s0, T, i0) for i0 in range(0, T, step)]
                work.sort(key=lambda t: t[2] if key == "k" else -t[2])  # the longest loops first
                return work or torch.zeros(0, 3).tolist(), torch.int32
            return build

        kw = _table(("attn_k", cu, bn), items(bn, "k"), q.device)
        qw = _table(("attn_q", cu, bm), items(bm, "q"), q.device)
        G = H // k.shape[1]
        flags = dict(G=G, D=D, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32)
        if kw.shape[0]:
            _attn_bwd_dkdv[(kw.shape[0], k.shape[1])](q, k, v, g, lse, delta, dk, dv, kw, H, ctx.scale,
                                                       ctx.scale * LOG2E, **flags, **kv_cfg)
            _attn_bwd_dq[(qw.shape[0], H)](q, k, v, g, lse, delta, dq, qw, ctx.scale, ctx.scale * LOG2E,
                                           **flags, **q_cfg)
        return dq, dk, dv, None, None


def attention_prefill(q, k, v, cu_seqlens: list[int], scale: float):
    _check("attention_prefill", q, k, v)
    return _Attention.apply(q, k, v, list(cu_seqlens), scale)


def attention_decode(q, k_cache, v_cache, lengths, scale: float):
    """One query per sequence; the same kernel and key blocks as prefill, its tile rows holding the
    GQA group's heads, so each row's bits equal the prefill row at position lengths[b] - 1."""
    _check("attention_decode", q, k_cache, v_cache)
    B, C = k_cache.shape[0], k_cache.shape[1]
    kc = k_cache.reshape(B * C, *k_cache.shape[2:])
    vc = v_cache.reshape(B * C, *v_cache.shape[2:])
    # the lengths stay on the device (no host sync): the kernel derives each item from them
    return _attn_launch(q.contiguous(), kc, vc, lengths.to(q.device), scale, pack_heads=True, cache_len=C)[0]


# --- fused elementwise ops -------------------------------------------------------------------------
_EW_BLOCK = 1024


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    tl.store(du_ptr + offs, (dy * silu).to(du_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + offs, (dy * u * (sig + silu * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=m)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _swiglu_fwd[(triton.cdiv(n, _EW_BLOCK),)](gate, up, y, n, BLOCK=_EW_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _swiglu_bwd[(triton.cdiv(n, _EW_BLOCK),)](gate, up, dy.contiguous(), dg, du, n, BLOCK=_EW_BLOCK)
        return dg, du


def swiglu(gate, up):
    """silu(gate) * up in fp32, one rounding; elementwise, so trivially row-invariant."""
    _check("swiglu", gate, up)
    return _SwiGLU.apply(gate, up)


@triton.jit
def _combine_fwd(y_ptr, w_ptr, o_ptr, K, Dm, BLOCK: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[t, j] in fp32, slot 0 first."""
    t = tl.program_id(0)
    for d0 in range(0, Dm, BLOCK):
        cols = d0 + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(K):
            wj = tl.load(w_ptr + t * K + j)
            yj = tl.load(y_ptr + (t * K + j) * Dm + cols, mask=cols < Dm, other=0.0).to(tl.float32)
            acc = acc + yj * wj
        tl.store(o_ptr + t * Dm + cols, acc.to(o_ptr.dtype.element_ty), mask=cols < Dm)


@triton.jit
def _combine_bwd(y_ptr, w_ptr, g_ptr, dy_ptr, dw_ptr, K, Dm, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    for j in range(K):
        wj = tl.load(w_ptr + t * K + j)
        part = tl.zeros((BLOCK,), dtype=tl.float32)
        for d0 in range(0, Dm, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            g = tl.load(g_ptr + t * Dm + cols, mask=cols < Dm, other=0.0).to(tl.float32)
            yj = tl.load(y_ptr + (t * K + j) * Dm + cols, mask=cols < Dm, other=0.0).to(tl.float32)
            tl.store(dy_ptr + (t * K + j) * Dm + cols, (g * wj).to(dy_ptr.dtype.element_ty), mask=cols < Dm)
            part += g * yj
        tl.store(dw_ptr + t * K + j, tl.sum(part, axis=0))


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w):
        y, w = y.contiguous(), w.float().contiguous()
        T, K, Dm = y.shape
        out = torch.empty(T, Dm, dtype=y.dtype, device=y.device)
        if T:
            _combine_fwd[(T,)](y, w, out, K, Dm, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(Dm)))
        ctx.save_for_backward(y, w)
        return out

    @staticmethod
    def backward(ctx, g):
        y, w = ctx.saved_tensors
        T, K, Dm = y.shape
        dy, dw = torch.empty_like(y), torch.empty_like(w)
        if T:
            _combine_bwd[(T,)](y, w, g.contiguous(), dy, dw, K, Dm, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(Dm)))
        return dy, dw


def moe_combine(y, weights):
    """y [T, k, D] in top-k slot order, weights [T, k] -> [T, D]: fp32, slot 0 first, per token."""
    _check("moe_combine", y)
    return _Combine.apply(y, weights)


# --- row-local ops kept on the torch reference (small [T, E] / [N, H, D] tensors) -------------------
# --- router: softmax + top-k (+ renormalise), fwd/bwd ----------------------------------------------
@triton.jit
def _route_fwd(z_ptr, w_ptr, id_ptr, E, K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """One row: fp32 softmax over the E logits, then K times the largest remaining probability (ties
    to the lowest expert id), weights renormalised over the K picks (summed in pick order)."""
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    z = tl.load(z_ptr + row * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)
    total = 0.0
    for j in tl.static_range(K):
        mx = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == mx, e, BLOCK_E), axis=0)
        tl.store(w_ptr + row * K + j, mx)
        tl.store(id_ptr + row * K + j, idx.to(tl.int64))
        total = total + mx
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        for j in tl.static_range(K):
            tl.store(w_ptr + row * K + j, tl.load(w_ptr + row * K + j) / total)


@triton.jit
def _route_bwd(z_ptr, w_ptr, id_ptr, g_ptr, dz_ptr, E, K: tl.constexpr, RENORM: tl.constexpr,
               BLOCK_E: tl.constexpr):
    """dz_e = base_e (g_e - sum_j g_j w_j), g_e the pick's gradient (0 if e was not picked) and base
    the probability p_e, or with renormalisation the renormalised weight (0 if not picked)."""
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    gsel = tl.zeros((BLOCK_E,), dtype=tl.float32)
    wsel = tl.zeros((BLOCK_E,), dtype=tl.float32)
    dot = 0.0
    for j in tl.static_range(K):
        idx = tl.load(id_ptr + row * K + j)
        gj = tl.load(g_ptr + row * K + j)
        wj = tl.load(w_ptr + row * K + j)
        gsel = tl.where(e == idx, gj, gsel)
        wsel = tl.where(e == idx, wj, wsel)
        dot = dot + gj * wj
    if RENORM:
        base = wsel
    else:
        z = tl.load(z_ptr + row * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
        p = tl.exp(z - tl.max(z, axis=0))
        base = p / tl.sum(p, axis=0)
    dz = base * (gsel - dot)
    tl.store(dz_ptr + row * E + e, dz.to(dz_ptr.dtype.element_ty), mask=e < E)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, renorm):
        T, E = logits.shape
        w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
        if T:
            _route_fwd[(T,)](logits, w, ids, E, K=k, RENORM=renorm, BLOCK_E=max(16, triton.next_power_of_2(E)))
        ctx.save_for_backward(logits, w, ids)
        ctx.renorm = renorm
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, g, _gids):
        logits, w, ids = ctx.saved_tensors
        T, E = logits.shape
        dz = torch.empty_like(logits)
        if T:
            _route_bwd[(T,)](logits, w, ids, g.float().contiguous(), dz, E, K=ids.shape[1], RENORM=ctx.renorm,
                             BLOCK_E=max(16, triton.next_power_of_2(E)))
        return dz, None, None


def moe_route(logits, top_k: int, renormalize: bool):
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]): one program per token."""
    _check("moe_route", logits)
    if not 0 < top_k <= logits.shape[-1]:
        raise ValueError(f"triton moe_route: top_k={top_k} with {logits.shape[-1]} experts")
    return _Route.apply(logits.contiguous(), int(top_k), bool(renormalize))


# --- RoPE (rotate-half), fwd/bwd ---------------------------------------------------------------------
@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, y_ptr, H, sxn, sxh, syn, syh, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 SIGN: tl.constexpr):
    """Row n, all heads: y1 = x1 c1 - SIGN x2 s1, y2 = x2 c2 + SIGN x1 s2 in fp32 (SIGN = -1: the
    transpose, i.e. the backward)."""
    n = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    m = (h < H)[:, None]
    x1 = tl.load(x_ptr + n * sxn + h[:, None] * sxh + d[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + n * sxn + h[:, None] * sxh + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + n * 2 * HALF + d)[None, :]
    c2 = tl.load(c_ptr + n * 2 * HALF + HALF + d)[None, :]
    s1 = tl.load(s_ptr + n * 2 * HALF + d)[None, :]
    s2 = tl.load(s_ptr + n * 2 * HALF + HALF + d)[None, :]
    if SIGN > 0:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    else:  # (R^T g): g1 c1 + g2 s2, g2 c2 - g1 s1
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    tl.store(y_ptr + n * syn + h[:, None] * syh + d[None, :], y1.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(y_ptr + n * syn + h[:, None] * syh + HALF + d[None, :], y2.to(y_ptr.dtype.element_ty), mask=m)


def _rope_apply(x, cos, sin, sign: int):
    N, H, D = x.shape
    if D % 2 or (D // 2) & (D // 2 - 1):
        raise ValueError(f"triton rope: head_dim={D} must be twice a power of two")
    if x.stride(2) != 1:
        x = x.contiguous()
    y = torch.empty(N, H, D, dtype=x.dtype, device=x.device)
    if N:
        _rope_kernel[(N,)](x, cos, sin, y, H, x.stride(0), x.stride(1), y.stride(0), y.stride(1), HALF=D // 2,
                           BLOCK_H=triton.next_power_of_2(H), SIGN=sign)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_apply(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rope_apply(g, cos, sin, -1), None, None


def rope(x, cos, sin):
    """x [N, H, D] rotated by rows cos/sin [N, D] (fp32) of the shared table; per row, fp32."""
    _check("rope", x)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    return _rope_apply(x, cos, sin, 1)



# --- embedding: gather forward, backward without atomics ---------------------------------------------
@triton.jit
def _embed_bwd(g_ptr, order_ptr, start_ptr, dw_ptr, D, BLOCK: tl.constexpr):
    """Program (vocab row v, column block): dW[v] = sum of the gradient rows of v's tokens, in position
    order (order = stable argsort of the tokens; v's tokens are order[start[v]:start[v+1]])."""
    v = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(start_ptr + v)
    hi = tl.load(start_ptr + v + 1)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(lo, hi):
        r = tl.load(order_ptr + i)
        acc = acc + tl.load(g_ptr + r * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(dw_ptr + v * D + cols, acc.to(dw_ptr.dtype.element_ty), mask=cols < D)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, tokens):
        ctx.save_for_backward(tokens)
        ctx.vocab, ctx.wdtype = weight.shape[0], weight.dtype
        return weight[tokens]

    @staticmethod
    def backward(ctx, g):
        (tokens,) = ctx.saved_tensors
        V, D = ctx.vocab, g.shape[-1]
        flat = tokens.reshape(-1)
        g = g.reshape(-1, D).contiguous()
        order = torch.argsort(flat, stable=True)
        # start[v] = how many tokens are < v: searchsorted over the sorted tokens (no host sync)
        start = torch.searchsorted(flat[order], torch.arange(V + 1, device=flat.device, dtype=flat.dtype))
        dw = torch.empty(V, D, dtype=ctx.wdtype, device=g.device)
        if V and D:
            _embed_bwd[(V, triton.cdiv(D, 256))](g, order, start, dw, D, BLOCK=256)
        return dw, None


def embedding(weight, tokens):
    _check("embedding", weight)
    if torch.is_grad_enabled() and weight.requires_grad:
        return _Embedding.apply(weight, tokens)
    return weight[tokens]
