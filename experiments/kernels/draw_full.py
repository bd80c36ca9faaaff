"""The full Gumbel-max draw (not the product's, which computes the noise only where a value may reach the row's best
so far: kernels/triton/sampling.py): every value's noise, the same tokens and logprob bits. The baseline of
probe_draw_prune.py and sass_draw.py. Loaded as a module of rlalign.kernels.triton (its relative imports resolve
there); the noise (mix64, fo_log, constants) is the product's. Compiled without FMA contraction, as the product's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, ROW_BLOCK, apply_cut, upcast_scaled
from .logprob import row_lse
from .sampling import GOLDEN, LOG_CONST, MIX1, MIX2, U64, check_2d_float, fo_log, mix64

DRAW_BLOCK = 512  # the draw's lanes (4 warps, 4 columns a thread), each keeping its own best over the chunks


@triton.jit(do_not_specialize=["seed"])  # a seed of 1 would otherwise become a constant
def gumbel_argmax_kernel(z_ptr, ids_ptr, pos_ptr, out_ptr, lp_ptr, cut_ptr, seed, golden, mix1, mix2, scale, V,
                          SCALED: tl.constexpr, LOGPROB: tl.constexpr, CUT: tl.constexpr, SQRT2: tl.constexpr,
                          C0: tl.constexpr,
                          C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                          LN2_HI: tl.constexpr, LN2_LO: tl.constexpr, DRAW_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """The draw: each of DRAW_BLOCK lanes keeps the best value of its columns and the first column holding
    it, one reduction at the end (the first index of the row's maximum: the least of the lanes' firsts).
    LOGPROB: also the drawn token's logprob, logprob._logprob_fwd's bits: the row's max taken in the draw's
    pass, then logprob.row_lse (the trainer's sum, its BLOCK and loads) and the gather.
    CUT: the row's values filtered by its cut (common.apply_cut) in registers, every read (the draw's, the
    sum's, the gather's): the bits the filtered fp32 copy holds. A chunk whose values the cut filtered whole
    draws no noise: -inf plus any noise is -inf, never taken (top-p over a peaked row keeps a few chunks)."""
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
    for v0 in range(0, V, DRAW_BLOCK):
        cols = v0 + tl.arange(0, DRAW_BLOCK)
        mask = cols < V
        z = upcast_scaled(tl.load(z_ptr + row * V + cols, mask=mask, other=float("-inf")), scale, SCALED)
        if CUT:
            z = apply_cut(z, cut)
        if LOGPROB:
            zmax = tl.maximum(zmax, z)
        live = True
        if CUT:  # a chunk the cut filtered whole (every value -inf) draws -inf in every lane: its noise is skipped
            live = tl.max((z != float("-inf")).to(tl.int32), axis=0) > 0
        if live:
            hv = mix64(h ^ cols.to(tl.uint64), golden, mix1, mix2)
            u = ((hv >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            g = -fo_log(-fo_log(u, SQRT2, C0, C1, C2, C3, C4, LN2_HI, LN2_LO), SQRT2, C0, C1, C2, C3, C4, LN2_HI,
                        LN2_LO)
            x = tl.where(mask, z + g, float("-inf"))
            nan = tl.maximum(nan, (x != x).to(tl.int32))
            x = tl.where(x != x, float("-inf"), x)
            take = x > best  # strictly greater: a lane keeps the first column of its maximum
            best_i = tl.where(take, cols, best_i)
            best = tl.where(take, x, best)
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, best_i, V), axis=0)
    tok = tl.where((tl.max(nan, axis=0) > 0) | (m == float("-inf")), V, first)
    tl.store(out_ptr + row, tok)
    if LOGPROB:
        lse = row_lse(z_ptr, row, V, tl.max(zmax, axis=0), scale, SCALED, BLOCK, cut, CUT)
        zt = upcast_scaled(tl.load(z_ptr + row * V + tl.minimum(tok, V - 1)), scale, SCALED)
        if CUT:
            zt = apply_cut(zt, cut)
        tl.store(lp_ptr + row, zt - lse)



def _draw(z, seed, sample_ids, positions, scale, logprobs: bool, cut):
    check_2d_float("gumbel_argmax", z)
    B, V = z.shape
    out = torch.empty(B, dtype=torch.long, device=z.device)
    lp = torch.empty(B if logprobs else 0, dtype=torch.float32, device=z.device)
    if B:
        z = z.contiguous()
        ids = sample_ids.to(device=z.device, dtype=torch.long).contiguous()
        pos = positions.to(device=z.device, dtype=torch.long).contiguous()
        s64 = (seed & U64) - (1 << 64) if (seed & U64) >= (1 << 63) else seed & U64
        opts = {} if INTERPRET else dict(enable_fp_fusion=False)
        cuts = out if cut is None else cut.to(device=z.device, dtype=torch.long).contiguous()
        gumbel_argmax_kernel[(B,)](z, ids, pos, out, lp if logprobs else out, cuts, s64, GOLDEN, MIX1, MIX2, scale,
                                    V, SCALED=scale != 1.0, LOGPROB=logprobs, CUT=cut is not None,
                                    DRAW_BLOCK=DRAW_BLOCK,
                                    BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), **LOG_CONST, **opts)
    torch._assert_async(((out >= 0) & (out < V)).all(),
                        "sample: a row has no finite maximum (NaN or all -inf logits); no token can be drawn")
    return out, lp


def gumbel_argmax(z: torch.Tensor, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                  scale: float = 1.0, cut: torch.Tensor | None = None) -> torch.Tensor:
    """first_argmax(temper(z, scale) + gumbel(seed, sample_ids, positions, V)) for z [B, V] in any float
    dtype (rlalign.kernels.temper: read in place, upcast and scaled in registers): the token ids [B]
    (int64); a row with NaN or no finite value is the same device-side error as first_argmax's. With cut
    (int64 [B], filter_cut's), of sampling.apply_cut(temper(z, scale), cut): the filtered values' tokens."""
    return _draw(z, seed, sample_ids, positions, scale, False, cut)[0]


def gumbel_argmax_logprobs(z: torch.Tensor, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                           scale: float = 1.0, cut: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprob.tempered_logprobs(z, scale, tokens, cut)) for tokens = gumbel_argmax(z, ..., cut), the
    same bits, in one launch: the draw's pass over the row also takes the row's max for the logprob."""
    return _draw(z, seed, sample_ids, positions, scale, True, cut)
