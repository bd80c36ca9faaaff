"""Gumbel-max sampling fused into one kernel: per row, the noise of rlalign.kernels.sampling (a
splitmix64 hash of (seed, sample id, position, vocab index) -> u exact in fp32 -> -log(-log u)
with fixed_order.log's add/mul/div formula) added to the tempered, filtered logits z, and the first
index of the maximum — the token `first_argmax(z + gumbel(...))` draws, bit for bit (checked
against it on the GPU and under the interpreter), without the ~40 elementwise passes over [B, V]
of the torch formulation. One program per row, the vocabulary in fixed BLOCK chunks in order.
Compiled without FMA contraction (enable_fp_fusion=False): every add and mul rounds on its own, as
in torch's elementwise kernels; divisions are IEEE (div_rn)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rlalign.kernels import fixed_order as fo
from rlalign.kernels import sampling

from .common import INTERPRET

_U64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
BLOCK = 1024


@triton.jit
def _mix64(x, golden, mix1, mix2):
    x = x + golden
    x = (x ^ (x >> 30)) * mix1
    x = (x ^ (x >> 27)) * mix2
    return x ^ (x >> 31)


@triton.jit
def _log(x, SQRT2: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
         C4: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr):
    """fixed_order.log for positive normal fp32 x (what the sampler feeds it)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > SQRT2
    m = tl.where(big, m * 0.5, m)
    ef = (e + big.to(tl.int32)).to(tl.float32)
    s = tl.math.div_rn(m - 1.0, m + 1.0)
    s2 = s * s
    p = tl.full(s.shape, C0, tl.float32)
    p = p * s2 + C1
    p = p * s2 + C2
    p = p * s2 + C3
    p = p * s2 + C4
    log_m = (p * s2) * s + 2.0 * s
    return ef * LN2_HI + (log_m + ef * LN2_LO)


@triton.jit(do_not_specialize=["seed"])  # a seed of 1 would otherwise become a constant
def _gumbel_argmax_kernel(z_ptr, ids_ptr, pos_ptr, out_ptr, seed, golden, mix1, mix2, V,
                          SQRT2: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                          C3: tl.constexpr, C4: tl.constexpr, LN2_HI: tl.constexpr, LN2_LO: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    sid = tl.load(ids_ptr + row).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
    h = _mix64(seed.to(tl.int64).to(tl.uint64, bitcast=True), golden, mix1, mix2)
    h = _mix64(h ^ sid, golden, mix1, mix2)
    h = _mix64(h ^ pos, golden, mix1, mix2)
    best = float("-inf")
    best_i = V
    nan = 0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf"))
        hv = _mix64(h ^ cols.to(tl.uint64), golden, mix1, mix2)
        u = ((hv >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        g = -_log(-_log(u, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO), SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO)
        x = tl.where(mask, z + g, float("-inf"))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=0))
        x = tl.where(x != x, float("-inf"), x)
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, cols, V), axis=0)
        take = m > best  # strictly greater: an equal maximum in a later chunk keeps the first index
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, tl.where((nan > 0) | (best == float("-inf")), V, best_i))


_CONST = dict(SQRT2=fo.SQRT2, C0=fo.ATANH_COEFFS[0], C1=fo.ATANH_COEFFS[1], C2=fo.ATANH_COEFFS[2],
              C3=fo.ATANH_COEFFS[3], C4=fo.ATANH_COEFFS[4], LN2_HI=fo.LN2_HI, LN2_LO=fo.LN2_LO)
assert len(fo.ATANH_COEFFS) == 5 and sampling.UNIFORM_BITS == 23 and math.isclose(fo.SQRT2, 2 ** 0.5)


def gumbel_argmax(z: torch.Tensor, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """first_argmax(z + gumbel(seed, sample_ids, positions, V)) for z [B, V] fp32: the token ids [B]
    (int64); a row with NaN or no finite value is the same device-side error as first_argmax's."""
    if z.dtype != torch.float32 or z.dim() != 2:
        raise TypeError(f"triton gumbel_argmax: z must be a 2-D fp32 tensor, got {z.dtype} {tuple(z.shape)}")
    B, V = z.shape
    out = torch.empty(B, dtype=torch.long, device=z.device)
    if B:
        z = z.contiguous()
        ids = sample_ids.to(device=z.device, dtype=torch.long).contiguous()
        pos = positions.to(device=z.device, dtype=torch.long).contiguous()
        s64 = (seed & _U64) - (1 << 64) if (seed & _U64) >= (1 << 63) else seed & _U64
        opts = {} if INTERPRET else dict(enable_fp_fusion=False)
        _gumbel_argmax_kernel[(B,)](z, ids, pos, out, s64, GOLDEN, MIX1, MIX2, V, BLOCK=BLOCK, **_CONST, **opts)
    torch._assert_async(((out >= 0) & (out < V)).all(),
                        "sample: a row has no finite maximum (NaN or all -inf logits); no token can be drawn")
    return out
