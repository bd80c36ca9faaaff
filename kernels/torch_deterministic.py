"""Deterministic, batch-invariant torch implementation of the op set (CPU and GPU).

Every reduction is a `fixed_order.tree_sum` over a dimension whose length is a property of
the row (K, head_dim, the row's own keys, the vocabulary), never of the batch; everything else
is elementwise. So the bits of an output row depend only on that row's inputs: not on the
number of rows, the row's position, padding, chunking, threads, or whether attention ran as a
causal prefill or as a single decode query against a KV cache (zero-padding invariance of the
tree: masked keys contribute exact zeros). Accumulation is fp32; outputs are rounded once to
the input dtype.
"""

from __future__ import annotations

import torch

from rlalign.kernels import fixed_order as fo

# Elements of one materialised product block ([rows, K, N] or [B, Tq, Tk, H, D]); chunking
# only bounds memory, it never changes bits (rows are independent).
_BLOCK_ELEMS = 1 << 22


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, R] @ [R, N] -> [M, N] in fp32, each element a tree over R."""
    M, R = a.shape
    N = b.shape[1]
    a, b = a.float(), b.float()
    n_blk = max(1, min(N, _BLOCK_ELEMS // max(1, R)))
    m_blk = max(1, _BLOCK_ELEMS // max(1, R * n_blk))
    rows = []
    for i in range(0, M, m_blk):
        ai = a[i : i + m_blk, :, None]
        cols = [fo.tree_sum(ai * b[None, :, j : j + n_blk], dim=1) for j in range(0, N, n_blk)]
        rows.append(cols[0] if len(cols) == 1 else torch.cat(cols, 1))
    if not rows:
        return a.new_zeros(0, N)
    return rows[0] if len(rows) == 1 else torch.cat(rows, 0)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        return _mm(x2, w.t()).to(x2.dtype)

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        gx = _mm(g, w).to(x2.dtype) if ctx.needs_input_grad[0] else None
        gw = _mm(g.t(), x2).to(w.dtype) if ctx.needs_input_grad[1] else None  # tree over tokens
        return gx, gw


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    y = _Linear.apply(x2, w) if torch.is_grad_enabled() else _mm(x2, w.t()).to(x.dtype)
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)


def embedding(weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """weight[tokens]; the backward is torch's index backward (sequential, in order, on CPU)."""
    return weight[tokens]


