"""MoE row-local kernels: the router (fp32 softmax + top-k, ties to the lowest expert id) and the
combine (fp32, top-k slot 0 first), forward and backward, one program per token; the experts' first
GEMM reading the token rows in place (moe_slot_linear; moe_slot_swiglu with the SwiGLU in its epilogue)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ROW_BLOCK, Launch, cached, check_inputs
from .elementwise import swiglu_halves
from .gemm import grouped_mm, grouped_wgrad


@triton.jit
def _combine_fwd(y_ptr, w_ptr, o_ptr, rows_ptr, Dm, K: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """out[t, chunk] = sum_j w[t, j] * y[t, j, chunk] in fp32, slot 0 first; program (t, chunk of BLOCK
    columns): elementwise along the row, so the chunking never changes a bit. ROWS: y[t, j] is row
    rows[t * K + j] of y [R, Dm] (the expert outputs in dispatch order, read in place). K is unrolled:
    the K row indices and rows are loaded together, not one slot's after the other's."""
    t = tl.program_id(0).to(tl.int64)  # (t * K + j) * Dm passes 2**31 for large token counts
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + t * K + j)
        if ROWS:
            row = tl.load(rows_ptr + t * K + j)
        else:
            row = t * K + j
        yj = tl.load(y_ptr + row * Dm + cols, mask=cols < Dm, other=0.0).to(tl.float32)
        acc = acc + yj * wj
    tl.store(o_ptr + t * Dm + cols, acc.to(o_ptr.dtype.element_ty), mask=cols < Dm)


_COMBINE_BLOCK = 512  # columns per forward program (2 warps, 16-byte loads): a decode step's few tokens
# still spread over every SM (one program per token walking its row left most SMs idle)


@triton.jit
def _combine_bwd(y_ptr, w_ptr, g_ptr, dy_ptr, dw_ptr, rows_ptr, K, Dm, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """dy[t, j] = g[t] w[t, j] (rounded to dy's dtype), dw[t, j] = sum_d g[t] y[t, j] in fp32. ROWS: slot
    (t, j) is row rows[t * K + j] of y and of dy [R, Dm] (rows a permutation: every dy row written once),
    and dy's zeros are +0, as the gathered copy's backward (an index_put accumulating into zeros) gives."""
    t = tl.program_id(0).to(tl.int64)
    for j in range(K):
        wj = tl.load(w_ptr + t * K + j)
        if ROWS:
            row = tl.load(rows_ptr + t * K + j)
        else:
            row = t * K + j
        part = tl.zeros((BLOCK,), dtype=tl.float32)
        for d0 in range(0, Dm, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            g = tl.load(g_ptr + t * Dm + cols, mask=cols < Dm, other=0.0).to(tl.float32)
            yj = tl.load(y_ptr + row * Dm + cols, mask=cols < Dm, other=0.0).to(tl.float32)
            d = (g * wj).to(dy_ptr.dtype.element_ty)
            if ROWS:
                d = (d.to(tl.float32) + 0.0).to(dy_ptr.dtype.element_ty)
            tl.store(dy_ptr + row * Dm + cols, d, mask=cols < Dm)
            part += g * yj
        tl.store(dw_ptr + t * K + j, tl.sum(part, axis=0))


def _combine(y, w, rows=None):
    """(y, w, out) as the kernel read them: y [T, K, Dm], or y [R, Dm] read through rows [T * K]."""
    y, w = y.contiguous(), w.float().contiguous()
    (T, K), Dm = w.shape, y.shape[-1]
    out = torch.empty(T, Dm, dtype=y.dtype, device=y.device)
    if T:
        rows = w if rows is None else rows.contiguous()  # the pointer slot, unread without ROWS
        block = min(_COMBINE_BLOCK, triton.next_power_of_2(Dm))
        cached(("combine", T, K, Dm, y.dtype, rows.dtype, rows is w, block), lambda: Launch(
            _combine_fwd, (T, triton.cdiv(Dm, block)), (Dm,), dict(K=K, BLOCK=block, ROWS=rows is not w,
                                                                       num_warps=2)))(
            y, w, out, rows)
    return y, w, out


class _Combine(torch.autograd.Function):
    """moe_combine of y [T, K, Dm], or (rows given) of y [T * K, Dm] read through the permutation rows."""

    @staticmethod
    def forward(ctx, y, w, rows):
        y, w, out = _combine(y, w, rows)
        ctx.save_for_backward(y, w, rows if rows is not None else w)
        ctx.has_rows = rows is not None
        return out

    @staticmethod
    def backward(ctx, g):
        y, w, rows = ctx.saved_tensors
        (T, K), Dm = w.shape, y.shape[-1]
        dy, dw = torch.empty_like(y), torch.empty_like(w)
        if T:
            g = g.contiguous()
            cached(("combine_bwd", T, K, Dm, y.dtype, g.dtype, rows.dtype, ctx.has_rows), lambda: Launch(
                _combine_bwd, (T,), (K, Dm), dict(BLOCK=min(ROW_BLOCK, triton.next_power_of_2(Dm)),
                                                  ROWS=ctx.has_rows)))(y, w, g, dy, dw, rows)
        return dy, dw, None


def moe_combine_rows(y, weights, rows):
    """moe_combine(y[rows].view(T, k, D), weights) without the gathered copy, forward and backward (the
    same kernel bodies: the same bits). rows [T * k] is a permutation of y's T * k rows (dispatch's
    `dest`): the backward writes each row of dy once."""
    T, K = weights.shape
    check_inputs("moe_combine", y)
    if rows.shape != (T * K,) or y.dim() != 2:
        raise ValueError(f"triton moe_combine: rows {tuple(rows.shape)} and y {tuple(y.shape)} do not fit "
                         f"weights {tuple(weights.shape)}")
    if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
        if y.shape[0] != T * K:
            raise ValueError(f"triton moe_combine: y has {y.shape[0]} rows, rows permute {T * K}")
        return _Combine.apply(y, weights, rows.contiguous())
    return _combine(y, weights, rows)[2]


def moe_combine(y, weights):
    """y [T, k, D] in top-k slot order, weights [T, k] -> [T, D]: fp32, slot 0 first, per token."""
    check_inputs("moe_combine", y)
    if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
        return _Combine.apply(y, weights, None)
    return _combine(y, weights)[2]


# --- router: softmax + top-k (+ renormalise), fwd/bwd ----------------------------------------------
@triton.jit
def _route_fwd(z_ptr, w_ptr, id_ptr, E, K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """One row: fp32 softmax over the E logits, then K times the largest remaining probability (ties
    to the lowest expert id), weights renormalised over the K picks (summed in pick order). A pick is
    one max over int64 keys (the probability's bits above, BLOCK_E - 1 - id below: probabilities are
    >= +0 and the padding -1, so the keys order as (probability, -id)). A row with NaN or infinite
    logits (a NaN sum) gets K times the pick of a max-then-lowest-id search over its probabilities
    (weight max(p), id E: no expert), which removes nothing."""
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    z = tl.load(z_ptr + row * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.max(z, axis=0))
    s = tl.sum(p, axis=0)
    p = p / s
    p = tl.where(e < E, p, -1.0)
    keys = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    bad = s != s
    nan_pick = s
    nan_id = E
    if bad:
        nan_pick = tl.max(p, axis=0)
        nan_id = tl.min(tl.where(p == nan_pick, e, BLOCK_E), axis=0)
    slot = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(K):
        key = tl.max(keys, axis=0)
        hi = key >> 32
        idx = BLOCK_E - 1 - (key - (hi << 32))
        keys = tl.where(e == idx, -(1 << 62), keys)
        mx = tl.where(bad, nan_pick, hi.to(tl.int32).to(tl.float32, bitcast=True))
        idx = tl.where(bad, nan_id, idx)
        w = tl.where(slot == j, mx, w)
        ids = tl.where(slot == j, idx, ids)
        total = total + mx
    if RENORM:
        w = w / total
    tl.store(w_ptr + row * K + slot, w, mask=slot < K)
    tl.store(id_ptr + row * K + slot, ids, mask=slot < K)


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


def route_warps(block_e: int) -> int:
    """Warps of a router program: one logit per thread and no copied warps (64 experts: 2), up to 4.
    A sum's order is set by the distinct values per thread and per warp: the order 4 warps give (they
    hold a 64-expert row twice)."""
    return max(1, min(4, block_e // 32))


def _route(logits, k, renorm):
    T, E = logits.shape
    block_e = max(16, triton.next_power_of_2(E))
    warps = route_warps(block_e)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        cached(("route", T, E, k, renorm, logits.dtype, warps), lambda: Launch(
            _route_fwd, (T,), (E,), dict(K=k, RENORM=renorm, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
                                         num_warps=warps)))(logits, w, ids)
    return w, ids


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, renorm):
        w, ids = _route(logits, k, renorm)
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
            k, renorm = ids.shape[1], ctx.renorm
            cached(("route_bwd", T, E, k, renorm, logits.dtype), lambda: Launch(
                _route_bwd, (T,), (E,), dict(K=k, RENORM=renorm, BLOCK_E=max(16, triton.next_power_of_2(E)))))(
                logits, w, ids, g.float().contiguous(), dz)
        return dz, None, None


def moe_route(logits, top_k: int, renormalize: bool):
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]): one program per token."""
    check_inputs("moe_route", logits)
    if not 0 < top_k <= logits.shape[-1]:
        raise ValueError(f"triton moe_route: top_k={top_k} with {logits.shape[-1]} experts")
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Route.apply(logits.contiguous(), int(top_k), bool(renormalize))
    return _route(logits.contiguous(), int(top_k), bool(renormalize))


