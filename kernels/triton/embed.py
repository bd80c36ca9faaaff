"""Embedding: gather forward; backward sums each token's gradient rows in position order, without
atomics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Launch, cached, check_inputs


@triton.jit
def _embed_bwd(g_ptr, order_ptr, start_ptr, dw_ptr, D, BLOCK: tl.constexpr):
    """Program (vocab row v, column block): dW[v] = sum of the gradient rows of v's tokens, in position
    order (order = stable argsort of the tokens; v's tokens are order[start[v]:start[v+1]])."""
    v = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(start_ptr + v)
    hi = tl.load(start_ptr + v + 1)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(lo, hi):
        r = tl.load(order_ptr + i)
        acc = acc + tl.load(g_ptr + r * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(dw_ptr + v * D + cols, acc.to(dw_ptr.dtype.element_ty), mask=cols < D)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, tokens):
        ctx.save_for_backward(tokens)
        ctx.vocab, ctx.wdtype = weight.shape[0], weight.dtype
        return weight[tokens]

    @staticmethod
    def backward(ctx, g):
        (tokens,) = ctx.saved_tensors
        V, D = ctx.vocab, g.shape[-1]
        flat = tokens.reshape(-1)
        g = g.reshape(-1, D).contiguous()
        order = torch.argsort(flat, stable=True)
        # start[v] = how many tokens are < v: searchsorted over the sorted tokens (no host sync)
        start = torch.searchsorted(flat[order], torch.arange(V + 1, device=flat.device, dtype=flat.dtype))
        dw = torch.empty(V, D, dtype=ctx.wdtype, device=g.device)
        if V and D:
            key = ("embed_bwd", V, D, g.dtype, start.dtype, dw.dtype)
            cached(key, lambda: Launch(_embed_bwd, (V, triton.cdiv(D, 256)), (D,), dict(BLOCK=256)))(
                g, order, start, dw)
        return dw, None


def embedding(weight, tokens):
    check_inputs("embedding", weight)
    if torch.is_grad_enabled() and weight.requires_grad:
        return _Embedding.apply(weight, tokens)
    return weight[tokens]