def grouped_with(linear_fn, x: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group; group e uses w[e]: [R, K] x [E, N, K] -> [R, N] through linear_fn,
    whose rows are batch-invariant, so a row's bits ignore which other rows its group holds. Counts
    given as a tensor are read on the host (the reference path; a sync on a GPU); rows past their
    sum are padding (the fixed-capacity all-to-all's) and come out as zeros."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c:
            outs.append(linear_fn(x[start : start + c], w[e]))
        start += c
    if start < x.shape[0]:
        outs.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
    # no rows at all: still a (0-row) linear, so autograd keeps this op, and the collectives around
    # it under expert parallelism, in the backward graph on every rank
    return torch.cat(outs, 0) if outs else linear_fn(x[:0], w[0])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    return grouped_with(linear, x, w, counts)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = fo.tree_sum(xf * xf, -1) / x.shape[-1]
    y = xf * (1.0 / torch.sqrt(var + eps))[..., None]
    return w * y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos/sin [N, D] fp32 rows of the shared table (rotate-half convention)."""
    xf = x.float()
    h = x.shape[-1] // 2
    rot = torch.cat([-xf[..., h:], xf[..., :h]], -1)
    return (xf * cos[:, None] + rot * sin[:, None]).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (fo.silu(gate) * up.float()).to(gate.dtype)


def _attend(q, k, v, valid, scale):
    """q [B, Tq, Hk, G, D]; k, v [B, Tk, Hk, D]; valid [B, Tq, Tk] -> [B, Tq, Hk, G, D] fp32.

    One reduction order per query row: scores by a tree over D, exact max, exp, a tree over
    the keys (zero-padded) for the denominator and for p @ v. Masked keys give p == +0.
    """
    q, k, v = q.float(), k.float(), v.float()
    s = fo.tree_sum(q[:, :, None] * k[:, None, :, :, None, :], dim=-1) * scale  # [B,Tq,Tk,Hk,G]
    mask = valid[:, :, :, None, None]
    s = torch.where(mask, s, torch.full_like(s, float("-inf")))
    m = s.amax(dim=2, keepdim=True)
    p = fo.exp(s - m)
    l_sum = fo.tree_sum(p, dim=2)  # [B,Tq,Hk,G]
    v = torch.where(valid.any(1)[:, :, None, None], v, torch.zeros_like(v))
    o = fo.tree_sum(p[..., None] * v[:, None, :, :, None, :], dim=2)  # [B,Tq,Hk,G,D]
    return o / l_sum[..., None]


def attention_prefill(q, k, v, cu_seqlens: list[int], scale: float) -> torch.Tensor:
    """Causal attention over packed variable-length sequences: q [N, H, D], k/v [N, Hk, D]."""
    N, H, D = q.shape
    Hk = k.shape[1]
    G = H // Hk
    outs = []
    for b in range(len(cu_seqlens) - 1):
        s0, s1 = cu_seqlens[b], cu_seqlens[b + 1]
        T = s1 - s0
        # query chunks [t0, t1) need keys [0, t1) only: later keys are masked (zero terms)
        t_blk = max(1, _BLOCK_ELEMS // max(1, T * H * D))
        for t0 in range(0, T, t_blk):
            t1 = min(T, t0 + t_blk)
            qi = q[s0 + t0 : s0 + t1].reshape(1, t1 - t0, Hk, G, D)
            ki, vi = k[s0 : s0 + t1][None], v[s0 : s0 + t1][None]
            qpos = torch.arange(t0, t1, device=q.device)
            valid = (torch.arange(t1, device=q.device)[None, :] <= qpos[:, None])[None]
            outs.append(_attend(qi, ki, vi, valid, scale).reshape(t1 - t0, H, D))
    if not outs:
        return q.clone()  # no rows; stays connected to the graph
    return torch.cat(outs, 0).to(q.dtype)


def attention_decode(q, k_cache, v_cache, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence against its cache: q [B, H, D], caches [B, C, Hk, D], keys at
    positions < lengths[b] (the new token's key included)."""
    B, H, D = q.shape
    C, Hk = k_cache.shape[1], k_cache.shape[2]
    valid = (torch.arange(C, device=q.device)[None, :] < lengths[:, None])[:, None, :]
    o = _attend(q.reshape(B, 1, Hk, H // Hk, D), k_cache, v_cache, valid, scale)
    return o.reshape(B, H, D).to(q.dtype)


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor, seq_idx: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Keys 0..n_keys-1 of each row's sequence from pages [P, page_size, Hk, D] -> [N, n_keys, Hk, D]."""
    bs = pages.shape[1]
    n_pages = -(-n_keys // bs)
    rows = pages[block_table[seq_idx, :n_pages].long()]  # [N, n_pages, bs, Hk, D]
    return rows.reshape(rows.shape[0], n_pages * bs, *pages.shape[2:])[:, :n_keys]


def attention_paged(q, k_pages, v_pages, block_table, seq_idx, positions, scale: float, runs=None) -> torch.Tensor:
    """Each row q[n] against keys 0..positions[n] of sequence seq_idx[n], read through the block
    table: the decode reduction (a tree over the keys, zero-padded), hence the prefill row's bits.
    Keys past a row's position (other rows' keys, stale or unwritten page slots) are masked and their
    values zeroed, so whatever a page holds there changes nothing."""
    N, H, D = q.shape
    if N == 0:
        return q.clone()
    Hk = k_pages.shape[2]
    n_keys = int(positions.max()) + 1
    r_blk = max(1, _BLOCK_ELEMS // max(1, n_keys * H * D))
    outs = []
    for r0 in range(0, N, r_blk):
        sl = slice(r0, min(N, r0 + r_blk))
        k = gather_pages(k_pages, block_table, seq_idx[sl], n_keys)
        v = gather_pages(v_pages, block_table, seq_idx[sl], n_keys)
        valid = (torch.arange(n_keys, device=q.device)[None, :] <= positions[sl, None])[:, None, :]
        o = _attend(q[sl].reshape(-1, 1, Hk, H // Hk, D), k, v, valid, scale)
        outs.append(o.reshape(-1, H, D))
    return torch.cat(outs, 0).to(q.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim in fixed order."""
    x = x.float()
    p = fo.exp(x - x.amax(-1, keepdim=True))
    return p / fo.tree_sum(p, -1)[..., None]


def topk_first(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties to the lowest index, in descending order."""
    idx = torch.arange(x.shape[-1], device=x.device)
    work = x.detach().clone()
    picks = []
    for _ in range(k):
        m = work.amax(-1, keepdim=True)
        i = torch.where(work == m, idx, x.shape[-1]).amin(-1)
        picks.append(i)
        work.scatter_(-1, i[..., None], float("-inf"))
    ind = torch.stack(picks, -1)
    return x.gather(-1, ind), ind


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]); softmax then top-k."""
    probs = softmax(logits)
    weights, experts = topk_first(probs, top_k)
    if renormalize:
        weights = weights / fo.tree_sum(weights, -1)[..., None]
    return weights, experts


def moe_dispatch(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rlalign.kernels.moe_dispatch in torch ops (any device, any number of rows, every mode)."""
    hits = flat[None] == torch.arange(num_experts, device=flat.device, dtype=flat.dtype)[:, None]  # [E, N]
    seen = torch.cumsum(hits, 1, dtype=torch.int32)  # per expert, rows up to and including this one (a scan
    # along the contiguous dim: along dim 0 it took 224 ms of a 40k-token training step on the H200)
    counts = seen[:, -1].long() if flat.numel() else torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    start = torch.cumsum(counts, 0) - counts
    dest = start.index_select(0, flat) + seen.gather(0, flat[None])[0] - 1
    order = torch.empty_like(dest).scatter_(0, dest, torch.arange(flat.numel(), device=flat.device))
    return order, dest, counts


def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, k, D] expert outputs in top-k slot order, weights [T, k]: sum_j w_j * y_j in fp32,
    slot 0 first, from +0 (a token whose every term is -0 sums to +0), whatever produced y (any EP size,
    any rank order)."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for j in range(y.shape[1]):
        acc = acc + y[:, j].float() * weights[:, j, None].float()
    return acc.to(y.dtype)


def log_softmax_gather(z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """z [N, V] fp32 (already tempered/filtered), tokens [N] -> log p(token) [N] fp32."""
    m = z.amax(-1, keepdim=True)
    lse = fo.log(fo.tree_sum(fo.exp(z - m), -1))
    return (z.gather(-1, tokens[:, None])[:, 0] - m[:, 0]) - lse


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 square root correctly rounded (IEEE), on any device: torch's CPU sqrt is a vector-math
    approximation that misses the last bit now and then. A float64 root rounded to fp32, then moved to
    its neighbour where the exact test says so: a midpoint m between two fp32 neighbours has 25
    significant bits, so m * m is exact in float64 and compares exactly with x."""
    r = x.double().sqrt().float()
    inf = torch.full_like(r, float("inf"))
    up, down = torch.nextafter(r, inf), torch.nextafter(r, -inf)
    xd, rd = x.double(), r.double()
    hi, lo = (rd + up.double()) * 0.5, (rd + down.double()) * 0.5
    r = torch.where((hi * hi < xd) & torch.isfinite(up), up, r)
    r = torch.where((lo * lo > xd) & (r > 0), down, r)
    return torch.where(torch.isfinite(x) & (x > 0), r, x.sqrt())


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor,
           out: torch.Tensor | None = None) -> None:
    """One AdamW update of fp32 p, m, v in place from gradient g; scalars fp32 [8] = (coef, decay, w1,
    beta2, a2, inv_bc2, eps, neg_step) (rlalign.training.optimizer.adamw_scalars). The definition, every
    operation an IEEE single rounding in fp32, so the bits are the same on every device and backend:

        g' = g * coef;  p' = p * decay;  m' = m + w1 * (g' - m);  v' = v * beta2 + a2 * (g' * g')
        p'' = p' + neg_step * (m' / (sqrt(v') * inv_bc2 + eps))

    (torch.optim.AdamW's own kernels differ between devices: CUDA divides by a scalar through its
    reciprocal and contracts a + b * c into one fma, the CPU's addcmul/addcdiv group and fuse
    differently again.) out (optional): p'' rounded into out's dtype."""
    coef, decay, w1, beta2, a2, inv_bc2, eps, neg_step = scalars.tolist()
    gs = g * coef
    p.mul_(decay)
    m.add_((gs - m).mul_(w1))
    v.mul_(beta2).add_((gs * gs).mul_(a2))
    denom = sqrt_rn(v).mul_(inv_bc2).add_(eps)
    p.add_(torch.div(m, denom).mul_(neg_step))
    if out is not None:
        out.copy_(p)


def sum_of_squares(x: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """fo.tree_sum(x ** 2, -1) of a 1-d x (or of each row of a 2-d x), the same bits, without x ** 2 in
    memory: the tree's first level (element i + element i + h, h = next_pow2(n) / 2) is built chunk by
    chunk (at most `chunk` elements of squares at a time), squares written in place; the rest of the
    tree is tree_sum's own loop on that level (n = h)."""
    n = x.shape[-1]
    if n <= 1:
        return fo.tree_sum(x**2, -1)
    h = fo.next_pow2(n) // 2
    m = n - h  # elements i < m have a partner i + h; m <= i < h pass up alone
    level = torch.empty(*x.shape[:-1], h, dtype=x.dtype, device=x.device)
    rows = max(1, x[..., 0].numel())
    step = max(1, chunk // rows)
    for a in range(0, h, step):
        b = min(h, a + step)
        torch.mul(x[..., a:b], x[..., a:b], out=level[..., a:b])
        if a < m:
            e = min(b, m)
            level[..., a:e] += x[..., a + h : e + h] * x[..., a + h : e + h]
    return fo.tree_sum(level, -1)
