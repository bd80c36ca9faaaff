"""Attention: one kernel for causal prefill and for decode. A query row reduces its keys in
blocks of BLOCK_N, block 0, 1, 2, ..., with the same online-softmax update; blocks past a row's
position are fully masked and change nothing, so decode == prefill bitwise. Backward (FA2-style,
no atomics): one program per key block owns dK/dV (summing the GQA heads and query blocks in
order), one per query block owns dQ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, _check, _table

# Prefill and decode share BLOCK_N (the key blocks a row reduces over, in order); their tile heights
# may differ: both use wgmma tiles (BLOCK_M >= 64), measured bitwise equal on the H200 (decode with
# BLOCK_M=16 takes mma.sync and was NOT: 3-10 of 700 positions differed). Picked by
# experiments/bench_triton.py --only attention_sweep; fp32 tiles take twice the shared memory: fewer
# stages. bf16 measured on one H200 (experiments/README.md, History): prefill 0.80x / 0.73x SDPA's
# speed at T=1024/4096, decode 1.05x / 1.07x SDPA's time at B=64/128, decode == prefill bitwise at
# 1024 positions.
ATTN_FWD = {
    torch.bfloat16: dict(BLOCK_N=64, prefill=dict(BLOCK_M=128, num_stages=3, num_warps=8),
                         decode=dict(BLOCK_M=64, num_stages=2, num_warps=4)),
    torch.float32: dict(BLOCK_N=64, prefill=dict(BLOCK_M=64, num_stages=2, num_warps=4),
                        decode=dict(BLOCK_M=64, num_stages=2, num_warps=4)),
}
ATTN_FWD[torch.float16] = ATTN_FWD[torch.bfloat16]
# bwd: the dK/dV kernel (a key block per program), bwd_dq: the dQ kernel (a query block). Any fixed
# config is deterministic; bf16 measured on one H200 (--only attention_bwd_sweep,attention_bwd):
# identical run to run, prefill fwd+bwd 0.69x / 0.65x SDPA's speed at T=1024/4096.
ATTN_BWD = {
    torch.bfloat16: dict(bwd=dict(BLOCK_M=32, BLOCK_N=64, num_stages=3, num_warps=4),
                         bwd_dq=dict(BLOCK_M=64, BLOCK_N=32, num_stages=3, num_warps=4)),
    torch.float32: dict(bwd=dict(BLOCK_M=32, BLOCK_N=64, num_stages=2, num_warps=4),
                        bwd_dq=dict(BLOCK_M=64, BLOCK_N=32, num_stages=2, num_warps=4)),
}
ATTN_BWD[torch.float16] = ATTN_BWD[torch.bfloat16]
INTERPRET_ATTN = dict(prefill=dict(BLOCK_M=32, BLOCK_N=16), decode=dict(BLOCK_M=16, BLOCK_N=16),
                      bwd=dict(BLOCK_M=16, BLOCK_N=16), bwd_dq=dict(BLOCK_M=16, BLOCK_N=16))


@triton.jit
def _attn_block(q, k_ptr, v_ptr, kbase, j0, n_keys, qpos, skn, rd, m_i, l_i, acc, qk_scale,
                BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """One key block's online-softmax update (scores in log2 units). MASKED=False is taken only for
    blocks whose keys are all valid for every tile row: the same values as the masked form (a
    where() that keeps every score), so a row's bits do not depend on which form its block took
    (the kernel runs without FMA contraction, so both forms round the same operations)."""
    rn = j0 + tl.arange(0, BLOCK_N)
    if MASKED:
        kmask = rn < n_keys
        k = tl.load(k_ptr + kbase + rn[:, None] * skn + rd[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + kbase + rn[:, None] * skn + rd[None, :], mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kbase + rn[:, None] * skn + rd[None, :])
        v = tl.load(v_ptr + kbase + rn[:, None] * skn + rd[None, :])
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(kmask[None, :] & (rn[None, :] <= qpos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, work_ptr, C, sqn, sqh, skn, skh, son, soh, qk_scale,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                 IEEE: tl.constexpr, PACK_HEADS: tl.constexpr):
    """Work item w = (q_row0, n_q, q_pos0, k_row0, n_keys). Prefill: program axis 0 is the query head
    and tile rows are positions q_pos0.. of rows q_row0..; decode (PACK_HEADS): axis 0 is the kv head
    and tile rows are its G query heads at position q_pos0 of row q_row0 (the GQA group shares one
    K/V stream). Either way each tile row attends keys k_row0.. up to its position, in BLOCK_N
    blocks, in order, through the same instructions: a row's bits depend neither on the packing nor
    on BLOCK_M (BLOCK_N is shared by prefill and decode; the tile height is not)."""
    a0 = tl.program_id(0)
    w = tl.program_id(1)
    if PACK_HEADS:  # decode: work_ptr holds the sequence lengths; sequence w's cache rows start at w*C
        n_keys = tl.load(work_ptr + w).to(tl.int32)
        q_row0 = w
        q_pos0 = n_keys - 1
        k_row0 = w * C
    else:
        q_row0 = tl.load(work_ptr + w * 5)
        n_q = tl.load(work_ptr + w * 5 + 1)
        q_pos0 = tl.load(work_ptr + w * 5 + 2)
        k_row0 = tl.load(work_ptr + w * 5 + 3)
        n_keys = tl.load(work_ptr + w * 5 + 4)
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D)
    if PACK_HEADS:
        hk = a0
        qrow = q_row0 + rm * 0
        qhead = hk * G + rm
        qpos = q_pos0 + rm * 0
        qmask = rm < G
        H = tl.num_programs(0) * G
    else:
        hk = a0 // G
        qrow = q_row0 + rm
        qhead = a0 + rm * 0
        qpos = q_pos0 + rm
        qmask = rm < n_q
        H = tl.num_programs(0)
    q = tl.load(q_ptr + qrow[:, None] * sqn + qhead[:, None] * sqh + rd[None, :], mask=qmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    kbase = k_row0 * skn + hk * skh
    n_full = (tl.minimum(q_pos0 + 1, n_keys) // BLOCK_N) * BLOCK_N  # keys every tile row may see
    for j0 in range(0, n_full, BLOCK_N):
        m_i, l_i, acc = _attn_block(q, k_ptr, v_ptr, kbase, j0, n_keys, qpos, skn, rd, m_i, l_i, acc, qk_scale,
                                    BLOCK_N, UPCAST, IEEE, False)
    for j0 in range(n_full, n_keys, BLOCK_N):
        m_i, l_i, acc = _attn_block(q, k_ptr, v_ptr, kbase, j0, n_keys, qpos, skn, rd, m_i, l_i, acc, qk_scale,
                                    BLOCK_N, UPCAST, IEEE, True)
    o = acc / l_i[:, None]
    tl.store(o_ptr + qrow[:, None] * son + qhead[:, None] * soh + rd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=qmask[:, None])
    tl.store(lse_ptr + qrow * H + qhead, m_i + tl.log2(l_i), mask=qmask)  # log2 units, for the backward


LOG2E = 1.4426950408889634


def _attn_cfg(kind: str, dtype) -> dict:
    """kind: prefill | decode | bwd. Prefill and decode share BLOCK_N (the key blocks, i.e. the
    reduction order); their tile heights and warps may differ."""
    if INTERPRET:
        return dict(INTERPRET_ATTN[kind])
    if kind in ("bwd", "bwd_dq"):
        return dict(ATTN_BWD[dtype][kind])
    return dict(BLOCK_N=ATTN_FWD[dtype]["BLOCK_N"], **ATTN_FWD[dtype][kind])


def _no_fma() -> dict:
    return {} if INTERPRET else {"enable_fp_fusion": False}


def _attn_launch(q, k, v, work, scale: float, pack_heads: bool = False, cache_len: int = 0):
    """q [R, H, D]; k, v [Rk, Hk, D] -> (o, lse2 [R, H]). Prefill: work is an int32 table of items
    (q_row0, n_q, q_pos0, k_row0, n_keys); decode (pack_heads): work is the lengths [B] and sequence
    b's cache rows start at b * cache_len."""
    R, H, D = q.shape
    if D & (D - 1) or D < 16:
        raise ValueError(f"triton attention: head_dim={D} must be a power of two >= 16")
    o = torch.empty_like(q)
    lse = torch.empty(R, H, dtype=torch.float32, device=q.device)
    if work.shape[0] == 0:
        return o, lse
    cfg = _attn_cfg("decode" if pack_heads else "prefill", q.dtype)
    G = H // k.shape[1]
    if pack_heads and G > cfg["BLOCK_M"]:
        raise ValueError(f"triton attention decode: {G} query heads per kv head exceed BLOCK_M={cfg['BLOCK_M']}")
    _attn_kernel[(k.shape[1] if pack_heads else H, work.shape[0])](
        q, k, v, o, lse, work, cache_len, q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0),
        o.stride(1), scale * LOG2E, G=G, D=D, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32,
        PACK_HEADS=pack_heads, **cfg, **_no_fma())
    return o, lse


