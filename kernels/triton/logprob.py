"""Token logprobs: one program per row: max, sum of exp and the gather over the vocabulary in
fixed BLOCK_V chunks; backward per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ROW_BLOCK, Launch, cached, check_inputs


@triton.jit
def _logprob_fwd(z_ptr, t_ptr, out_ptr, lse_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
        m = tl.maximum(m, z)
    mx = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
        s += tl.exp(z - mx)
    lse = mx + tl.log(tl.sum(s, axis=0))
    tok = tl.load(t_ptr + row)
    zt = tl.load(z_ptr + row * V + tok)
    tl.store(out_ptr + row, zt - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _logprob_bwd(z_ptr, t_ptr, lse_ptr, g_ptr, dz_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    tok = tl.load(t_ptr + row)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
        d = g * (tl.where(cols == tok, 1.0, 0.0) - tl.exp(z - lse))
        tl.store(dz_ptr + row * V + cols, d, mask=cols < V)


def _forward(z, tokens):
    N, V = z.shape
    out = torch.empty(N, dtype=torch.float32, device=z.device)
    lse = torch.empty(N, dtype=torch.float32, device=z.device)
    if N:
        cached(("logprob", N, V, tokens.dtype), lambda: Launch(_logprob_fwd, (N,), (V,),
                                                  dict(BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)))))(
            z, tokens, out, lse)
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
                _logprob_bwd, (N,), (V,), dict(BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)))))(
                z, tokens, lse, g.contiguous().float(), dz)
        return dz, None


def log_softmax_gather(z, tokens):
    """z [N, V] fp32 (tempered/filtered) -> log p(tokens) [N] fp32, one program per row."""
    check_inputs("log_softmax_gather", z)
    z, tokens = z.float().contiguous(), tokens.contiguous()
    if torch.is_grad_enabled() and z.requires_grad:
        return _LogProb.apply(z, tokens)
    return _forward(z, tokens)[0]

