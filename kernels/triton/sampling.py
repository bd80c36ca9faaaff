"""The sampler's two kernels: the top-k/top-p filter and the Gumbel-max draw. Both take the tempered
logits rlalign.kernels.temper(logits, scale) from the logits in any float dtype, upcast (exact) and
scaled in registers (common.upcast_scaled): a step makes no separate fp32 copy of [B, V] and no pass
for the temperature. The top-k/top-p filter's cut per row (topp.filter_cut: the kept set is {order key >= cut}
and NaN) is applied by the draw and the logprob to the logits as they read them (common.apply_cut: the filtered
copy's bits, without writing or reading the copy).

Gumbel-max sampling fused into one kernel: per row, the noise of rlalign.kernels.sampling (a
splitmix64 hash of (seed, sample id, position, vocab index) -> u exact in fp32 -> -log(-log u)
with fixed_order.log's add/mul/div formula) added to the tempered, filtered logits z, and the first
index of the maximum — the token `first_argmax(z + gumbel(...))` draws, bit for bit (checked
against it on the GPU and under the interpreter), without the ~40 elementwise passes over [B, V]
of the torch formulation. One program per row; each of DRAW_BLOCK lanes keeps its best column, one
reduction at the end.
The noise's two logs are most of the draw's work, and only a value that can reach the row's maximum needs
them. The row's greatest z + noise found so far, B, bounds that maximum from below; a chunk computes the exact
noise only when one of its values may reach B (may_reach): z + 17 >= B (the noise is at most 16.64), then,
from the value's uniform u alone, u >= exp(-exp(-(B - z - margin))) (below it -log(-log u) < B - z - margin).
A value ruled out has z + noise < B: it is not the row's maximum nor tied with it, so the token and its bits
are those of every value's noise (experiments/kernels/draw_full.py draws that way).
Compiled without FMA contraction (enable_fp_fusion=False): every add and mul rounds on its own, as
in torch's elementwise kernels; divisions are IEEE (div_rn)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rlalign.kernels import fixed_order as fo
from rlalign.kernels import sampling

from .common import INTERPRET, ROW_BLOCK, apply_cut, upcast_scaled
from .logprob import row_lse

U64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
DRAW_BLOCK = 512  # the draw's lanes (4 warps, 4 columns a thread), each keeping its own best over the chunks
# the noise -log(-log u) is at most 16.64 (u <= 1 - 2**-24; tests/test_sampling_prune.py checks every u): a value
# with fl(z + NOISE_BOUND) < best_x cannot reach best_x
NOISE_BOUND = tl.constexpr(17.0)
# may_reach's margin in logits (plus 1e-3 of it relative to |best_x| + |z|) and its relative slack on 1 - u: it covers
# fixed_order.log's error against log (< 1e-6 over every u), the sums' rounding and tl.exp's (~1e-6 relative)
DRAW_MARGIN = 1e-3


@triton.jit
def mix64(x, golden, mix1, mix2):
    x = x + golden
    x = (x ^ (x >> 30)) * mix1
    x = (x ^ (x >> 27)) * mix2
    return x ^ (x >> 31)


@triton.jit
def fo_log(x, SQRT2: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
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


@triton.jit
def may_reach(z, kf, best_x, MARGIN: tl.constexpr):
    """Whether z plus the noise of uniform u = (kf + 0.5) / 2**23 may reach best_x (a value of z + noise already
    found), decided without the noise's logs; false only where z + noise < best_x (the module docstring): z is -inf,
    fl(z + NOISE_BOUND) < best_x, or u < exp(-e) for e = exp(-y), y = best_x - z less the margin MARGIN + MARGIN *
    1e-3 * (|best_x| + |z|), compared as 1 - u > (1 + MARGIN / 10) * s with s = e for e < 0.01, else 1 - exp(-e)
    (s >= 1 - exp(-e) both ways). NaN anywhere: true."""
    near = (z + NOISE_BOUND >= best_x) & (z > float("-inf"))
    first = best_x == float("-inf")  # nothing found yet: every value above -inf may reach it
    bx = tl.where(first, 0.0, best_x)  # finite stand-ins (no inf - inf below; the answer is `first` there)
    zf = tl.maximum(z, -3.4028234663852886e38)
    y = tl.where(first, float("-inf"), (bx - zf) - (MARGIN + (MARGIN * 1e-3) * (tl.abs(bx) + tl.abs(zf))))
    e = tl.exp(-y)
    s = tl.where(e < 0.01, e, 1.0 - tl.exp(-e))
    # (1 - u) * 2**23 = 8388607.5 - kf, exact
    return (near & ~(8388607.5 - kf > s * (8388608.0 * (1.0 + MARGIN * 0.1)))) | (z != z)


@triton.jit(do_not_specialize=["seed"])  # a seed of 1 would otherwise become a constant
def gumbel_argmax_kernel(z_ptr, ids_ptr, pos_ptr, out_ptr, lp_ptr, cut_ptr, exact_ptr, seed, golden, mix1, mix2,
                         scale, V, SCALED: tl.constexpr, LOGPROB: tl.constexpr, CUT: tl.constexpr,
                         COUNT: tl.constexpr, MARGIN: tl.constexpr, SQRT2: tl.constexpr,
                         C0: tl.constexpr,
                         C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                         LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, DRAW_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """The draw: each of DRAW_BLOCK lanes keeps the best value of its columns and the first column holding
    it, one reduction at the end (the first index of the row's maximum: the least of the lanes' firsts).
    A chunk computes the exact noise only where a value may reach best_x, the greatest value found so far
    (may_reach; the first chunk with a value above -inf always does): a lane that skips a value that could not
    reach best_x may end with another best than the full draw's, but below the row's maximum, so not chosen.
    LOGPROB: also the drawn token's logprob, logprob._logprob_fwd's bits: the row's max taken in the draw's
    pass, then logprob.row_lse (the trainer's sum, its BLOCK and loads) and the gather.
    CUT: the row's values filtered by its cut (common.apply_cut) in registers, every read (the draw's, the
    sum's, the gather's): the bits the filtered fp32 copy holds; a filtered value (-inf) never reaches best_x.
    COUNT: the chunks that computed the exact noise, per row, to exact_ptr."""
    row = tl.program_id(0).to(tl.int64)
    cut = tl.zeros((), tl.int64)
    if CUT:
        cut = tl.load(cut_ptr + row)
    sid = tl.load(ids_ptr + row).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + row).to(tl.uint64, bitcast=True)
    h = mix64(seed.to(tl.int64).to(tl.uint64, bitcast=True), golden, mix1, mix2)
    h = mix64(h ^ sid, golden, mix1, mix2)
    h = mix64(h ^ pos, golden, mix1, mix2)
    best = tl.full((DRAW_BLOCK,), float("-inf"), tl.float32)
    best_i = tl.full((DRAW_BLOCK,), V, tl.int32)
    nan = tl.zeros((DRAW_BLOCK,), tl.int32)
    zmax = tl.full((DRAW_BLOCK,), float("-inf"), tl.float32)
    best_x = tl.full((), float("-inf"), tl.float32)
    exact = tl.zeros((), tl.int32)
    lanes = tl.arange(0, DRAW_BLOCK)
    z_next = tl.load(z_ptr + row * V + lanes, mask=lanes < V, other=float("-inf"))
    for v0 in range(0, V, DRAW_BLOCK):
        cols = v0 + lanes
        mask = cols < V
        z_raw = z_next  # the next chunk's load in flight while this chunk waits on its reductions
        z_next = tl.load(z_ptr + row * V + cols + DRAW_BLOCK, mask=cols + DRAW_BLOCK < V, other=float("-inf"))
        z = upcast_scaled(z_raw, scale, SCALED)
        if CUT:
            z = apply_cut(z, cut)
        if LOGPROB:
            zmax = tl.maximum(zmax, z)
        nan = tl.maximum(nan, (z != z).to(tl.int32))
        # the chunk's values further below best_x than any noise reaches are ruled out without the hash
        if tl.max(((z + NOISE_BOUND >= best_x) & (z > float("-inf")) | (z != z)).to(tl.int32), axis=0) > 0:
            hv = mix64(h ^ cols.to(tl.uint64), golden, mix1, mix2)
            kf = (hv >> 41).to(tl.float32)
            if tl.max(may_reach(z, kf, best_x, MARGIN).to(tl.int32), axis=0) > 0:
                u = (kf + 0.5) * (1.0 / 8388608.0)
                g = -fo_log(-fo_log(u, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO), SQRT2, C0, C1, C2, C3, C4,
                            LN2_HI, LN2_LO)
                x = tl.where(mask, z + g, float("-inf"))
                x = tl.where(x != x, float("-inf"), x)
                take = x > best  # strictly greater: a lane keeps the first column of its maximum
                best_i = tl.where(take, cols, best_i)
                best = tl.where(take, x, best)
                best_x = tl.max(best, axis=0)
                exact += 1
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, best_i, V), axis=0)
    tok = tl.where((tl.max(nan, axis=0) > 0) | (m == float("-inf")), V, first)
    tl.store(out_ptr + row, tok)
    if COUNT:
        tl.store(exact_ptr + row, exact)
    if LOGPROB:
        lse = row_lse(z_ptr, row, V, tl.max(zmax, axis=0), scale, SCALED, BLOCK, cut, CUT)
        zt = upcast_scaled(tl.load(z_ptr + row * V + tl.minimum(tok, V - 1)), scale, SCALED)
        if CUT:
            zt = apply_cut(zt, cut)
        tl.store(lp_ptr + row, zt - lse)


LOG_CONST = dict(SQRT2=fo.SQRT2, C0=fo.ATANH_COEFFS[0], C1=fo.ATANH_COEFFS[1], C2=fo.ATANH_COEFFS[2],
              C3=fo.ATANH_COEFFS[3], C4=fo.ATANH_COEFFS[4], LN2_HI=fo.LN2_HI, LN2_LO=fo.LN2_LO)
assert len(fo.ATANH_COEFFS) == 5 and sampling.UNIFORM_BITS == 23 and math.isclose(fo.SQRT2, 2 ** 0.5)


def check_2d_float(name: str, z: torch.Tensor) -> None:
    if z.dtype not in (torch.float32, torch.bfloat16, torch.float16) or z.dim() != 2:
        raise TypeError(f"triton {name}: z must be a 2-D float tensor (fp32, bf16, fp16), got {z.dtype} "
                        f"{tuple(z.shape)}")


def _draw(z, seed, sample_ids, positions, scale, logprobs: bool, cut, exact=None):
    check_2d_float("gumbel_argmax", z)
    B, V = z.shape
    if exact is not None and (exact.shape != (B,) or exact.dtype != torch.int32 or exact.device != z.device):
        raise ValueError(f"gumbel_argmax: exact must be a [{B}] int32 tensor on {z.device}, got {tuple(exact.shape)} "
                         f"{exact.dtype} on {exact.device}")
    out = torch.empty(B, dtype=torch.long, device=z.device)
    lp = torch.empty(B if logprobs else 0, dtype=torch.float32, device=z.device)
    if B:
        z = z.contiguous()
        ids = sample_ids.to(device=z.device, dtype=torch.long).contiguous()
        pos = positions.to(device=z.device, dtype=torch.long).contiguous()
        s64 = (seed & U64) - (1 << 64) if (seed & U64) >= (1 << 63) else seed & U64
        opts = {} if INTERPRET else dict(enable_fp_fusion=False)
        cuts = out if cut is None else cut.to(device=z.device, dtype=torch.long).contiguous()
        gumbel_argmax_kernel[(B,)](z, ids, pos, out, lp if logprobs else out, cuts, out if exact is None else exact,
                                    s64, GOLDEN, MIX1, MIX2, scale, V, SCALED=scale != 1.0, LOGPROB=logprobs,
                                    CUT=cut is not None, COUNT=exact is not None, MARGIN=DRAW_MARGIN,
                                    DRAW_BLOCK=DRAW_BLOCK,
                                    BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), **LOG_CONST, **opts)
    torch._assert_async(((out >= 0) & (out < V)).all(),
                        "sample: a row has no finite maximum (NaN or all -inf logits); no token can be drawn")
    return out, lp


def gumbel_argmax(z: torch.Tensor, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                  scale: float = 1.0, cut: torch.Tensor | None = None,
                  exact: torch.Tensor | None = None) -> torch.Tensor:
    """first_argmax(temper(z, scale) + gumbel(seed, sample_ids, positions, V)) for z [B, V] in any float
    dtype (rlalign.kernels.temper: read in place, upcast and scaled in registers): the token ids [B]
    (int64); a row with NaN or no finite value is the same device-side error as first_argmax's. With cut
    (int64 [B], filter_cut's), of sampling.apply_cut(temper(z, scale), cut): the filtered values' tokens.
    exact ([B] int32, optional): per row, the chunks of DRAW_BLOCK columns that computed the exact noise."""
    return _draw(z, seed, sample_ids, positions, scale, False, cut, exact)[0]


def gumbel_argmax_logprobs(z: torch.Tensor, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                           scale: float = 1.0, cut: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprob.tempered_logprobs(z, scale, tokens, cut)) for tokens = gumbel_argmax(z, ..., cut), the
    same bits, in one launch: the draw's pass over the row also takes the row's max for the logprob."""
    return _draw(z, seed, sample_ids, positions, scale, True, cut)
