"""RMSNorm (and the residual add fused into it): the forward reads each row once, several rows per
program when D is small (a count fixed by D); the weight gradient goes through private per-program
partial sums, then one ordered column sum (no atomics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ROW_BLOCK, Launch, cached, check_inputs


@triton.jit(do_not_specialize=["R"])
def rmsnorm_fwd_kernel(x_ptr, a_ptr, w_ptr, y_ptr, s_ptr, r_ptr, R, D, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                       RESID: tl.constexpr):
    """y = rmsnorm(x) of rows [p*ROWS, (p+1)*ROWS), each row read once and kept in registers; RESID: of
    s = x + a (rounded to the dtype, as a separate add), s stored. A row's sum of squares is the tile's
    reduction along its columns: the same order for every row of every launch (ROWS, BLOCK and the
    warps are a function of D alone), so a row's bits never depend on R or on the other rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0)
    if RESID:
        x = (x.to(tl.float32) + tl.load(a_ptr + off, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + off, x, mask=m)
    x = x.to(tl.float32)
    rstd = row_rstd(x, D, eps)  # [ROWS]
    tl.store(r_ptr + rows, rstd, mask=rows < R)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    tl.store(y_ptr + off, normed(x, rstd, w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def row_rstd(x, D, eps):
    """1 / sqrt(mean(x^2) + eps) of each row of the fp32 tile x [ROWS, BLOCK] (columns past D zero): the
    tile's reduction along its columns, whose order the tile's shape and warps fix (fwd_config)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)


@triton.jit
def normed(x, rstd, w):
    """The norm's output in fp32 before its store's rounding, as the reference: normalise, round to w's
    dtype, then scale (the product of two dtype values is exact in fp32, so one rounding at the store
    matches a dtype multiply). x [ROWS, C] fp32, rstd [ROWS], w [C]."""
    return (x * rstd[:, None]).to(w.dtype).to(tl.float32) * w.to(tl.float32)[None, :]


@triton.jit(do_not_specialize=["R"])
def _rmsnorm_bwd(x_ptr, w_ptr, g_ptr, r_ptr, c_ptr, dx_ptr, pw_ptr, gs_ptr, R, D, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, RESID: tl.constexpr):
    """Program p: dx for rows [p*ROWS, (p+1)*ROWS) and its private partial of dw (no atomics), summed
    over its rows in order in registers, one column chunk at a time. RESID: dx rounded to its dtype plus
    gs (the residual stream's gradient of the same rows), rounded again: autograd's sum of the two."""
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
            dx = (g * w * rstd - x * c).to(dx_ptr.dtype.element_ty)
            if RESID:
                dx = (dx.to(tl.float32) + tl.load(gs_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)).to(
                    dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + row * D + cols, dx, mask=m)
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


_FWD_TILE = 4096  # elements per forward program: rows of D <= 2048 share a program, whole rows each


def fwd_config(D: int) -> dict:
    """The forward's launch constants, a function of D alone (they fix each row's reduction order):
    the row whole in one block of next_power_of_2(D) columns, as many rows per program as fill
    _FWD_TILE elements, 4 warps per 2048 elements of the tile (16 at most)."""
    block = triton.next_power_of_2(D)
    rows = max(1, _FWD_TILE // block)
    return dict(ROWS=rows, BLOCK=block, num_warps=min(16, max(4, rows * block // 512)))


def _plan_fwd(R: int, D: int, eps: float, resid: bool) -> Launch:
    cfg = fwd_config(D)
    return Launch(rmsnorm_fwd_kernel, (triton.cdiv(R, cfg["ROWS"]),), (R, D, eps), dict(cfg, RESID=resid))


def _forward(x2, w, eps, a=None):
    """(y, rstd, s): s = x2 + a when a is given (else x2), y = rmsnorm(s)."""
    R, D = x2.shape
    y = torch.empty_like(x2)
    s = x2 if a is None else torch.empty_like(x2)
    rstd = torch.empty(R, dtype=torch.float32, device=x2.device)
    if R:
        cached(("rmsnorm", R, D, eps, x2.dtype, a is not None), lambda: _plan_fwd(R, D, eps, a is not None))(
            x2, x2 if a is None else a, w if w.dtype == x2.dtype else w.to(x2.dtype), y, s, rstd)
    return y, rstd, s


def _backward(s, w, rstd, g, gs):
    """(ds, dw) of y = rmsnorm(s); gs (or None): the gradient s receives besides the norm's, added."""
    R, D = s.shape
    dx = torch.empty_like(s)
    progs = triton.cdiv(R, _NORM_ROWS)
    partial = torch.empty(max(progs, 1), D, dtype=torch.float32, device=s.device)
    if R:
        cbuf = torch.empty(R, dtype=torch.float32, device=s.device)
        g = g.contiguous()
        gs = g if gs is None else gs.contiguous().to(s.dtype)
        key = ("rmsnorm_bwd", R, D, s.dtype, g.dtype, gs is not g)
        cached(key, lambda: Launch(_rmsnorm_bwd, (progs,), (R, D), dict(
            ROWS=_NORM_ROWS, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(D)), RESID=gs is not g)))(
            s, w.float(), g, rstd, cbuf, dx, partial, gs)
    else:
        partial.zero_()
    return dx, _colsum(partial).to(w.dtype)  # one ordered reduction of the private partials


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, eps):
        y, rstd, _ = _forward(x2, w, eps)
        ctx.save_for_backward(x2, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x2, w, rstd = ctx.saved_tensors
        dx, dw = _backward(x2, w, rstd, g, None)
        return dx, dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, a, w, eps):
        y, rstd, s = _forward(h, w, eps, a)
        ctx.save_for_backward(s, w, rstd)
        ctx.set_materialize_grads(False)  # s unused downstream: its gradient is the norm's alone
        return s, y

    @staticmethod
    def backward(ctx, gs, g):
        s, w, rstd = ctx.saved_tensors
        if g is None:
            g = torch.zeros_like(s)
        ds, dw = _backward(s, w, rstd, g, gs)
        return ds, ds, dw, None


def _rows2(x):
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


def rmsnorm(x, w, eps: float):
    check_inputs("rmsnorm", x, w)
    x2 = _rows2(x)
    if torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        y = _RMSNorm.apply(x2, w, eps)
    else:  # no graph to record: the same kernel without autograd's bookkeeping
        y = _forward(x2, w, eps)[0]
    return y if x2 is x else y.reshape(x.shape)


def add_rmsnorm(h, a, w, eps: float):
    """(s, rmsnorm(s, w, eps)) with s = h + a (the residual add, rounded to the dtype): one pass; the same
    bits as the add and the norm apart, forward and backward (the norm's input gradient and the residual
    stream's summed as autograd sums them)."""
    check_inputs("add_rmsnorm", h, a, w)
    if h.shape != a.shape or h.dtype != a.dtype:
        raise ValueError(f"triton add_rmsnorm: h {tuple(h.shape)} {h.dtype} and a {tuple(a.shape)} {a.dtype} differ")
    h2, a2 = _rows2(h), _rows2(a)
    if torch.is_grad_enabled() and (h2.requires_grad or a2.requires_grad or w.requires_grad):
        s, y = _AddRMSNorm.apply(h2, a2, w, eps)
    else:
        y, _, s = _forward(h2, w, eps, a2)
    return s.view(h.shape), y.view(h.shape)
