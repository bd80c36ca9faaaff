"""RMSNorm: one program per row; the weight gradient goes through private per-program partial
sums, then one ordered column sum (no atomics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ROW_BLOCK, Launch, cached, check_inputs


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


@triton.jit(do_not_specialize=["R"])
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
_COLSUM_CHUNK = 32  # partial rows per program of one pass of the column sum
_COLSUM_BLOCK = 128  # columns per program


@triton.jit(do_not_specialize=["P"])
def _colsum_kernel(x_ptr, out_ptr, P, D, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (column block, chunk c): out[c, d] = x[c*CHUNK, d] + x[c*CHUNK + 1, d] + ... over the
    chunk's rows below P, in that order (fp32; rows past P are not read)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    first = tl.program_id(1) * CHUNK
    n = tl.minimum(P - first, CHUNK)
    acc = tl.load(x_ptr + first * D + cols, mask=cols < D, other=0.0)
    for i in range(1, n):
        acc = acc + tl.load(x_ptr + (first + i) * D + cols, mask=cols < D, other=0.0)
    tl.store(out_ptr + tl.program_id(1) * D + cols, acc, mask=cols < D)


def _colsum(x: torch.Tensor) -> torch.Tensor:
    """Column sums of the fp32 partials x [P >= 1, D] in a fixed order that depends on P alone: rows
    summed in order within consecutive chunks of _COLSUM_CHUNK, then the chunk sums the same way,
    until one row is left (a chunked tree, one pass per level: every pass runs cdiv(P, CHUNK)
    column-block programs in parallel instead of one program walking all P rows)."""
    x = x.contiguous()
    P, D = x.shape
    while P > 1:
        n = triton.cdiv(P, _COLSUM_CHUNK)
        out = torch.empty(n, D, dtype=torch.float32, device=x.device)
        cached(("colsum", P, D), lambda P=P, n=n: Launch(
            _colsum_kernel, (triton.cdiv(D, _COLSUM_BLOCK), n), (P, D),
            dict(CHUNK=_COLSUM_CHUNK, BLOCK=_COLSUM_BLOCK)))(x, out)
        x, P = out, n
    return x.reshape(D)


def _plan_fwd(R: int, D: int, eps: float) -> Launch:
    return Launch(_rmsnorm_fwd, (R,), (D, eps), dict(BLOCK=min(ROW_BLOCK, triton.next_power_of_2(D))))


def _forward(x2, w, eps):
    R, D = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(R, dtype=torch.float32, device=x2.device)
    if R:
        cached(("rmsnorm", R, D, eps, x2.dtype), lambda: _plan_fwd(R, D, eps))(
            x2, w if w.dtype == x2.dtype else w.to(x2.dtype), y, rstd)
    return y, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, eps):
        y, rstd = _forward(x2, w, eps)
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
            g = g.contiguous()
            key = ("rmsnorm_bwd", R, D, x2.dtype, g.dtype)
            cached(key, lambda: Launch(_rmsnorm_bwd, (progs,), (R, D), dict(
                ROWS=_NORM_ROWS, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(D)))))(
                x2, w.float(), g, rstd, cbuf, dx, partial)
        else:
            partial.zero_()
        dw = _colsum(partial)  # one ordered reduction of the private partials
        return dx, dw.to(w.dtype), None


def rmsnorm(x, w, eps: float):
    check_inputs("rmsnorm", x, w)
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    if torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        y = _RMSNorm.apply(x2, w, eps)
    else:  # no graph to record: the same kernel without autograd's bookkeeping
        y = _forward(x2, w, eps)[0]
    return y if x2 is x else y.reshape(x.shape)

