"""Split-KV paged decode attention (flash-decoding) for kernels.mode=default: NOT batch-invariant.

Each query row n (sequence seq_idx[n], position positions[n]) attends keys 0..positions[n] of its
sequence through the block table. A program handles one (row, kv head, key split): the G query heads
that share the kv head as one [G, D] tile against 64-key blocks, an online softmax over its split's
keys, then (splits > 1) a second launch folds the splits' partials by their log-sum-exp. How many
splits a row gets depends on how many rows the batch has, so a row's bits depend on its batch: the
speed of the vendor-style kernel, without the deterministic mode's contract. No host sync (the grid
is a function of shapes only): CUDA graphs capture it.

    out = paged_decode(q, k_pages, v_pages, block_table, seq_idx, positions, scale)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import INTERPRET, host_free_dot, num_sms

CONFIG = {"BLOCK_N": 16 if INTERPRET else 64, "num_warps": 4, "num_stages": 3}
MIN_SPLIT_KEYS = 32 if INTERPRET else 256  # a split's fewest keys: below that the fold costs more than it saves
PROGRAMS_PER_SM = 2


@triton.jit
def _splitkv_kernel(Q, K, V, BT, SEQ, POS, OUT, PO, PL, scale_log2, keys_per_split,
                    s_qn, s_qh, s_kp, s_ks, s_kh, s_bt, s_on, s_oh,
                    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, UPCAST: tl.constexpr):
    n, hk, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(SEQ + n).to(tl.int64)
    length = tl.load(POS + n).to(tl.int32) + 1
    start = s * keys_per_split
    end = tl.minimum(length, start + keys_per_split)
    rg, rd, rn = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, BLOCK_N)
    gmask = rg < G
    heads = hk * G + rg
    q = tl.load(Q + n.to(tl.int64) * s_qn + heads[:, None] * s_qh + rd[None, :], mask=gmask[:, None], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for kb in range(start, end, BLOCK_N):
        j = kb + rn
        jm = j < end
        page = tl.load(BT + seq * s_bt + j // PAGE, mask=jm, other=0).to(tl.int64)
        off = page * s_kp + (j % PAGE).to(tl.int64) * s_ks + hk * s_kh
        k = tl.load(K + off[:, None] + rd[None, :], mask=jm[:, None], other=0.0)
        v = tl.load(V + off[:, None] + rd[None, :], mask=jm[:, None], other=0.0)
        if UPCAST:
            qk = host_free_dot(q, tl.trans(k))
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(jm[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = host_free_dot(p, v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if SPLITS == 1:
        out = acc / den[:, None]
        tl.store(OUT + n.to(tl.int64) * s_on + heads[:, None] * s_oh + rd[None, :], out.to(OUT.dtype.element_ty),
                 mask=gmask[:, None])
    else:
        has = den > 0
        out = acc / tl.where(has, den, 1.0)[:, None]
        lse = tl.where(has, m + tl.log2(tl.where(has, den, 1.0)), float("-inf"))
        base = (n.to(tl.int64) * H + heads) * SPLITS + s
        tl.store(PO + base[:, None] * D + rd[None, :], out, mask=gmask[:, None])
        tl.store(PL + base, lse, mask=gmask)


@triton.jit
def _fold_kernel(PO, PL, OUT, s_on, s_oh, H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                 SP: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    rs, rd = tl.arange(0, SP), tl.arange(0, D)
    smask = rs < SPLITS
    base = (n.to(tl.int64) * H + h) * SPLITS
    lse = tl.load(PL + base + rs, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(PO + (base + rs)[:, None] * D + rd[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + n.to(tl.int64) * s_on + h * s_oh + rd, out.to(OUT.dtype.element_ty))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits(rows: int, kv_heads: int, max_keys: int, device) -> int:
    """Key splits per (row, kv head): enough programs for PROGRAMS_PER_SM per SM, at least
    MIN_SPLIT_KEYS keys a split. max_keys is the block table's capacity (a host number: no sync)."""
    want = _cdiv(PROGRAMS_PER_SM * num_sms(device), max(1, rows * kv_heads))
    return max(1, min(want, _cdiv(max_keys, MIN_SPLIT_KEYS)))


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                 seq_idx: torch.Tensor, positions: torch.Tensor, scale: float, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """q [N, H, D] against pages [P, page_size, Hk, D] (k and v alike laid out) -> [N, H, D] in q's dtype
    (into `out` if given: any [N, H, D] view with a unit last stride)."""
    N, H, D = q.shape
    P, page, Hk, Dk = k_pages.shape
    if Dk != D or H % Hk or k_pages.stride() != v_pages.stride() or D & (D - 1):
        raise ValueError(f"paged_decode: q {tuple(q.shape)}, pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)} "
                         "(same strides, head_dim a power of two, heads a multiple of kv heads)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_pages.stride(-1) != 1:
        raise ValueError("paged_decode: pages need a unit last stride")
    out = torch.empty(N, H, D, dtype=q.dtype, device=q.device) if out is None else out
    if N == 0:
        return out
    G = H // Hk
    bn = CONFIG["BLOCK_N"]
    keys = block_table.shape[1] * page
    per_split = _cdiv(_cdiv(keys, num_splits(N, Hk, keys, q.device)), bn) * bn
    splits = _cdiv(keys, per_split)
    po = pl = out
    if splits > 1:
        po = torch.empty(N * H * splits, D, dtype=torch.float32, device=q.device)
        pl = torch.empty(N * H * splits, dtype=torch.float32, device=q.device)
    _splitkv_kernel[(N, Hk, splits)](
        q, k_pages, v_pages, block_table, seq_idx, positions, out, po, pl, scale * math.log2(math.e), per_split,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), H=H, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, PAGE=page,
        BLOCK_N=bn, SPLITS=splits, UPCAST=INTERPRET, num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"])
    if splits > 1:
        _fold_kernel[(N, H)](po, pl, out, out.stride(0), out.stride(1), H=H, D=D, SPLITS=splits,
                             SP=triton.next_power_of_2(splits), num_warps=4)
    return out
