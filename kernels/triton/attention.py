"""Attention: one forward kernel for causal prefill, contiguous decode and paged rows. A query row
reduces its keys in chunks of CHUNK keys (a fixed constant), each chunk in blocks of BLOCK_N, block
0, 1, 2, ..., with the same online-softmax update from a fresh state; the chunk partials (m, l, acc)
are then folded in chunk order, 0, 1, 2, ..., by one update (_fold). Where a chunk is computed does
not change its bits: prefill tiles fold their chunks in registers; decode and paged rows either do
the same (many rows) or give each chunk its own program and fold the stored partials in a second
kernel (few rows: split-K, so a long context does not serialise on one program). Blocks past a row's
position are masked and change nothing, so decode == paged == prefill bitwise. Backward (FA2-style,
no atomics): one program per key block owns dK/dV (summing the GQA heads and query blocks in order),
one per query block owns dQ; both recompute p from the stored log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, Launch, cached, check_inputs, host_free_dot, num_sms, work_table

# The pinned configs (how each was measured on the H200: experiments/README.md, History). Prefill, decode and
# paged rows share BLOCK_N and CHUNK, the key blocks and chunks a row reduces over in order: part of the
# contract. CHUNK is a constant, never a function of the batch or the GPU: only where a chunk is computed
# (chunks_per_program) varies with them, never its bits. Tile heights may differ between the kinds: all
# are wgmma tiles (BLOCK_M >= 64; decode with BLOCK_M=16 takes mma.sync and was not bitwise equal to
# prefill). fp32 tiles take twice the shared memory: fewer stages. bf16 prefill: 64-row tiles of one
# warpgroup (two tiles' accumulators, the chunk's and the fold's, stay in registers; faster than 128-row
# tiles of 8 warps, same bits).
# decode (rows modes), none of them moves a bit: COMBINE_UNROLL, the chunk partials the split-K fold
# loads at once; PAGED_PRE_MAX, a paged program loads the block-table entries of its keys in one vector
# load before its key loop while they number at most this many (0: never), and picks each block's pages
# from them with tl.gather (num_stages PAGED_PRE_STAGES), else it loads a table entry per key
# (num_stages PAGED_STAGES: triton splits the stages between the table load and the K/V loads it feeds);
# PAGED_OFF32, a paged program's key offsets in int32 when every offset of the page pool fits (the host
# checks the view's extent; else int64); HEADS_MINOR, rows folded in registers run on a 1-D grid with a
# row's kv heads adjacent (program w * Hk + hk) instead of (row, kv head) with the rows adjacent (the kv
# heads of a key share its DRAM pages).
ATTN_FWD = {
    torch.bfloat16: dict(BLOCK_N=64, CHUNK=256, prefill=dict(BLOCK_M=64, num_stages=3, num_warps=4),
                         decode=dict(BLOCK_M=64, num_stages=3, num_warps=4, COMBINE_UNROLL=16, PAGED_PRE_MAX=256,
                                     PAGED_PRE_STAGES=3, PAGED_STAGES=5, PAGED_OFF32=True, HEADS_MINOR=True)),
    torch.float32: dict(BLOCK_N=64, CHUNK=256, prefill=dict(BLOCK_M=64, num_stages=2, num_warps=4),
                        decode=dict(BLOCK_M=64, num_stages=2, num_warps=4, COMBINE_UNROLL=16, PAGED_PRE_MAX=0,
                                    PAGED_STAGES=2, PAGED_OFF32=False)),
}
ATTN_FWD[torch.float16] = ATTN_FWD[torch.bfloat16]
# bwd: the dK/dV kernel (a key block per program), bwd_dq: the dQ kernel (a query block). Any fixed
# config is deterministic.
ATTN_BWD = {
    torch.bfloat16: dict(bwd=dict(BLOCK_M=32, BLOCK_N=64, num_stages=3, num_warps=4),
                         bwd_dq=dict(BLOCK_M=64, BLOCK_N=32, num_stages=3, num_warps=4)),
    torch.float32: dict(bwd=dict(BLOCK_M=32, BLOCK_N=64, num_stages=2, num_warps=4),
                        bwd_dq=dict(BLOCK_M=64, BLOCK_N=32, num_stages=2, num_warps=4)),
}
ATTN_BWD[torch.float16] = ATTN_BWD[torch.bfloat16]
# the interpreter: small tiles and a two-block chunk, so tiny tests cross chunk boundaries
INTERPRET_ATTN = dict(CHUNK=32, prefill=dict(BLOCK_M=32, BLOCK_N=16),
                      decode=dict(BLOCK_M=16, BLOCK_N=16, COMBINE_UNROLL=2, PAGED_PRE_MAX=256, PAGED_OFF32=True),
                      bwd=dict(BLOCK_M=16, BLOCK_N=16), bwd_dq=dict(BLOCK_M=16, BLOCK_N=16))
# The split-K schedule of decode / paged rows (chunks_per_program; the same bits whatever it picks):
# while the partials (fp32 m, l and acc [D] per row, head and chunk) number at most SPLIT_MAX_PARTIALS,
# programs take 1, 2, 4, ... chunks each, the fewest that keeps the programs under
# SPLIT_PROGRAMS_PER_SM per SM; when one program would take a whole row, or past the cap, each row
# folds its chunks in registers, as prefill does.
SPLIT_MAX_PARTIALS = 1 << 17
SPLIT_PROGRAMS_PER_SM = 2  # two 96 KB bf16 programs fit an SM


@triton.jit
def _mma(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """a @ b in fp32, the one product of every attention kernel: the interpreter's host-free dot (UPCAST: both
    operands already fp32), fp32 operands at IEEE precision, else bf16/fp16 tensor cores with a cast to b's dtype."""
    if UPCAST:
        return host_free_dot(a, b)
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _load_kv(k_ptr, v_ptr, offs, kmask, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """A block's keys and values at offs ([keys, D]); MASKED: keys outside kmask read as 0."""
    if MASKED:
        k = tl.load(k_ptr + offs, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _page_of(rn, kmask, bt_ptr, pages, p_lo, PAGE: tl.constexpr, NPRE: tl.constexpr, MASKED: tl.constexpr):
    """The page of each key rn: a table load per key (NPRE 0), or picked with tl.gather from the NPRE
    table entries p_lo.. that the program loaded before its loop (`pages`). Masked keys may get any page:
    their loads are masked."""
    if NPRE == 0:
        if MASKED:
            page = tl.load(bt_ptr + rn // PAGE, mask=kmask, other=0)
        else:
            page = tl.load(bt_ptr + rn // PAGE)
    else:
        i = rn // PAGE - p_lo
        if MASKED:
            i = tl.minimum(tl.maximum(i, 0), NPRE - 1)
        page = tl.gather(pages, i, 0)
    return page


@triton.jit
def _attn_block(q, k_ptr, v_ptr, kbase, bt_ptr, j0, n_keys, qpos, skp, skn, rd, m_i, l_i, acc, qk_scale,
                pages, p_lo, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, UPCAST: tl.constexpr,
                IEEE: tl.constexpr, MASKED: tl.constexpr, NPRE: tl.constexpr, OFF32: tl.constexpr = False):
    """One key block's online-softmax update (scores in log2 units). MASKED=False is taken only for
    blocks whose keys are all valid for every tile row: the same values as the masked form (a
    where() that keeps every score), so a row's bits do not depend on which form its block took
    (the kernel runs without FMA contraction, so both forms round the same operations). PAGED: key j
    is slot j % PAGE of page bt_ptr[j // PAGE], looked up per key (_page_of: loaded, or picked from
    the program's preloaded entries), so a block may span pages or share one (BLOCK_N and PAGE either
    way round; one lookup per page, addresses built as [pages, PAGE] and flattened, ran slower on the
    H200); otherwise key j is row kbase + j * skn."""
    rn = j0 + tl.arange(0, BLOCK_N)
    kmask = rn < n_keys
    if PAGED:
        page = _page_of(rn, kmask, bt_ptr, pages, p_lo, PAGE, NPRE, MASKED)
        if OFF32:  # every offset in the pool fits int32 (the host checks): 32-bit address math
            koff = kbase + page * skp + (rn % PAGE) * skn
        else:
            koff = kbase + page.to(tl.int64) * skp + (rn % PAGE) * skn
    else:
        koff = kbase + rn * skn
    k, v = _load_kv(k_ptr, v_ptr, koff[:, None] + rd[None, :], kmask, MASKED, UPCAST)
    s = _mma(q, tl.trans(k), UPCAST, IEEE) * qk_scale
    if MASKED:
        s = tl.where(kmask[None, :] & (rn[None, :] <= qpos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mma(p, v, UPCAST, IEEE)
    return m_new, l_i, acc


@triton.jit
def _attn_chunk(q, k_ptr, v_ptr, kbase, bt_ptr, c0, c1, n_keys, n_full, qpos, skp, skn, rd, qk_scale, pages, p_lo,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                PAGED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, NPRE: tl.constexpr,
                OFF32: tl.constexpr = False):
    """The partial (m, l, acc) of keys [c0, c1) from a fresh state, blocks in order; keys below n_full
    are valid for every tile row (unmasked blocks)."""
    m_c = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_c = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    f_end = tl.minimum(tl.maximum(n_full, c0), c1)
    for j0 in range(c0, f_end, BLOCK_N):
        m_c, l_c, acc = _attn_block(q, k_ptr, v_ptr, kbase, bt_ptr, j0, n_keys, qpos, skp, skn, rd, m_c, l_c, acc,
                                qk_scale, pages, p_lo, BLOCK_N, PAGE, PAGED, UPCAST, IEEE, False, NPRE, OFF32)
    for j0 in range(f_end, c1, BLOCK_N):
        m_c, l_c, acc = _attn_block(q, k_ptr, v_ptr, kbase, bt_ptr, j0, n_keys, qpos, skp, skn, rd, m_c, l_c, acc,
                                qk_scale, pages, p_lo, BLOCK_N, PAGE, PAGED, UPCAST, IEEE, True, NPRE, OFF32)
    return m_c, l_c, acc


@triton.jit
def _fold(M, L, A, m_c, l_c, acc, take):
    """Fold a chunk partial (m_c, l_c, acc) into the running (M, L, A) for the rows in `take`; the one
    combine of every path (registers or stored partials), in chunk order from (-inf, 0, 0)."""
    m_new = tl.maximum(M, m_c)
    a_old = tl.exp2(M - m_new)
    a_new = tl.exp2(m_c - m_new)
    L_new = L * a_old + l_c * a_new
    A_new = A * a_old[:, None] + acc * a_new[:, None]
    return tl.where(take, m_new, M), tl.where(take, L_new, L), tl.where(take[:, None], A_new, A)


@triton.jit
def _chunk_end(j, M, L, A, m_c, l_c, acc, qpos, qmask, idx0, mp_ptr, lp_ptr, ap_ptr, rd,
               BLOCK_M: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    """The chunk holding key j is done: store its partial at [row, head, chunk] (SPLIT) or fold it
    into (M, L, A); then a fresh partial, (-inf, 0, 0)."""
    c = j // CHUNK
    if SPLIT:
        tl.store(mp_ptr + idx0 + c, m_c, mask=qmask)
        tl.store(lp_ptr + idx0 + c, l_c, mask=qmask)
        tl.store(ap_ptr + (idx0 + c)[:, None] * D + rd[None, :], acc, mask=qmask[:, None])
    else:
        M, L, A = _fold(M, L, A, m_c, l_c, acc, c * CHUNK <= qpos)
    return (M, L, A, tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32), tl.zeros((BLOCK_M,), dtype=tl.float32),
            tl.zeros((BLOCK_M, D), dtype=tl.float32))


@triton.jit
def _attn_store(o_ptr, lse_ptr, M, L, A, qrow, qhead, qmask, H, son, soh, rd):
    o = A / L[:, None]
    tl.store(o_ptr + qrow[:, None] * son + qhead[:, None] * soh + rd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=qmask[:, None])
    tl.store(lse_ptr + qrow * H + qhead, M + tl.log2(L), mask=qmask)  # log2 units, for the backward


@triton.jit
def _attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, work_ptr, seq_ptr, bt_ptr, mp_ptr, lp_ptr, ap_ptr, cnt_ptr, NC, SPP,
              sqn, sqh, skp, skn, skh, son, soh, sbt, qk_scale,
              G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
              PAGE: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
              BLOCK_G: tl.constexpr = 1, UNROLL: tl.constexpr = 1, NPRE: tl.constexpr = 0, OFF32: tl.constexpr = False,
              HK_MINOR: tl.constexpr = 0):
    """MODE 0, prefill: program (query head, work item w = (q_row0, n_q, q_pos0, k_row0, n_keys)); tile
    rows are positions q_pos0.. of rows q_row0.. attending keys k_row0.. . MODE 3, paged prefill tiles:
    the same, with k_row0 replaced by a sequence id whose keys are read through its block-table row (a
    prompt chunk's rows in one tile instead of one program per row). MODE 1, decode: program
    (row w, kv head); work = lengths; row w attends keys w * skp + j * skn, j < lengths[w]. MODE 2,
    paged: program (row w, kv head); work = positions, seq_ptr = sequence ids; row w attends keys
    0..positions[w] of its sequence through block-table row bt_ptr + seq * sbt. Rows modes pack the
    kv head's G query heads into the tile rows (the GQA group shares one K/V stream). Every tile row
    reduces its keys in CHUNK chunks of BLOCK_N blocks through the same instructions, so a row's
    bits depend neither on the mode nor on BLOCK_M. SPLIT (rows modes): program z takes chunks
    [z * SPP, z * SPP + SPP), a loop per chunk, and stores each one's partial at (mp, lp, ap)[row, head,
    chunk]; the last of the row's programs to finish (a ticket counter per (row, kv head) at cnt_ptr, zero
    between launches) folds them in chunk order. Otherwise the program folds all its row's chunks here,
    in order, in one loop over the blocks with the chunk ends inside it (the same operations as a loop
    per chunk: a speed choice). NPRE > 0 (paged): the table entries of the program's keys, NPRE from page
    k_lo // PAGE, loaded before the key loop; a key's page is picked from them (_page_of)."""
    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, D)
    bt = bt_ptr
    if (MODE == 0) or (MODE == 3):
        a0 = tl.program_id(0)
        w = tl.program_id(1)
        q_row0 = tl.load(work_ptr + w * 5)
        n_q = tl.load(work_ptr + w * 5 + 1)
        q_pos0 = tl.load(work_ptr + w * 5 + 2)
        k_row0 = tl.load(work_ptr + w * 5 + 3)
        n_keys = tl.load(work_ptr + w * 5 + 4)
        hk = a0 // G
        qrow = q_row0 + rm
        qhead = a0 + rm * 0
        qpos = q_pos0 + rm
        qmask = rm < n_q
        H = tl.num_programs(0)
        if MODE == 0:
            kbase = k_row0.to(tl.int64) * skn + hk * skh
        else:  # k_row0 is the sequence: its block-table row
            bt = bt_ptr + k_row0.to(tl.int64) * sbt
            if OFF32:
                kbase = hk * skh
            else:
                kbase = hk.to(tl.int64) * skh
    else:
        if HK_MINOR > 0:  # a 1-D grid, the kv heads of a row adjacent: program (w * HK_MINOR + hk)
            w = tl.program_id(0) // HK_MINOR
            hk = tl.program_id(0) % HK_MINOR
        else:
            w = tl.program_id(0)
            hk = tl.program_id(1)
        if MODE == 1:
            n_keys = tl.load(work_ptr + w).to(tl.int32)
            kbase = w.to(tl.int64) * skp + hk * skh
        else:
            bt = bt_ptr + tl.load(seq_ptr + w).to(tl.int64) * sbt
            n_keys = tl.load(work_ptr + w).to(tl.int32) + 1
            if OFF32:
                kbase = hk * skh
            else:
                kbase = hk.to(tl.int64) * skh
        q_pos0 = n_keys - 1
        qrow = w + rm * 0
        qhead = hk * G + rm
        qpos = q_pos0 + rm * 0
        qmask = rm < G
        H = (HK_MINOR if HK_MINOR > 0 else tl.num_programs(1)) * G
    q = tl.load(q_ptr + qrow[:, None] * sqn + qhead[:, None] * sqh + rd[None, :], mask=qmask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    n_full = (tl.minimum(q_pos0 + 1, n_keys) // BLOCK_N) * BLOCK_N  # keys every tile row may see
    if SPLIT:  # chunks [c_lo, c_lo + SPP) of the row, each partial stored
        c_lo = tl.program_id(2) * SPP
        k_hi = tl.minimum((c_lo + SPP) * CHUNK, n_keys)
        idx0 = (qrow * H + qhead) * NC
        M = tl.zeros((1,), dtype=tl.float32)  # unused: the fold is _combine_rows'
        L = M
        A = M
    else:  # every chunk of the row, folded here
        c_lo = 0
        k_hi = n_keys
        idx0 = qrow * 0
        M = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        L = tl.zeros((BLOCK_M,), dtype=tl.float32)
        A = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    k_lo = c_lo * CHUNK
    p_lo = k_lo // PAGE
    if NPRE > 0:  # paged: the table entries of keys [k_lo, k_hi) in one load, before the key loop
        pi = p_lo + tl.arange(0, NPRE)
        pages = tl.load(bt + pi, mask=pi * PAGE < k_hi, other=0)
    else:
        pages = p_lo
    if not SPLIT:  # one loop over the blocks (one software pipeline), a chunk's end handled inside it
        m_c = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_c = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        f_end = tl.minimum(tl.maximum(n_full, k_lo), k_hi)
        for j0 in range(k_lo, f_end, BLOCK_N):
            m_c, l_c, acc = _attn_block(q, k_ptr, v_ptr, kbase, bt, j0, n_keys, qpos, skp, skn, rd, m_c, l_c, acc,
                                        qk_scale, pages, p_lo, BLOCK_N, PAGE, MODE >= 2, UPCAST, IEEE, False, NPRE,
                                        OFF32)
            if ((j0 + BLOCK_N) % CHUNK == 0) | (j0 + BLOCK_N >= k_hi):
                M, L, A, m_c, l_c, acc = _chunk_end(j0, M, L, A, m_c, l_c, acc, qpos, qmask, idx0, mp_ptr, lp_ptr,
                                                    ap_ptr, rd, BLOCK_M, D, CHUNK, SPLIT)
        for j0 in range(f_end, k_hi, BLOCK_N):
            m_c, l_c, acc = _attn_block(q, k_ptr, v_ptr, kbase, bt, j0, n_keys, qpos, skp, skn, rd, m_c, l_c, acc,
                                        qk_scale, pages, p_lo, BLOCK_N, PAGE, MODE >= 2, UPCAST, IEEE, True, NPRE,
                                        OFF32)
            if ((j0 + BLOCK_N) % CHUNK == 0) | (j0 + BLOCK_N >= k_hi):
                M, L, A, m_c, l_c, acc = _chunk_end(j0, M, L, A, m_c, l_c, acc, qpos, qmask, idx0, mp_ptr, lp_ptr,
                                                    ap_ptr, rd, BLOCK_M, D, CHUNK, SPLIT)
    else:  # a loop per chunk
        for c0 in range(k_lo, k_hi, CHUNK):
            m_c, l_c, acc = _attn_chunk(q, k_ptr, v_ptr, kbase, bt, c0, tl.minimum(c0 + CHUNK, k_hi), n_keys, n_full,
                                        qpos, skp, skn, rd, qk_scale, pages, p_lo, BLOCK_M, BLOCK_N, D, PAGE,
                                        MODE >= 2, UPCAST, IEEE, NPRE, OFF32)
            M, L, A, m_c, l_c, acc = _chunk_end(c0, M, L, A, m_c, l_c, acc, qpos, qmask, idx0, mp_ptr, lp_ptr, ap_ptr,
                                                rd, BLOCK_M, D, CHUNK, SPLIT)
    if not SPLIT:
        _attn_store(o_ptr, lse_ptr, M, L, A, qrow, qhead, qmask, H, son, soh, rd)
    else:  # the program that stores the row's last partial folds them all (no second kernel)
        tl.debug_barrier()  # every thread's partial stores precede the release below (CTA barrier + gpu release)
        done = tl.atomic_add(cnt_ptr + w * tl.num_programs(1) + hk, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(2) - 1:
            _combine_rows(mp_ptr, lp_ptr, ap_ptr, o_ptr, lse_ptr, w, hk, n_keys, NC, H, son, soh, G, D, BLOCK_G,
                          CHUNK, UNROLL)
            tl.store(cnt_ptr + w * tl.num_programs(1) + hk, 0)  # reset for the next launch (or graph replay)


@triton.jit
def _combine_rows(mp_ptr, lp_ptr, ap_ptr, o_ptr, lse_ptr, w, hk, n_keys, NC, H, son, soh, G: tl.constexpr,
                  D: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr, UNROLL: tl.constexpr):
    """Fold row w's stored chunk partials of kv head hk's G heads in chunk order, then normalise: the
    same _fold and _attn_store as the in-register path. Loads bypass L1 (.cg): other programs of this
    launch wrote them."""
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, D)
    gmask = rg < G
    qrow = w + rg * 0
    qhead = hk * G + rg
    qpos = n_keys - 1 + rg * 0
    idx0 = (qrow * H + qhead) * NC
    M = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    L = tl.zeros((BLOCK_G,), dtype=tl.float32)
    A = tl.zeros((BLOCK_G, D), dtype=tl.float32)
    n_c = tl.cdiv(n_keys, CHUNK)
    for c0 in range(0, n_c, UNROLL):  # UNROLL chunks' loads in flight at once; chunks past n_c not taken
        for i in tl.static_range(UNROLL):
            c = c0 + i
            ok = gmask & (c + rg * 0 < n_c)
            m_c = tl.load(mp_ptr + idx0 + c, mask=ok, other=0.0, cache_modifier=".cg")
            l_c = tl.load(lp_ptr + idx0 + c, mask=ok, other=0.0, cache_modifier=".cg")
            acc = tl.load(ap_ptr + (idx0 + c)[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0,
                          cache_modifier=".cg")
            M, L, A = _fold(M, L, A, m_c, l_c, acc, c * CHUNK <= qpos)
    _attn_store(o_ptr, lse_ptr, M, L, A, qrow, qhead, gmask, H, son, soh, rd)


LOG2E = 1.4426950408889634


def _attn_cfg(kind: str, dtype) -> dict:
    """kind: prefill | decode | bwd | bwd_dq. Forward kinds share BLOCK_N and CHUNK (the reduction
    order); their tile heights and warps may differ."""
    if INTERPRET:
        cfg = dict(INTERPRET_ATTN[kind])
        return cfg if kind.startswith("bwd") else dict(cfg, CHUNK=INTERPRET_ATTN["CHUNK"])
    if kind in ("bwd", "bwd_dq"):
        return dict(ATTN_BWD[dtype][kind])
    return dict(BLOCK_N=ATTN_FWD[dtype]["BLOCK_N"], CHUNK=ATTN_FWD[dtype]["CHUNK"], **ATTN_FWD[dtype][kind])


def _no_fma() -> dict:
    return {} if INTERPRET else {"enable_fp_fusion": False}


def _head_dim_ok(D: int) -> None:
    if D & (D - 1) or D < 16:
        raise ValueError(f"triton attention: head_dim={D} must be a power of two >= 16")


_FWD_DEFAULTS = dict(BLOCK_G=1, UNROLL=1, NPRE=0, OFF32=False, HK_MINOR=0)  # _attn_fwd's constexpr defaults


def _fwd(grid: tuple, tensors: tuple, scalars: tuple, meta: dict) -> None:
    """_attn_fwd[grid](*tensors, *scalars, **meta) through a cached launch plan: triton's binding and
    specialisation once per (grid, scalars, constexprs, dtypes), not at every call (an eager engine step
    calls it in every layer); the same compiled kernel and arguments as the JIT path."""
    meta = {**_FWD_DEFAULTS, **meta}
    key = ("attn_fwd", tuple(grid), tuple(scalars), tuple(sorted(meta.items())), tuple(t.dtype for t in tensors))
    cached(key, lambda: Launch(_attn_fwd, grid, scalars, meta))(*tensors)


def _attn_prefill_launch(q, k, v, work, scale: float):
    """q [R, H, D]; k, v [Rk, Hk, D]; work an int32 table of items (q_row0, n_q, q_pos0, k_row0,
    n_keys) -> (o, lse2 [R, H])."""
    R, H, D = q.shape
    _head_dim_ok(D)
    o = torch.empty_like(q)
    lse = torch.empty(R, H, dtype=torch.float32, device=q.device)
    if work.shape[0] == 0:
        return o, lse
    cfg = _attn_cfg("prefill", q.dtype)
    _fwd((H, work.shape[0], 1), (q, k, v, o, lse, work, work, work, o, o, o, o),
         (1, 1, q.stride(0), q.stride(1), 0, k.stride(0), k.stride(1), o.stride(0), o.stride(1), 0, scale * LOG2E),
         dict(G=H // k.shape[1], D=D, PAGE=1, MODE=0, SPLIT=False, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32,
              **cfg, **_no_fma()))
    return o, lse


def chunks_per_program(N: int, H: int, Hk: int, nc: int, device) -> int:
    """The split-K schedule of N rows with nc key chunks: 0 = each program folds its row's chunks in
    registers; k >= 1 = each program stores the partials of k chunks and the row's last program folds
    them. Only where chunks are computed depends on this (bits never do): enough programs to fill the
    GPU, few enough that each streams several chunks."""
    if N * H * nc > SPLIT_MAX_PARTIALS:
        return 0
    target = SPLIT_PROGRAMS_PER_SM * num_sms(device)
    spp = 1
    while spp < nc and N * Hk * triton.cdiv(nc, spp) > target:
        spp *= 2
    return 0 if spp >= nc else spp


def _max_offset(t: torch.Tensor) -> int:
    """One past the largest element offset a view addresses (0 when empty)."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


_PAGED = ("PAGED_PRE_MAX", "PAGED_PRE_STAGES", "PAGED_STAGES", "PAGED_OFF32")  # decode config keys of paged rows


def _paged_flags(paged: dict, cfg: dict, k, page: int, spp: int, n_keys_max: int) -> dict:
    """The kernel flags of paged rows from their settings `paged` (see ATTN_FWD): NPRE (table entries
    preloaded) and OFF32 (int32 key offsets); sets cfg's num_stages for them."""
    chunk = cfg["CHUNK"]
    flags = {}
    if paged["PAGED_OFF32"] and _max_offset(k) < 2**31:  # every key offset fits int32: cheaper address math
        flags["OFF32"] = True
    span = spp * chunk if spp else n_keys_max  # a split program's keys, else the whole row
    npre = triton.next_power_of_2(triton.cdiv(span, page) + (0 if spp == 0 or chunk % page == 0 else 1))
    stages = paged["PAGED_STAGES"]
    if npre <= paged["PAGED_PRE_MAX"]:  # the table entries a program's keys need, loaded at once before its key loop
        flags["NPRE"] = npre
        stages = paged["PAGED_PRE_STAGES"]
    if stages:
        cfg["num_stages"] = stages
    return flags


def _attn_rows_launch(q, k, v, mode: int, work, seq, table, page: int, key_strides, n_keys_max: int, scale: float):
    """Rows modes (1 decode, 2 paged) of _attn_fwd: one query row per item, its G heads in the tile.
    Few rows: split-K (programs over chunks, the last one of a row folds them); many: chunks folded in
    registers."""
    N, H, D = q.shape
    _head_dim_ok(D)
    Hk = k.shape[-2]
    G = H // Hk
    o = torch.empty_like(q)
    lse = torch.empty(N, H, dtype=torch.float32, device=q.device)
    if N == 0:
        return o, lse
    cfg = _attn_cfg("decode", q.dtype)
    if G > cfg["BLOCK_M"]:
        raise ValueError(f"triton attention decode: {G} query heads per kv head exceed BLOCK_M={cfg['BLOCK_M']}")
    unroll = cfg.pop("COMBINE_UNROLL")
    heads_minor = cfg.pop("HEADS_MINOR", False)
    paged = {key: cfg.pop(key, None) for key in _PAGED}
    nc = triton.cdiv(max(n_keys_max, 1), cfg["CHUNK"])
    spp = chunks_per_program(N, H, Hk, nc, q.device)
    flags = dict(G=G, D=D, PAGE=page, MODE=mode, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32, **_no_fma())
    if mode == 2:
        flags.update(_paged_flags(paged, cfg, k, page, spp, n_keys_max))
    args = (q.stride(0), q.stride(1), *key_strides, o.stride(0), o.stride(1), table.stride(0), scale * LOG2E)
    if not spp:
        grid, minor = ((N * Hk, 1, 1), Hk) if heads_minor else ((N, Hk, 1), 0)
        _fwd(grid, (q, k, v, o, lse, work, seq, table, o, o, o, o), (nc, 1, *args),
             dict(SPLIT=False, HK_MINOR=minor, **flags, **cfg))
        return o, lse
    R = N * H * nc
    part = torch.empty(R * (D + 2), dtype=torch.float32, device=q.device)  # acc [R, D], m [R], l [R]
    ap, mp, lp = part[: R * D], part[R * D : R * (D + 1)], part[R * (D + 1) :]
    _fwd((N, Hk, triton.cdiv(nc, spp)), (q, k, v, o, lse, work, seq, table, mp, lp, ap, _tickets(N * Hk, q.device)),
         (nc, spp, *args), dict(SPLIT=True, BLOCK_G=triton.next_power_of_2(G), UNROLL=unroll, **flags, **cfg))
    return o, lse


_TICKETS: dict = {}  # device -> int32 counters of the split-K fold, zero between launches (each one resets its own)


def ticket_buffers() -> list[torch.Tensor]:
    """The split-K fold's counter buffers, one per device (a CUDA graph reads them by address)."""
    return list(_TICKETS.values())


def _tickets(n: int, device) -> torch.Tensor:
    """n zeroed int32 counters for one split-K launch: a buffer kept per device, grown outside graph
    capture; a capture that needs more than it holds gets its own zeroed counters (a memset node of
    that graph). Launches that share the buffer must not run at once on two streams."""
    buf = _TICKETS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    buf = _TICKETS[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return buf


@triton.jit
def _dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, s0, T, m0, h, H, rn, rd, kmask, qk_scale,
                D: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                MASKED: tl.constexpr):
    """Query block m0's terms of dK, dV (added in place of the running sums). MASKED=False only for blocks
    where every (key, query) pair is valid (no row past T, every query at or past every key): no masks, no
    where."""
    rm = m0 + tl.arange(0, BLOCK_M)
    qrow = (s0 + rm)[:, None] * (H * D) + h * D + rd[None, :]
    if MASKED:
        qmask = rm < T
        q = tl.load(q_ptr + qrow, mask=qmask[:, None], other=0.0)
        do = tl.load(do_ptr + qrow, mask=qmask[:, None], other=0.0)
        lse = tl.load(lse_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
        delta = tl.load(delta_ptr + (s0 + rm) * H + h, mask=qmask, other=0.0)
    else:
        q = tl.load(q_ptr + qrow)
        do = tl.load(do_ptr + qrow)
        lse = tl.load(lse_ptr + (s0 + rm) * H + h)
        delta = tl.load(delta_ptr + (s0 + rm) * H + h)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    st = _mma(k, tl.trans(q), UPCAST, IEEE) * qk_scale  # [BN, BM], log2 units
    pt = tl.exp2(st - lse[None, :])
    if MASKED:
        pt = tl.where(kmask[:, None] & qmask[None, :] & (rn[:, None] <= rm[None, :]), pt, 0.0)
    dv += _mma(pt, do, UPCAST, IEEE)
    dst = pt * (_mma(v, tl.trans(do), UPCAST, IEEE) - delta[None, :])
    dk += _mma(dst, q, UPCAST, IEEE)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, work_ptr, H, scale, qk_scale,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Program (key block, kv head): dK, dV of its keys, summed over the query blocks in order and, per
    block, its G query heads in order. It owns its output rows: no atomics. The (block, head) pairs run in
    three flat loops, in order: the blocks the causal diagonal crosses (masked), the full ones (unmasked),
    the last one where it runs past T (masked); which loop a block takes depends on the sequence alone. One
    loop per kind, not a loop per head around them: the heads share the loop's pipeline (no prologue per
    head, no spills)."""
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
    m_lo = (n0 // BLOCK_M) * BLOCK_M
    # full blocks: m0 >= the block's last key (causal) and m0 + BLOCK_M <= T, with every key < T
    f_lo = tl.minimum(tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, T)
    f_hi = f_lo
    if n0 + BLOCK_N <= T:
        f_hi = tl.maximum(f_lo, (T // BLOCK_M) * BLOCK_M)
    # (query block, head) pairs, the heads of a block adjacent: one loop (one pipeline) per kind of block
    for i in range(0, tl.cdiv(f_lo - m_lo, BLOCK_M) * G):
        dk, dv = _dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, s0, T, m_lo + (i // G) * BLOCK_M,
                             hk * G + i % G, H, rn, rd, kmask, qk_scale, D, BLOCK_M, UPCAST, IEEE, True)
    for i in range(0, ((f_hi - f_lo) // BLOCK_M) * G):
        dk, dv = _dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, s0, T, f_lo + (i // G) * BLOCK_M,
                             hk * G + i % G, H, rn, rd, kmask, qk_scale, D, BLOCK_M, UPCAST, IEEE, False)
    for i in range(0, tl.cdiv(T - f_hi, BLOCK_M) * G):
        dk, dv = _dkdv_block(k, v, dk, dv, q_ptr, do_ptr, lse_ptr, delta_ptr, s0, T, f_hi + (i // G) * BLOCK_M,
                             hk * G + i % G, H, rn, rd, kmask, qk_scale, D, BLOCK_M, UPCAST, IEEE, True)
    tl.store(dk_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], (dk * scale).to(dk_ptr.dtype.element_ty),
             mask=kmask[:, None])
    tl.store(dv_ptr + (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=kmask[:, None])


@triton.jit
def _dq_block(q, do, dq, lse, delta, k_ptr, v_ptr, s0, T, n0, hk, Hk, rm, rd, qk_scale, D: tl.constexpr,
              BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """Key block n0's term of dQ. MASKED=False only for blocks whose keys are all below T and at or before
    every query of the block (a query row past T computes values that are never stored)."""
    rn = n0 + tl.arange(0, BLOCK_N)
    kmask = rn < T
    k, v = _load_kv(k_ptr, v_ptr, (s0 + rn)[:, None] * (Hk * D) + hk * D + rd[None, :], kmask, MASKED, UPCAST)
    s = _mma(q, tl.trans(k), UPCAST, IEEE) * qk_scale
    dp = _mma(do, tl.trans(v), UPCAST, IEEE)
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where((rm[:, None] < T) & kmask[None, :] & (rn[None, :] <= rm[:, None]), p, 0.0)
    ds = p * (dp - delta[:, None])
    dq += _mma(ds, k, UPCAST, IEEE)
    return dq


@triton.jit
def _attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, work_ptr, scale, qk_scale,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Program (query block, head): dQ over its keys in order: the key blocks before the causal diagonal
    (unmasked), then those it crosses (masked)."""
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
    n_hi = tl.minimum(T, m0 + BLOCK_M)
    n_full = ((m0 + 1) // BLOCK_N) * BLOCK_N  # the blocks whose keys are all <= m0 (so below T)
    for n0 in range(0, n_full, BLOCK_N):
        dq = _dq_block(q, do, dq, lse, delta, k_ptr, v_ptr, s0, T, n0, hk, Hk, rm, rd, qk_scale, D, BLOCK_N, UPCAST,
                       IEEE, False)
    for n0 in range(n_full, n_hi, BLOCK_N):
        dq = _dq_block(q, do, dq, lse, delta, k_ptr, v_ptr, s0, T, n0, hk, Hk, rm, rd, qk_scale, D, BLOCK_N, UPCAST,
                       IEEE, True)
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

        work = work_table(("attn", tuple(cu_seqlens), bm), items, q.device)
        o, lse = _attn_prefill_launch(q, k, v, work, scale)
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

        kw = work_table(("attn_k", cu, bn), items(bn, "k"), q.device)
        qw = work_table(("attn_q", cu, bm), items(bm, "q"), q.device)
        G = H // k.shape[1]
        flags = dict(G=G, D=D, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32)
        if kw.shape[0]:
            _attn_bwd_dkdv[(kw.shape[0], k.shape[1])](q, k, v, g, lse, delta, dk, dv, kw, H, ctx.scale,
                                                       ctx.scale * LOG2E, **flags, **kv_cfg)
            _attn_bwd_dq[(qw.shape[0], H)](q, k, v, g, lse, delta, dq, qw, ctx.scale, ctx.scale * LOG2E,
                                           **flags, **q_cfg)
        return dq, dk, dv, None, None


def attention_prefill(q, k, v, cu_seqlens: list[int], scale: float):
    check_inputs("attention_prefill", q, k, v)
    return _Attention.apply(q, k, v, list(cu_seqlens), scale)


def _same_layout(k, v):
    """k and v addressed by one set of strides, the head dim contiguous (views are kept: no copy of
    a cache unless its layout asks for one)."""
    if k.stride() == v.stride() and k.stride(-1) == 1:
        return k, v
    return k.contiguous(), v.contiguous()


def attention_decode(q, k_cache, v_cache, lengths, scale: float):
    """One query per sequence; the same key blocks, chunks and fold as prefill, its tile rows holding
    the GQA group's heads, so each row's bits equal the prefill row at position lengths[b] - 1."""
    check_inputs("attention_decode", q, k_cache, v_cache)
    kc, vc = _same_layout(k_cache, v_cache)
    # the lengths stay on the device (no host sync): the kernel derives each row's keys from them
    lengths = lengths.to(q.device)
    return _attn_rows_launch(q.contiguous(), kc, vc, 1, lengths, lengths, lengths, 1, kc.stride()[:3],
                             kc.shape[1], scale)[0]


def attention_paged(q, k_pages, v_pages, block_table, seq_idx, positions, scale: float, runs=None):
    """Rows of any sequences (prefill chunks, chunks after a cached prefix, decode rows, in any mix)
    against pages [P, page_size, Hk, D] through block_table [S, max_pages]: row n attends keys
    0..positions[n] of sequence seq_idx[n], key j at slot j % page_size of page
    block_table[s, j // page_size], in the key blocks, chunks and fold of prefill, so each row's bits
    equal the prefill row at that position. No host sync: seq_idx and positions are read on the device.
    Slots past a row's position (unwritten, stale, NaN) are never loaded for it. runs (host, optional):
    (row0, n, pos0, seq) per prompt chunk, covering rows runs[0][0]..N-1 in order: rows row0.. are
    positions pos0.. of sequence seq (what seq_idx and positions say); those rows run as prefill tiles
    (MODE 3), the rows before them one program per row. The same bits either way."""
    check_inputs("attention_paged", q, k_pages, v_pages)
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"triton attention_paged: k_pages {tuple(k_pages.shape)} and v_pages "
                         f"{tuple(v_pages.shape)} must both be [num_pages, page_size, num_kv_heads, head_dim]")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"triton attention_paged: block_table must be an int32/int64 [S, max_pages] tensor, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if q.shape[0] == 0:
        return q.clone()
    kp, vp = _same_layout(k_pages, v_pages)
    table = (block_table if block_table.stride(1) == 1 else block_table.contiguous()).to(q.device)
    page, q = kp.shape[1], q.contiguous()
    n_keys_max = table.shape[1] * page
    split = _check_runs(runs, q.shape[0])
    if split is None:
        return _attn_rows_launch(q, kp, vp, 2, positions.to(q.device), seq_idx.to(q.device), table, page,
                                 kp.stride()[:3], n_keys_max, scale)[0]
    o = torch.empty_like(q)
    if split > 0:
        o[:split] = _attn_rows_launch(q[:split], kp, vp, 2, positions[:split].to(q.device),
                                      seq_idx[:split].to(q.device), table, page, kp.stride()[:3], n_keys_max, scale)[0]
    _attn_tiles_launch(q, kp, vp, table, runs, o, scale)
    return o


def _check_runs(runs, N: int) -> int | None:
    """The first row that `runs` covers (None without runs: every row runs alone); runs must be
    consecutive, non-empty and end at row N."""
    if not runs:
        return None
    end = runs[0][0]
    for row0, n, _, _ in runs:
        if row0 != end or n < 1:
            raise ValueError(f"triton attention_paged: runs must be consecutive non-empty row ranges, got {runs[:4]}")
        end += n
    if end != N or runs[0][0] < 0:
        raise ValueError(f"triton attention_paged: runs cover rows {runs[0][0]}..{end - 1}, not the last rows of {N}")
    return runs[0][0]


def _attn_tiles_launch(q, kp, vp, table, runs, o, scale: float) -> None:
    """MODE 3: each run's rows in prefill tiles of BLOCK_M rows, keys through the run's block-table row;
    the work table built once per step (every layer's call hits the cache)."""
    N, H, D = q.shape
    Hk = kp.shape[-2]
    cfg = _attn_cfg("prefill", q.dtype)
    bm = cfg["BLOCK_M"]

    def items():
        work = [(r0 + i, min(bm, n - i), p0 + i, s, p0 + min(i + bm, n))
                for r0, n, p0, s in runs for i in range(0, n, bm)]
        return sorted(work, key=lambda t: -t[4]), torch.int32  # longest first: the last wave is the short items

    work = work_table(("paged_tiles", tuple(runs), bm), items, q.device)
    lse = torch.empty(N, H, dtype=torch.float32, device=q.device)
    flags = {"OFF32": True} if _max_offset(kp) < 2**31 else {}
    _fwd((H, work.shape[0], 1), (q, kp, vp, o, lse, work, work, table, o, o, o, o),
         (1, 1, q.stride(0), q.stride(1), *kp.stride()[:3], o.stride(0), o.stride(1), table.stride(0), scale * LOG2E),
         dict(G=H // Hk, D=D, PAGE=kp.shape[1], MODE=3, SPLIT=False, UPCAST=INTERPRET, IEEE=q.dtype == torch.float32,
              **flags, **cfg, **_no_fma()))