# --- the experts' first GEMM over the token rows, read in place -----------------------------------
class _SlotLinear(torch.autograd.Function):
    """grouped_linear(x[order // k], w, counts), the forward reading x's rows in place
    (GATHER; the [T * k, D] copy is made in the backward, for dW, instead of kept from the forward); dX:
    the sorted rows' gradients, then each token's k slots summed as moe_combine with unit weights (fp32,
    slot 0 first), read through dest: kernels.moe_slot_rows' backward."""

    @staticmethod
    def forward(ctx, x, w, counts, order, dest, k):
        ctx.save_for_backward(x, w, counts, order, dest)
        ctx.k = k
        return grouped_mm(x, w, counts, order, k)

    @staticmethod
    def backward(ctx, g):
        x, w, counts, order, dest = ctx.saved_tensors
        g = g.contiguous().to(x.dtype)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            ones = torch.ones(x.shape[0], ctx.k, dtype=torch.float32, device=x.device)
            gx = _combine(grouped_mm(g, w.transpose(1, 2), counts), ones, dest)[2]
        if ctx.needs_input_grad[1]:
            rows = torch.div(order, ctx.k, rounding_mode="floor")
            gw = grouped_wgrad(g, x.index_select(0, rows), counts).to(w.dtype)
        return gx, gw, None, None, None, None


