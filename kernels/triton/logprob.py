"""Token logprobs: one program per row: max, sum of exp and the gather over the vocabulary in
fixed BLOCK_V chunks; backward per row. The trainer's form (logprob_rows) scores the selected rows of
the model's logits and its backward writes the logits' gradient in their dtype directly (no fp32
gradient of the rows, no index_put)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlalign.kernels.sampling import apply_cut as apply_cut_values
from rlalign.kernels.sampling import temper

from .common import ROW_BLOCK, Launch, apply_cut, bf16_bits, cached, check_inputs, upcast_scaled


@triton.jit
def row_lse(z_ptr, row, V, mx, scale, SCALED: tl.constexpr, BLOCK: tl.constexpr, cut,
            CUT: tl.constexpr):
    """log sum exp of row `row` of z [*, V] (upcast_scaled's fp32 values) given the row's max mx: exp(z - mx)
    summed in BLOCK chunks in order, then one reduction. The loads hold 4 elements a thread whatever the dtype
    (max_contiguous): the layout of the sums, and so their grouping, is the fp32 load's (a bf16 load would take
    8 and sum in another order). The one sum of the trainer's logprob and the sampler's draw-and-logprob.
    CUT: the values filtered by the row's cut (common.apply_cut) as loaded: the filtered copy's values, the
    same loads and sums."""
    offs = tl.max_contiguous(tl.arange(0, BLOCK), 4)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        z = upcast_scaled(tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf")), scale, SCALED)
        if CUT:
            z = apply_cut(z, cut)
        s += tl.exp(z - mx)
    return mx + tl.log(tl.sum(s, axis=0))


@triton.jit
def _logprob_fwd(z_ptr, t_ptr, out_ptr, lse_ptr, rows_ptr, cut_ptr, scale, V, BLOCK: tl.constexpr,
                 SCALED: tl.constexpr, ROWS: tl.constexpr, CUT: tl.constexpr):
    """Output i: row i of z, or (ROWS) row rows[i]; z: the logits in any float dtype, read as upcast_scaled's
    fp32 values; the max's loads hold 4 elements a thread as row_lse's do. CUT: those values filtered by the
    cut of the row read (cut [rows of z], common.apply_cut) at every load."""
    i = tl.program_id(0)
    if ROWS:
        row = tl.load(rows_ptr + i)
    else:
        row = i
    cut = tl.zeros((), tl.int64)
    if CUT:
        cut = tl.load(cut_ptr + row)
    offs = tl.max_contiguous(tl.arange(0, BLOCK), 4)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        z = upcast_scaled(tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf")), scale, SCALED)
        if CUT:
            z = apply_cut(z, cut)
        m = tl.maximum(m, z)
    lse = row_lse(z_ptr, row, V, tl.max(m, axis=0), scale, SCALED, BLOCK, cut, CUT)
    tok = tl.load(t_ptr + i)
    zt = upcast_scaled(tl.load(z_ptr + row * V + tok), scale, SCALED)
    if CUT:
        zt = apply_cut(zt, cut)
    tl.store(out_ptr + i, zt - lse)
    tl.store(lse_ptr + i, lse)


@triton.jit
def _logprob_bwd(z_ptr, t_ptr, lse_ptr, g_ptr, dz_ptr, rows_ptr, V, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                 BF16: tl.constexpr):
    """dz of output i (fp32), or (ROWS) row rows[i] of dz in dz's dtype from the fp32 value: rounded, then
    zeros made +0 (the bits of .to(dtype) and an index_put accumulating into zeros)."""
    i = tl.program_id(0)
    if ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    lse = tl.load(lse_ptr + i)
    g = tl.load(g_ptr + i)
    tok = tl.load(t_ptr + i)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        d = g * (tl.where(cols == tok, 1.0, 0.0) - tl.exp(z - lse))
        if BF16:  # dz: the bf16 tensor's bits (uint16), rounded as .to(bfloat16), -0 -> +0
            r = bf16_bits(d)
            tl.store(dz_ptr + row * V + cols, tl.where(r == 0x8000, 0, r).to(tl.uint16), mask=cols < V)
        elif ROWS:
            d = (d.to(dz_ptr.dtype.element_ty).to(tl.float32) + 0.0).to(dz_ptr.dtype.element_ty)
            tl.store(dz_ptr + row * V + cols, d, mask=cols < V)
        else:
            tl.store(dz_ptr + row * V + cols, d, mask=cols < V)


def _forward(z, tokens, scale=1.0, rows=None, cut=None):
    """(log p(tokens), lse) [N] fp32 of temper(z, scale) for z [N, V] contiguous in any float dtype, or of
    its rows `rows` [N] (read in place); with cut (int64 [rows of z]), of those values filtered by it
    (rlalign.kernels.sampling.apply_cut)."""
    N, V = (z.shape[0] if rows is None else rows.shape[0]), z.shape[1]
    out = torch.empty(N, dtype=torch.float32, device=z.device)
    lse = torch.empty(N, dtype=torch.float32, device=z.device)
    if N:
        key = ("logprob", N, V, z.dtype, tokens.dtype, scale, None if rows is None else rows.dtype, cut is None)
        cached(key, lambda: Launch(_logprob_fwd, (N,), (scale, V), dict(
            BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), SCALED=scale != 1.0, ROWS=rows is not None,
            CUT=cut is not None)))(
            z, tokens, out, lse, tokens if rows is None else rows, tokens if cut is None else cut)
    return out, lse


class _LogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, tokens):
        out, lse = _forward(z, tokens)
        ctx.save_for_backward(z, tokens, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        z, tokens, lse = ctx.saved_tensors
        dz = torch.empty_like(z)
        N, V = z.shape
        if N:
            cached(("logprob_bwd", N, V, tokens.dtype), lambda: Launch(
                _logprob_bwd, (N,), (V,), dict(BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), ROWS=False,
                                               BF16=False)))(
                z, tokens, lse, g.contiguous().float(), dz, tokens)
        return dz, None


def log_softmax_gather(z, tokens):
    """z [N, V] fp32 (tempered/filtered) -> log p(tokens) [N] fp32, one program per row."""
    check_inputs("log_softmax_gather", z)
    z, tokens = z.float().contiguous(), tokens.contiguous()
    if torch.is_grad_enabled() and z.requires_grad:
        return _LogProb.apply(z, tokens)
    return _forward(z, tokens)[0]


def tempered_logprobs(logits, scale, tokens, cut=None):
    """log_softmax_gather(rlalign.kernels.temper(logits, scale), tokens), the same bits, reading logits
    [N, V] (any float dtype) in place: no fp32 copy, no pass for the temperature; with cut (int64 [N], a
    top-k/top-p filter's), of those values filtered by it (sampling.apply_cut: the filtered copy's bits).
    With a gradient to compute, the composition itself (its backward is torch's and log_softmax_gather's)."""
    check_inputs("tempered_logprobs", logits)
    if torch.is_grad_enabled() and logits.requires_grad:
        v = temper(logits, scale)
        return log_softmax_gather(v if cut is None else apply_cut_values(v, cut), tokens)
    return _forward(logits.contiguous(), tokens.contiguous(), scale,
                    cut=None if cut is None else cut.contiguous())[0]


class _LogProbRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, tokens):
        out, lse = _forward(logits, tokens, rows=rows)  # the rows read in place
        ctx.save_for_backward(logits, rows, tokens, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        logits, rows, tokens, lse = ctx.saved_tensors
        N, V = rows.shape[0], logits.shape[1]
        dz = torch.zeros_like(logits)  # rows never selected: zero gradient
        bf16 = dz.dtype == torch.bfloat16
        if N:
            cached(("logprob_rows_bwd", N, V, logits.dtype, rows.dtype, tokens.dtype), lambda: Launch(
                _logprob_bwd, (N,), (V,), dict(BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), ROWS=True,
                                               BF16=bf16)))(
                logits, tokens, lse, g.contiguous().float(), dz.view(torch.uint16) if bf16 else dz, rows)
        return dz, None, None


def logprob_rows(logits, rows, tokens):
    """log_softmax_gather(logits[rows].float(), tokens), the same bits: logits [N, V] (contiguous, any
    float dtype), rows [n] distinct row indices, tokens [n]. Backward: one launch writes the logits'
    gradient in their dtype, reading the rows in place, zero outside `rows` (the bits of the gather's
    index_put and the .float()'s rounding it replaces), instead of an fp32 gradient of the rows, its
    rounded copy and a sorting index_put into zeros."""
    check_inputs("logprob_rows", logits)
    if logits.dim() != 2 or rows.dim() != 1 or tokens.shape != rows.shape:
        raise ValueError(f"triton logprob_rows: logits {tuple(logits.shape)}, rows {tuple(rows.shape)} and tokens "
                         f"{tuple(tokens.shape)} do not fit")
    # 16-byte aligned index tensors (split views of one host copy often are not): one compiled variant
    rows, tokens = (t.contiguous() if t.data_ptr() % 16 == 0 else t.clone() for t in (rows, tokens))
    logits = logits.contiguous()
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogProbRows.apply(logits, rows, tokens)
    return _forward(logits, tokens, rows=rows)[0]