@triton.jit
def _attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, work_ptr, H, scale, qk_scale,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Program (key block, kv head): dK, dV of its keys, summed over the G query heads and the query
    blocks in order. It owns its output rows: no atomics."""
    w = tl.program_id(0)
    hk = tl.program_id(1)
    s0 = tl.load(work_ptr + w * 3)
    T = tl.load(work_ptr + w * 3 + 1)
    n0 = tl.load(work_ptr + w * 3 + 2)
    Hk = H // G
    rn = n0 + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, D)
    kmask = rn < T
    k = tl.load(k_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
    v = tl.load(v_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    for g in range(G):
        h = hk * G + g
        for m0 in range((n0 // BLOCK_M) * BLOCK_M, T, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            qmask = rm < T
            q = tl.load(q_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None], other=0.0)
            do = tl.load(do_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None],
                         other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
            delta = tl.load(delta_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
            if IEEE:
                st = tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale  # [BN, BM], log2 units
            else:
                st = tl.dot(k, tl.trans(q)) * qk_scale
            valid = kmask[:, None] & qmask[None, :] & (rn[:, None] <= rm[None, :])
            pt = tl.where(valid, tl.exp2(st - lse[None, :]), 0.0)
            if IEEE:
                dv += tl.dot(pt, do, input_precision="ieee")
                dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
            else:
                dv += tl.dot(pt.to(do.dtype), do)
                dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            if IEEE:
                dk += tl.dot(dst, q, input_precision="ieee")
            else:
                dk += tl.dot(dst.to(q.dtype), q)
    tl.store(dk_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], (dk * scale).to(dk_ptr.dtype.element_ty),
             mask=kmask[:, None])
    tl.store(dv_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=kmask[:, None])


@triton.jit
def _attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, work_ptr, scale, qk_scale,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Program (query block, head): dQ over its keys in order."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    Hk = H // G
    hk = h // G
    s0 = tl.load(work_ptr + w * 3)
    T = tl.load(work_ptr + w * 3 + 1)
    m0 = tl.load(work_ptr + w * 3 + 2)
    rm = m0 + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D)
    qmask = rm < T
    q = tl.load(q_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None], other=0.0)
    do = tl.load(do_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], mask=qmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
    delta = tl.load(delta_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
    dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for n0 in range(0, tl.minimum(T, m0 + BLOCK_M), BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        kmask = rn < T
        k = tl.load(k_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], mask=kmask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
            dp = tl.dot(do, tl.trans(v))
        valid = qmask[:, None] & kmask[None, :] & (rn[None, :] <= rm[:, None])
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds, k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=qmask[:, None])


@triton.jit
def _rowdot(a_ptr, b_ptr, out_ptr, R, D: tl.constexpr, ROWS: tl.constexpr):
    """out[r] = sum_d a[r, d] b[r, d] in fp32 (the backward's delta = rowsum(dO * O)); one fixed
    reduction per row, whatever the number of rows."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    m = (r < R)[:, None]
    a = tl.load(a_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, tl.sum(a * b, axis=1), mask=r < R)


class _Attention(torch.autograd.Function):
    """Forward and backward in Triton; the backward owns every output row (no atomics)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ctx.cu, ctx.scale = cu_seqlens, scale
        bm = _attn_cfg("prefill", q.dtype)["BLOCK_M"]

        def items():
            work = []
            for b in range(len(cu_seqlens) - 1):
                s0, T = cu_seqlens[b], cu_seqlens[b + 1] - cu_seqlens[b]
                work += [(s0 + m0, min(bm, T - m0), m0, s0, min(T, m0 + bm)) for m0 in range(0, T, bm)]
            # longest first: the last wave is the short items; rows [0, 5) keep an empty table 2-D
            return sorted(work, key=lambda t: -t[4]) or torch.zeros(0, 5).tolist(), torch.int32

        work = _table(("attn", tuple(cu_seqlens), bm), items, q.device)
        o, lse = _attn_launch(q, k, v, work, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        g = g.contiguous().to(q.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        N, H, D = q.shape
        delta = torch.empty(N, H, dtype=torch.float32, device=q.device)
        if N:
            _rowdot[(triton.cdiv(N * H, 16),)](g, o, delta, N * H, D=D, ROWS=16)
        kv_cfg, q_cfg = _attn_cfg("bwd", q.dtype), _attn_cfg("bwd_dq", q.dtype)
        bn, bm = kv_cfg["BLOCK_N"], q_cfg["BLOCK_M"]
        cu = tuple(ctx.cu)

        def items(step, key):
            def build():
                work = []
                for b in range(len(cu) - 1):
                    s0, T = cu[b], cu[b + 1] - cu[b]
                    work += [(s0, T, i0) for i0 in range(0, T, step)]
                work.sort(key=lambda t: t[2] if key == "k" else -t[2])  # the longest loops first
                return work or torch.zeros(0, 3).tolist(), torch.int32
            return build

        kw = _table(("attn_k", cu, bn), items(bn, "k"), q.device)
        qw = _table(("attn_q", cu, bm), items(bm, "q"), q.device)
        G = H // k.shape[1]
        flags = dict(G=G, D=D, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32)
        if kw.shape[0]:
            _attn_bwd_dkdv[(kw.shape[0], k.shape[1])](q, k, v, g, lse, delta, dk, dv, kw, H, ctx.scale,
                                                       ctx.scale * LOG2E, **flags, **kv_cfg)
            _attn_bwd_dq[(qw.shape[0], H)](q, k, v, g, lse, delta, dq, qw, ctx.scale, ctx.scale * LOG2E,
                                           **flags, **q_cfg)
        return dq, dk, dv, None, None


def attention_prefill(q, k, v, cu_seqlens: list[int], scale: float):
    _check("attention_prefill", q, k, v)
    return _Attention.apply(q, k, v, list(cu_seqlens), scale)


def attention_decode(q, k_cache, v_cache, lengths, scale: float):
    """One query per sequence; the same kernel and key blocks as prefill, its tile rows holding the
    GQA group's heads, so each row's bits equal the prefill row at position lengths[b] - 1."""
    _check("attention_decode", q, k_cache, v_cache)
    B, C = k_cache.shape[0], k_cache.shape[1]
    kc = k_cache.reshape(B * C, *k_cache.shape[2:])
    vc = v_cache.reshape(B * C, *v_cache.shape[2:])
    # the lengths stay on the device (no host sync): the kernel derives each item from them
    return _attn_launch(q.contiguous(), kc, vc, lengths.to(q.device), scale, pack_heads=True, cache_len=C)[0]

