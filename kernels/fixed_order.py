"""Fixed-order arithmetic: reductions and transcendentals built only from IEEE add/mul/div.

Everything here is made of elementwise operations whose results are correctly rounded
(add, sub, mul, div, sqrt, round, max, integer bit operations), so the bits of an output depend
only on the values that feed it, never on tensor shape, memory layout, SIMD width, thread count
or the device. Library `sum`, `exp` and `log` don't promise that (vectorised body and scalar
tail use different code, reductions split by shape and thread count).

Contract of `tree_sum`: the reduction is the pairwise tree over the length zero-padded to the
next power of two (element i meets element i + n/2 first). Appending zeros therefore never
changes the result: a row reduced over 37 keys equals the same row reduced over a 4096-slot
KV cache whose extra slots are zero. Signs of zero are canonicalised (-0 -> +0).
"""

from __future__ import annotations

import math

import torch

__all__ = ["tree_sum", "exp", "log", "silu", "next_pow2"]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tree_sum_fwd(x: torch.Tensor, dim: int) -> torch.Tensor:
    n = x.shape[dim]
    if n == 0:  # empty sum: exact zeros
        return x.new_zeros([s for i, s in enumerate(x.shape) if i != dim])
    while n > 1:
        h = next_pow2(n) // 2  # pairs (i, i + h); slots >= n are implicit zeros
        m = n - h  # how many i have a real partner
        paired = x.narrow(dim, 0, m) + x.narrow(dim, h, m)
        x = paired if m == h else torch.cat([paired, x.narrow(dim, m, h - m)], dim)
        n = h
    return x.squeeze(dim) + 0.0  # -0 -> +0


class _TreeSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim, ctx.shape = dim, x.shape
        return _tree_sum_fwd(x, dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.unsqueeze(ctx.dim).expand(ctx.shape), None


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` in the fixed zero-padding-invariant tree order (module docstring)."""
    dim = dim % x.dim()
    if x.requires_grad and torch.is_grad_enabled():
        return _TreeSum.apply(x, dim)
    return _tree_sum_fwd(x, dim)


# --- exp ------------------------------------------------------------------------------------
# exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 split Cody-Waite style so that
# n * LN2_HI is exact; exp(r) by a degree-7 Taylor polynomial in Horner form (|r| <= 0.347,
# truncation < 6e-9 relative). Accuracy ~1-2 ulp of fp32.
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125  # 0x3f317200: 16 significant bits
LN2_LO = 1.4286068203094172e-06
EXP_COEFFS = [1.0 / math.factorial(i) for i in range(7, 1, -1)]  # r^7 .. r^2 coefficients


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for integer k in [-126, 127], built from the exponent bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def _exp_fwd(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    xc = x.clamp(-104.0, 89.0)
    n = torch.round(xc * LOG2E)
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = torch.full_like(r, EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        p = p * r + c
    p = (p * r + 1.0) * r + 1.0
    n1 = torch.div(n, 2, rounding_mode="floor")  # two factors keep each in the normal range
    y = (p * _pow2(n1)) * _pow2(n - n1)
    y = torch.where(x < -104.0, torch.zeros_like(y), y)  # covers -inf: exactly 0
    return torch.where(x > 89.0, torch.full_like(y, math.inf), y)


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _exp_fwd(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp in fp32 from add/mul only; bits depend on the input value alone."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Exp.apply(x)
    return _exp_fwd(x)


# --- log ------------------------------------------------------------------------------------
# x = m * 2^e with m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(s), s = (m-1)/(m+1), |s| < 0.172,
# series to s^11 (truncation < 2e-11). Accuracy ~1-2 ulp of fp32.
ATANH_COEFFS = [2.0 / 11, 2.0 / 9, 2.0 / 7, 2.0 / 5, 2.0 / 3]
SQRT2 = 1.4142135623730951


def _log_fwd(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    tiny = x < 1.1754943508222875e-38  # subnormal (or <= 0): rescale by 2^24 first
    xs = torch.where(tiny, x * 16777216.0, x)
    bits = xs.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 - torch.where(tiny, 24, 0).to(torch.int32)
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int32)).float()
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, ATANH_COEFFS[0])
    for c in ATANH_COEFFS[1:]:
        p = p * s2 + c
    log_m = (p * s2) * s + 2.0 * s
    y = e * LN2_HI + (log_m + e * LN2_LO)
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x == math.inf, torch.full_like(y, math.inf), y)
    return torch.where(x < 0, torch.full_like(y, math.nan), y)


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _log_fwd(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / x.float()


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log in fp32 from add/mul/div and exponent bits; bits depend on the value alone."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Log.apply(x)
    return _log_fwd(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) = x / (1 + exp(-x)) in fp32."""
    x = x.float()
    return x / (1.0 + exp(-x))