def _slot_args(x, order, dest, k: int, w, counts: torch.Tensor):
    """(x, w, order) of moe_slot_linear checked and made readable in place."""
    check_inputs("moe_slot_linear", x, w)
    T = x.shape[0]
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or order.shape != (T * k,) \
            or dest.shape != (T * k,) or counts.shape != (w.shape[0],) or counts.device != x.device:
        raise ValueError(f"triton moe_slot_linear: x {tuple(x.shape)}, w {tuple(w.shape)}, k {k}, order "
                         f"{tuple(order.shape)}, dest {tuple(dest.shape)}, counts {tuple(counts.shape)} do not fit")
    return x.contiguous(), w.to(x.dtype), order.contiguous()


def moe_slot_linear(x, order, dest, k: int, w, counts: torch.Tensor):
    """grouped_linear(moe_slot_rows(x, order, dest, k), w, counts), the same bits; the forward reads x's rows
    in place, the [T * k, D] copy lives only in the backward (not from forward to backward). counts: a tensor
    on x's device."""
    x, w, order = _slot_args(x, order, dest, k, w, counts)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _SlotLinear.apply(x, w, counts, order, dest.contiguous(), int(k))
    return grouped_mm(x, w, counts, order, int(k))  # token order[i] // k, divided in the kernel: no launch


def moe_slot_swiglu(x, order, dest, k: int, w, counts: torch.Tensor):
    """swiglu_halves(moe_slot_linear(x, order, dest, k, w, counts)) (w [E, 2I, D]: gate | up) -> [T * k, I], the
    same bits; without a gradient ONE launch that never writes the [T * k, 2I] product (grouped_mm's swiglu), with
    one the two ops (their backward needs the product). Measured: experiments/README.md, History."""
    x, w, order = _slot_args(x, order, dest, k, w, counts)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return swiglu_halves(_SlotLinear.apply(x, w, counts, order, dest.contiguous(), int(k)))
    return grouped_mm(x, w, counts, order, int(k), swiglu=True)
