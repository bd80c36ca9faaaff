"""AdamW's elementwise update of one fp32 tensor in one launch (kernels.adamw_): the definition of
kernels/torch_deterministic.adamw_, every operation rounded on its own (fp contraction off, IEEE
square root and division), so the bits equal the torch ops on any device and under the interpreter;
optionally the updated weight rounded into the compute-dtype model in the same pass. The step's
scalars come from a small fp32 device tensor (one compiled kernel and one launch plan for every step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, Launch, bf16_bits, cached

_BLOCK = 2048


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, s_ptr, o_ptr, n, OUT: tl.constexpr, BLOCK: tl.constexpr):
    """s: coef, decay, w1, beta2, a2, inv_bc2, eps, neg_step (kernels.torch_deterministic.adamw_).
    OUT: 0 none, 1 o = p in o's dtype, 2 o = p's bf16 bits (o an int16 view)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    coef, decay = tl.load(s_ptr), tl.load(s_ptr + 1)
    w1, beta2, a2 = tl.load(s_ptr + 2), tl.load(s_ptr + 3), tl.load(s_ptr + 4)
    inv_bc2, eps, neg_step = tl.load(s_ptr + 5), tl.load(s_ptr + 6), tl.load(s_ptr + 7)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0) * coef
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + w1 * (g - m)
    v = v * beta2 + a2 * (g * g)
    denom = tl.sqrt_rn(v) * inv_bc2 + eps
    p = p + neg_step * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if OUT == 1:
        tl.store(o_ptr + offs, p.to(o_ptr.dtype.element_ty), mask=mask)
    if OUT == 2:  # bf16 through its bits (under the interpreter too)
        tl.store(o_ptr + offs, bf16_bits(p).to(tl.uint16), mask=mask)


def adamw_(p, g, m, v, scalars: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """p, m, v (fp32, contiguous, one shape) updated in place from gradient g; scalars: fp32 [8] on
    their device (kernels.adamw_); out (optional): p's new value in out's dtype (the model's weight)."""
    for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != p.shape or t.device != p.device:
            raise ValueError(f"triton adamw_: {name} {tuple(t.shape)} {t.dtype} (contiguous {t.is_contiguous()}) "
                             f"on {t.device} does not fit the fp32 contiguous param {tuple(p.shape)} on {p.device}")
    if scalars.dtype != torch.float32 or scalars.shape != (8,) or scalars.device != p.device:
        raise ValueError(f"triton adamw_: scalars {tuple(scalars.shape)} {scalars.dtype} on {scalars.device}: "
                         f"expected fp32 [8] on {p.device}")
    if out is not None and (out.shape != p.shape or not out.is_contiguous() or out.device != p.device):
        raise ValueError(f"triton adamw_: out {tuple(out.shape)} (contiguous {out.is_contiguous()}) does not fit "
                         f"param {tuple(p.shape)}")
    n = p.numel()
    if n == 0:
        return
    # fp contraction off: a * b + c stays two roundings, as the torch ops (the interpreter never contracts)
    opts = {} if INTERPRET else dict(enable_fp_fusion=False)
    kind = 0 if out is None else 2 if out.dtype == torch.bfloat16 else 1
    cached(("adamw", n, kind), lambda: Launch(
        _adamw_kernel, (triton.cdiv(n, _BLOCK),), (n,), dict(OUT=kind, BLOCK=_BLOCK, **opts)))(
        p, g, m, v, scalars, p if out is None else out.view(torch.uint16) if kind == 2 else out)


@triton.jit
def _square_levels(x_ptr, y_ptr, n, sx, Q, BLOCK: tl.constexpr):
    """y[r, i] for i < Q: the first four levels of the halving tree (fixed_order.tree_sum) over the
    squares of row r of x (n elements, zero-padded to P = 16 Q): the squares of elements i + j Q,
    j = 0..15, paired (j, j + 8), then (j, j + 4), (j, j + 2), (j, j + 1). Elementwise only (no
    reduction whose grouping a layout could change); fp contraction off at the launch."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = tl.program_id(1).to(tl.int64)
    base = x_ptr + r * sx
    live = i < Q
    x0 = tl.load(base + i, mask=live & (i < n), other=0.0)
    x1 = tl.load(base + i + Q, mask=live & (i + Q < n), other=0.0)
    x2 = tl.load(base + i + 2 * Q, mask=live & (i + 2 * Q < n), other=0.0)
    x3 = tl.load(base + i + 3 * Q, mask=live & (i + 3 * Q < n), other=0.0)
    x4 = tl.load(base + i + 4 * Q, mask=live & (i + 4 * Q < n), other=0.0)
    x5 = tl.load(base + i + 5 * Q, mask=live & (i + 5 * Q < n), other=0.0)
    x6 = tl.load(base + i + 6 * Q, mask=live & (i + 6 * Q < n), other=0.0)
    x7 = tl.load(base + i + 7 * Q, mask=live & (i + 7 * Q < n), other=0.0)
    x8 = tl.load(base + i + 8 * Q, mask=live & (i + 8 * Q < n), other=0.0)
    x9 = tl.load(base + i + 9 * Q, mask=live & (i + 9 * Q < n), other=0.0)
    x10 = tl.load(base + i + 10 * Q, mask=live & (i + 10 * Q < n), other=0.0)
    x11 = tl.load(base + i + 11 * Q, mask=live & (i + 11 * Q < n), other=0.0)
    x12 = tl.load(base + i + 12 * Q, mask=live & (i + 12 * Q < n), other=0.0)
    x13 = tl.load(base + i + 13 * Q, mask=live & (i + 13 * Q < n), other=0.0)
    x14 = tl.load(base + i + 14 * Q, mask=live & (i + 14 * Q < n), other=0.0)
    x15 = tl.load(base + i + 15 * Q, mask=live & (i + 15 * Q < n), other=0.0)
    a0 = x0 * x0 + x8 * x8
    a1 = x1 * x1 + x9 * x9
    a2 = x2 * x2 + x10 * x10
    a3 = x3 * x3 + x11 * x11
    a4 = x4 * x4 + x12 * x12
    a5 = x5 * x5 + x13 * x13
    a6 = x6 * x6 + x14 * x14
    a7 = x7 * x7 + x15 * x15
    b0, b1, b2, b3 = a0 + a4, a1 + a5, a2 + a6, a3 + a7
    c0, c1 = b0 + b2, b1 + b3
    tl.store(y_ptr + r * Q + i, c0 + c1, mask=live)


def sum_of_squares(x):
    """fixed_order.tree_sum(x ** 2, -1) of fp32 x [n] or [rows, n] (contiguous rows), the same bits: the
    tree's first four levels from x in one pass (x ** 2 never in memory), the rest (1/16 of the
    elements) by tree_sum itself."""
    from rlalign.kernels import fixed_order as fo

    rows2 = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    n = rows2.shape[1]
    P = fo.next_pow2(n)
    if x.dtype != torch.float32 or P < 16 or rows2.stride(1) != 1 or rows2.shape[0] == 0:
        return fo.tree_sum(x**2, -1)
    Q = P // 16
    y = torch.empty(rows2.shape[0], Q, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(Q))
    opts = {} if INTERPRET else dict(enable_fp_fusion=False)  # x * x + y * y: two roundings each, then the add
    cached(("square_levels", rows2.shape[0], n, rows2.stride(0)), lambda: Launch(
        _square_levels, (triton.cdiv(Q, block), rows2.shape[0]), (n, rows2.stride(0), Q),
        dict(BLOCK=block, **opts)))(rows2, y)
    out = fo.tree_sum(y, -1)
    return out.reshape(x.shape[:-1])
