"""Plain torch implementation of the op set: library GEMMs (oneDNN/MKL/cuBLAS), SDPA, library
reductions, computed in the model dtype the way Hugging Face models do. Fast, and NOT
batch-invariant: it is the baseline the deterministic mode is measured against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x, w, bias=None):
    return F.linear(x, w, bias)


def embedding(weight, tokens):
    return weight[tokens]


def grouped_linear(x, w, counts: list[int] | torch.Tensor):
    """The per-expert F.linear loop (experiments/kernels/bench_triton.py also measures torch._grouped_mm)."""
    if isinstance(counts, torch.Tensor):  # split sizes on the host (a sync on a GPU)
        counts = counts.tolist()
    counts = [*counts, x.shape[0] - sum(counts)]  # rows past the groups: padding, zeros out
    outs = [F.linear(xe, w[e]) if e < w.shape[0] else xe.new_zeros(xe.shape[0], w.shape[1])
            for e, xe in enumerate(torch.split(x, counts)) if xe.shape[0]]
    return torch.cat(outs, 0) if outs else F.linear(x[:0], w[0])  # stays in the autograd graph


def rmsnorm(x, w, eps: float):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def rope(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rot * sin


def swiglu(gate, up):
    return F.silu(gate) * up


def _pad(x, cu_seqlens, T):
    B = len(cu_seqlens) - 1
    out = x.new_zeros(B, T, *x.shape[1:])
    for b in range(B):
        out[b, : cu_seqlens[b + 1] - cu_seqlens[b]] = x[cu_seqlens[b] : cu_seqlens[b + 1]]
    return out


def attention_prefill(q, k, v, cu_seqlens: list[int], scale: float):
    B = len(cu_seqlens) - 1
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(B)]
    if B == 0:
        return q.clone()
    T = max(lens)
    qp, kp, vp = (_pad(t, cu_seqlens, T).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    ar = torch.arange(T, device=q.device)
    lengths = torch.tensor(lens, device=q.device)
    mask = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < lengths[:, None, None])
    o = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    ).transpose(1, 2)
    return torch.cat([o[b, :n] for b, n in enumerate(lens)], 0)


def attention_decode(q, k_cache, v_cache, lengths, scale: float):
    C = k_cache.shape[1]
    mask = (torch.arange(C, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q[:, :, None],
        k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[2],
    )
    return o[:, :, 0]


def attention_paged(q, k_pages, v_pages, block_table, seq_idx, positions, scale: float, runs=None):
    from rlalign.kernels.torch_deterministic import gather_pages

    if q.shape[0] == 0:
        return q.clone()
    n_keys = int(positions.max()) + 1
    k, v = (gather_pages(p, block_table, seq_idx, n_keys) for p in (k_pages, v_pages))
    return attention_decode(q, k, v, positions + 1, scale)


def moe_route(logits, top_k: int, renormalize: bool):
    probs = torch.softmax(logits.float(), -1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def moe_combine(y, weights):
    return (y * weights.to(y.dtype)[..., None]).sum(1)


def log_softmax_gather(z, tokens):
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None])[:, 0]
