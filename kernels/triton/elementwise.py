"""Elementwise and row-local fused kernels: SwiGLU and RoPE (rotate-half), forward and backward; the
paged KV-cache write; an engine step's attention inputs (q / k head norms, RoPE, the cache write) in one
launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Launch, cached, check_inputs
from .norm import fwd_config, normed, row_rstd

_EW_BLOCK = 1024


# n stays specialised (unlike the GEMM's shape ints): n % 16 lets triton vectorise the masked loads;
# without it the backward took 4.5 ms instead of 1.6 ms per bench-moe train step (H200). n = rows x
# the intermediate size, a multiple of 16 whenever that size is.
@triton.jit
def silu_mul(g, u):
    """silu(g) * u in fp32: the one formula of both forward kernels."""
    g = g.to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u.to(tl.float32)


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = silu_mul(tl.load(g_ptr + offs, mask=m, other=0.0), tl.load(u_ptr + offs, mask=m, other=0.0))
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


@triton.jit
def _swiglu_rows(g_ptr, u_ptr, y_ptr, width, sg, su, BLOCK: tl.constexpr):
    """_swiglu_fwd over rows of column views (gate and up: the halves of one [R, 2I] GEMM output, read
    in place): the same fp32 formula, one rounding, into a contiguous [R, I]."""
    r = tl.program_id(0).to(tl.int64)  # rows on the grid's first axis (the others stop at 65,535)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < width
    y = silu_mul(tl.load(g_ptr + r * sg + cols, mask=m, other=0.0), tl.load(u_ptr + r * su + cols, mask=m, other=0.0))
    tl.store(y_ptr + r * width + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _swiglu(gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        cached(("swiglu", n, gate.dtype, up.dtype), lambda: Launch(_swiglu_fwd, (triton.cdiv(n, _EW_BLOCK),), (n,),
                                               dict(BLOCK=_EW_BLOCK)))(gate, up, y)
    return gate, up, y


def _row_views(gate, up) -> bool:
    """gate and up are 2-D with contiguous rows (e.g. the two halves of a [R, 2I] tensor): read in place."""
    return (gate.dim() == 2 and up.shape == gate.shape and gate.stride(1) == 1 and up.stride(1) == 1
            and not (gate.is_contiguous() and up.is_contiguous()))


def _swiglu_strided(gate, up):
    R, inner = gate.shape
    y = torch.empty(R, inner, dtype=gate.dtype, device=gate.device)
    if R and inner:
        block = min(1024, triton.next_power_of_2(inner))
        cached(("swiglu_rows", R, inner, gate.stride(0), up.stride(0), gate.dtype, up.dtype), lambda: Launch(
            _swiglu_rows, (R, triton.cdiv(inner, block)), (inner, gate.stride(0), up.stride(0)),
            dict(BLOCK=block)))(gate, up, y)
    return y


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up, y = _swiglu(gate, up)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            dy = dy.contiguous()
            cached(("swiglu_bwd", n, gate.dtype, up.dtype, dy.dtype), lambda: Launch(
                _swiglu_bwd, (triton.cdiv(n, _EW_BLOCK),), (n,), dict(BLOCK=_EW_BLOCK)))(gate, up, dy, dg, du)
        return dg, du


@triton.jit
def _swiglu_rows_bwd(h_ptr, dy_ptr, dh_ptr, width, BLOCK: tl.constexpr):
    """_swiglu_bwd over rows of h [R, 2 width] (gate | up), writing dh [R, 2 width] (dgate | dup)."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < width
    g = tl.load(h_ptr + r * 2 * width + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + r * 2 * width + width + cols, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r * width + cols, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    tl.store(dh_ptr + r * 2 * width + width + cols, (dy * silu).to(dh_ptr.dtype.element_ty), mask=m)
    tl.store(dh_ptr + r * 2 * width + cols, (dy * u * (sig + silu * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask=m)


class _SwiGLUHalves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        half = h.shape[1] // 2
        ctx.save_for_backward(h)
        return _swiglu_strided(h[:, :half], h[:, half:])

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        R, inner = h.shape[0], h.shape[1] // 2
        dh = torch.empty_like(h)
        if R and inner:
            dy = dy.contiguous()
            block = min(1024, triton.next_power_of_2(inner))
            cached(("swiglu_rows_bwd", R, inner, h.dtype, dy.dtype), lambda: Launch(
                _swiglu_rows_bwd, (R, triton.cdiv(inner, block)), (inner,), dict(BLOCK=block)))(h, dy, dh)
        return dh


def swiglu_halves(h):
    """swiglu(gate, up) of h [R, 2I] = [gate | up] (an expert's fused gate/up output), reading the halves
    in place and, backward, writing h's gradient [dgate | dup] directly: the same formulas as swiglu (the
    same bits) without the halves' copies forward and their concatenation backward."""
    check_inputs("swiglu", h)
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"triton swiglu_halves: h {tuple(h.shape)} must be [R, 2I]")
    h = h.contiguous()
    if torch.is_grad_enabled() and h.requires_grad:
        return _SwiGLUHalves.apply(h)
    half = h.shape[1] // 2
    return _swiglu_strided(h[:, :half], h[:, half:])


def swiglu(gate, up):
    """silu(gate) * up in fp32, one rounding; elementwise, so trivially row-invariant."""
    check_inputs("swiglu", gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    if _row_views(gate, up):  # no copies of the halves (two launches per MoE layer at decode)
        return _swiglu_strided(gate, up)
    return _swiglu(gate, up)[2]


# --- RoPE (rotate-half), fwd/bwd ---------------------------------------------------------------------
@triton.jit
def rotate(x1, x2, c1, c2, s1, s2):
    """RoPE's rotation of a row's halves in fp32 (rotate-half): the one formula of the rope kernel and the
    fused norm-and-rope."""
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


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
        y1, y2 = rotate(x1, x2, c1, c2, s1, s2)
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
        key = ("rope", N, H, D, x.stride(0), x.stride(1), sign, x.dtype)
        cached(key, lambda: Launch(_rope_kernel, (N,), (H, x.stride(0), x.stride(1), y.stride(0), y.stride(1)),
                                    dict(HALF=D // 2, BLOCK_H=triton.next_power_of_2(H), SIGN=sign)))(x, cos, sin, y)
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
    check_inputs("rope", x)
    if cos.dtype != torch.float32 or not cos.is_contiguous():
        cos = cos.float().contiguous()
    if sin.dtype != torch.float32 or not sin.is_contiguous():
        sin = sin.float().contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rope.apply(x, cos, sin)
    return _rope_apply(x, cos, sin, 1)


# --- the KV-cache write of an engine step -----------------------------------------------------------------
@triton.jit
def _paged_write(k_ptr, v_ptr, kp_ptr, vp_ptr, slot_ptr, W, skn, svn, BLOCK: tl.constexpr):
    """Row n of k and v (W = Hk * D contiguous elements each) into slot slots[n] of the flat pages."""
    n = tl.program_id(0).to(tl.int64)
    s = tl.load(slot_ptr + n).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < W
    tl.store(kp_ptr + s * W + offs, tl.load(k_ptr + n * skn + offs, mask=m), mask=m)
    tl.store(vp_ptr + s * W + offs, tl.load(v_ptr + n * svn + offs, mask=m), mask=m)


def paged_write(k_pages, v_pages, slots, k, v) -> None:
    """k, v [N, Hk, D] into the flat slots of k_pages / v_pages [P, page_size, Hk, D]: one launch (two
    index_copy_ before). Pages must be contiguous (the engine's are); rows are read in place when each
    row's Hk x D elements are contiguous."""
    check_inputs("paged_write", k, v)
    N = k.shape[0]
    W = k.shape[1] * k.shape[2]
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()) or k_pages.shape[2:] != k.shape[1:] \
            or v.shape != k.shape or slots.shape != (N,) or k_pages.dtype != k.dtype or v_pages.dtype != v.dtype:
        raise ValueError(f"triton paged_write: pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)} (contiguous "
                         f"{k_pages.is_contiguous()}), rows {tuple(k.shape)} / {tuple(v.shape)} {k.dtype}, "
                         f"slots {tuple(slots.shape)} do not fit")
    k, v = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous() for t in (k, v))
    if N:
        cached(("paged_write", N, W, k.stride(0), v.stride(0), k.dtype, slots.dtype), lambda: Launch(
            _paged_write, (N,), (W, k.stride(0), v.stride(0)), dict(BLOCK=triton.next_power_of_2(W))))(
            k, v, k_pages, v_pages, slots.contiguous())


# --- the attention's inputs of an engine step: q / k head norms, RoPE, the KV-cache write ---------------------
@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, o_ptr, c_ptr, s_ptr, kp_ptr, slot_ptr, p, R, heads, D, eps, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr, HALF: tl.constexpr, WRITE: tl.constexpr):
    """Rows [p ROWS, (p + 1) ROWS) of x [R = tokens x heads, D]: rmsnorm (the norm kernel's tile and
    row_rstd: the same reduction order), rounded to the dtype as its store rounds, then the rope kernel's
    rotation of the two halves (reloaded from x: the same elementwise ops). WRITE: into the token's slot
    of the flat pages kp (slot x heads x D + head x D), else into o [R, D]."""
    rows = p * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    live = rows < R
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=live[:, None] & (cols < D)[None, :],
                other=0.0).to(tl.float32)
    rstd = row_rstd(x, D, eps)
    h = tl.arange(0, HALF)
    m = live[:, None]
    base = rows.to(tl.int64)[:, None] * D + h[None, :]
    dt = o_ptr.dtype.element_ty
    y1 = normed(tl.load(x_ptr + base, mask=m, other=0.0).to(tl.float32), rstd, tl.load(w_ptr + h)).to(dt)
    y2 = normed(tl.load(x_ptr + base + HALF, mask=m, other=0.0).to(tl.float32), rstd,
                tl.load(w_ptr + HALF + h)).to(dt)
    tok = (rows // heads).to(tl.int64)
    tab = tok[:, None] * D + h[None, :]
    c1 = tl.load(c_ptr + tab, mask=m, other=0.0)
    c2 = tl.load(c_ptr + tab + HALF, mask=m, other=0.0)
    s1 = tl.load(s_ptr + tab, mask=m, other=0.0)
    s2 = tl.load(s_ptr + tab + HALF, mask=m, other=0.0)
    r1, r2 = rotate(y1.to(tl.float32), y2.to(tl.float32), c1, c2, s1, s2)
    if WRITE:
        slot = tl.load(slot_ptr + tok, mask=live, other=0).to(tl.int64)
        dst = kp_ptr + (slot * heads + (rows % heads))[:, None] * D + h[None, :]
    else:
        dst = o_ptr + base
    tl.store(dst, r1.to(dt), mask=m)
    tl.store(dst + HALF, r2.to(dt), mask=m)


@triton.jit(do_not_specialize=["N"])
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, c_ptr, s_ptr, qo_ptr, ko_ptr, kp_ptr, vp_ptr, slot_ptr,
                         N, eps, H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr, WRITE: tl.constexpr):
    """Programs [0, PQ): q's rows [N x H, D] normed and rotated into qo; [PQ, PQ + PK): k's, into ko or
    (WRITE) the pages kp; WRITE, the rest: v's rows [N x HK, D] copied into the pages vp (paged_write's)."""
    pid = tl.program_id(0)
    PQ = tl.cdiv(N * H, ROWS)
    PK = tl.cdiv(N * HK, ROWS)
    if pid < PQ:
        _norm_rope_rows(q_ptr, qw_ptr, qo_ptr, c_ptr, s_ptr, qo_ptr, slot_ptr, pid, N * H, H, D, eps, ROWS, BLOCK,
                        D // 2, False)
    elif pid < PQ + PK:
        _norm_rope_rows(k_ptr, kw_ptr, ko_ptr, c_ptr, s_ptr, kp_ptr, slot_ptr, pid - PQ, N * HK, HK, D, eps, ROWS,
                        BLOCK, D // 2, WRITE)
    else:
        rows = (pid - PQ - PK) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        live = rows < N * HK
        slot = tl.load(slot_ptr + rows // HK, mask=live, other=0).to(tl.int64)
        vals = tl.load(v_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=live[:, None])
        tl.store(vp_ptr + (slot * HK + rows % HK)[:, None] * D + cols[None, :], vals, mask=live[:, None])


def qk_norm_rope(q, k, qw, kw, eps: float, cos, sin, pages=None):
    """(rope(rmsnorm(q, qw, eps), cos, sin), rope(rmsnorm(k, kw, eps), cos, sin)) for q [N, H, D], k [N, Hk, D]
    (D a power of two), the same bits, in one launch, without a gradient. pages = (k_pages, v_pages, slots, v):
    k's rotated rows and v's rows are written into slots [N] of the contiguous pages [P, page_size, Hk, D]
    instead (paged_write's copy; the k returned is None)."""
    check_inputs("qk_norm_rope", q, k, qw, kw)
    N, H, D = q.shape
    HK = k.shape[1]
    if D & (D - 1) or D < 2 or k.shape != (N, HK, D) or qw.shape != (D,) or kw.shape != (D,):
        raise ValueError(f"triton qk_norm_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(qw.shape)} / "
                         f"{tuple(kw.shape)} (head_dim a power of two, one weight per head dim)")
    q, k = q.contiguous(), k.contiguous()
    qw, kw = (w if w.dtype == q.dtype else w.to(q.dtype) for w in (qw, kw))
    cos, sin = (t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous() for t in (cos, sin))
    qo = torch.empty_like(q)
    write = pages is not None
    if write:
        k_pages, v_pages, slots, v = pages
        v = v.contiguous()
        if not (k_pages.is_contiguous() and v_pages.is_contiguous()) or k_pages.shape[2:] != (HK, D) \
                or v_pages.shape != k_pages.shape or v.shape != k.shape or slots.shape != (N,) \
                or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"triton qk_norm_rope: pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)} (contiguous "
                             f"{k_pages.is_contiguous()}), k / v {tuple(k.shape)} / {tuple(v.shape)} {q.dtype}, "
                             f"slots {tuple(slots.shape)} do not fit")
        ko, slots = None, slots.contiguous()
    else:
        ko = torch.empty_like(k)
    if N:
        cfg = fwd_config(D)  # the norm kernel's tile and warps: its reduction order
        rows = cfg["ROWS"]
        grid = triton.cdiv(N * H, rows) + triton.cdiv(N * HK, rows) * (2 if write else 1)
        key = ("qk_norm_rope", N, H, HK, D, eps, q.dtype, write, slots.dtype if write else None)
        cached(key, lambda: Launch(_qk_norm_rope_kernel, (grid,), (N, eps), dict(
            H=H, HK=HK, D=D, ROWS=rows, BLOCK=cfg["BLOCK"], WRITE=write, num_warps=cfg["num_warps"])))(
            q, k, v if write else k, qw, kw, cos, sin, qo, ko if ko is not None else qo,
            k_pages if write else qo, v_pages if write else qo, slots if write else cos)
    return qo, ko


# --- the gradient trees' adds: a + b in fp32 from leaves in any float dtype, one pass ------------------------
@triton.jit
def _add_f32(a_ptr, b_ptr, c_ptr, o_ptr, n, THREE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if THREE:
        b = b + tl.load(c_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + offs, a + b, mask=m)


def add_f32(a, b, c=None):
    """a.float() + b.float(), or a.float() + (b.float() + c.float()) (the conversions are exact, IEEE
    fp32 adds: the same bits) without fp32 copies of narrower inputs or of b + c: one launch.
    Contiguous inputs of one shape and device."""
    ts = (a, b) if c is None else (a, b, c)
    check_inputs("add_f32", *ts)
    if any(t.shape != a.shape or not t.is_contiguous() for t in ts):
        return a.float() + b.float() if c is None else a.float() + (b.float() + c.float())
    out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    n = a.numel()
    if n:
        cached(("add_f32", n, *(t.dtype for t in ts)), lambda: Launch(
            _add_f32, (triton.cdiv(n, 4096),), (n,), dict(THREE=c is not None, BLOCK=4096)))(
            a, b, b if c is None else c, out)
    return out
