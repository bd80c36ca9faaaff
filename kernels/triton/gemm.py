"""Matmul, linear and the grouped (expert) GEMM: ONE persistent kernel over a table of problems.

Every output element reduces K in BLOCK_K chunks, in order, with the same tl.dot for every M: a
pinned config per dtype and M bucket, never autotuned. Linear forward, both backward GEMMs and the
grouped expert GEMMs (forward, dX, dW: one launch each, no atomics) use it. Backward operands are
read in place (M- or N-contiguous), never transposed copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, SUPPORTED, Launch, cached, check_inputs, host_free_dot, host_table, num_sms
from .elementwise import silu_mul, swiglu_halves
from .gemm_configs import (
    GROUPED_SHORT_K,
    GROUPED_SMALL_M,
    GROUPED_WGRAD,
    INTERPRET_MATMUL,
    INTERPRET_SMALL_M,
    MATMUL_CONFIGS,
    MATMUL_PAST_SMALL_M,
    MATMUL_SMALL_M,
)


@triton.jit
def _tile(a_base, b_base, c_base, idx_ptr, s_p, m0, pid_n, M, K, N_t, sam, sak, sbk, sbn, ldc, scn,
          a_desc, b_desc, a_row, b_row,
          BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
          EVEN_K: tl.constexpr, A_M_CONTIG: tl.constexpr, B_N_CONTIG: tl.constexpr, MASK_M: tl.constexpr,
          GATHER: tl.constexpr, SWIGLU: tl.constexpr, TMA: tl.constexpr):
    """C[m0 : m0 + BM, pid_n's BLOCK_N columns] of one problem (_gemm_kernel's flags): K in BLOCK_K chunks, in
    order, through one fp32 accumulator; a row's bits do not depend on BM. SWIGLU: B's N_t columns are
    [gate | up] (N_t / 2 each) and the tile owns output columns n0 .. n0 + BLOCK_N / 2 (n0 = pid_n BLOCK_N / 2)
    of swiglu(gate, up): its accumulator's first half holds gate columns n0.., its second half up columns
    N_t / 2 + n0.. (the same K chunks and MMA chain per element as the plain GEMM's), rounded to C's dtype as the
    plain store rounds, then silu_mul's fp32 formula and a second rounding: swiglu_halves of the plain output.
    TMA (not with SWIGLU): A's [BM, BLOCK_K] and B's [BLOCK_N, BLOCK_K] chunks come through the tensor descriptors
    a_desc / b_desc (K-contiguous, over the whole operands: the problem's rows start at a_row / b_row), the same
    values into the same tl.dot."""
    rm = m0 + tl.arange(0, BM)
    ram = tl.where(rm < M, rm, 0)  # rows past M read row 0: computed, never stored
    if SWIGLU:
        half = N_t // 2
        rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # the output columns
        j = tl.arange(0, BLOCK_N)
        rbn = pid_n * (BLOCK_N // 2) + j % (BLOCK_N // 2)
        rbn = tl.where(rbn < half, rbn + tl.where(j < BLOCK_N // 2, 0, half), 0)
        N_out = half
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rbn = tl.where(rn < N_t, rn, 0)
        N_out = N_t
    if A_M_CONTIG:
        ram = tl.max_contiguous(tl.multiple_of(ram, 16), 16)
    if GATHER > 0:
        ram = tl.load(idx_ptr + s_p + ram) // GATHER
    if B_N_CONTIG:
        rbn = tl.max_contiguous(tl.multiple_of(rbn, 16), 16)
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in order, BLOCK_K at a time: the same for every M
        rk = k0 + tl.arange(0, BLOCK_K)
        if TMA:  # rows past M, columns past N_t: the next problem's or zeros (past the operand), never stored
            a = a_desc.load([a_row + m0, k0])
            b = b_desc.load([b_row + pid_n * BLOCK_N, k0]).T  # K past the operand's: zeros, as the masked loads
        elif EVEN_K:
            if MASK_M:
                a = tl.load(a_base + ram[:, None] * sam + rk[None, :] * sak, mask=rm[:, None] < M, other=0.0)
            else:
                a = tl.load(a_base + ram[:, None] * sam + rk[None, :] * sak)
            b = tl.load(b_base + rk[:, None] * sbk + rbn[None, :] * sbn)
        else:
            if MASK_M:
                a = tl.load(a_base + ram[:, None] * sam + rk[None, :] * sak,
                            mask=(rk[None, :] < K) & (rm[:, None] < M), other=0.0)
            else:
                a = tl.load(a_base + ram[:, None] * sam + rk[None, :] * sak, mask=rk[None, :] < K, other=0.0)
            b = tl.load(b_base + rk[:, None] * sbk + rbn[None, :] * sbn, mask=rk[:, None] < K, other=0.0)
        if UPCAST:
            acc += host_free_dot(a, b)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out = acc.to(c_base.dtype.element_ty)
    if SWIGLU:
        gate, up = tl.split(tl.permute(tl.reshape(out, (BM, 2, BLOCK_N // 2)), (0, 2, 1)))
        out = silu_mul(gate, up).to(c_base.dtype.element_ty)
    mask = (rm[:, None] < M) & (rn[None, :] < N_out)
    tl.store(c_base + rm[:, None] * ldc + rn[None, :] * scn, out, mask=mask)


# Shape ints that change with the batch (tiles, rows, tokens) are not specialised: triton would
# otherwise compile a new variant whenever one of them turns divisible by 16 (or equals 1), i.e.
# in the middle of a run, each new batch composition adding seconds of compilation. The layout
# hints that matter are the constexpr flags below, decided by the host.
@triton.jit(do_not_specialize=["num_tiles", "M1", "K1", "R", "a_rows", "b_rows"])
def _gemm_kernel(a_ptr, b_ptr, c_ptr, prob_ptr, idx_ptr, num_tiles, N, M1, K1, sam, sak, sbk, sbn, scm, scn,
                 R, a_step, b_step, b_e, c_step, c_e, a_rows, b_rows,
                 P: tl.constexpr, P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, UPCAST: tl.constexpr,
                 IEEE: tl.constexpr, ALIGNED: tl.constexpr, EVEN_K: tl.constexpr, A_M_CONTIG: tl.constexpr,
                 B_N_CONTIG: tl.constexpr, SINGLE: tl.constexpr, COUNTS: tl.constexpr, GROUP_K: tl.constexpr,
                 FLATTEN: tl.constexpr, PER_N: tl.constexpr, MASK_M: tl.constexpr, GATHER: tl.constexpr,
                 HALF_TAIL: tl.constexpr, SWIGLU: tl.constexpr, TMA: tl.constexpr):
    """Persistent GEMM over P problems (P = 1: a plain matmul; P = experts: the grouped expert GEMM).
    Problem p (a row of prob_ptr: first tile, M_p, K_p, a_off, b_off, c_off) is
    C[c_off + m, n] = sum_k A[a_off + m, k] B[b_off + k, n]. Every output element reduces its K_p
    in BLOCK_K chunks, in order, with the same tl.dot: a row's bits depend on its own data only,
    never on M_p, on the other problems or on which program computed it. Operands come in any
    strides (K-, M- or N-contiguous); the host says which hints hold (EVEN_K: every K_p is a multiple
    of BLOCK_K, so K needs no mask; A_M_CONTIG / B_N_CONTIG: that dim is contiguous and a multiple of
    16 long, so clamped rows never split a vector). SINGLE: one problem given as M1, K1 (no table);
    the same tiles and instructions.

    COUNTS: the problem table is built here, on the device, from prob_ptr = the P group sizes (rows
    sorted by group; R rows in all, sizes clamped to them): group p starts at row s_p = c_0 + ... +
    c_{p-1}; M_p = c_p, K_p = K1 (GROUP_K: M_p = M1, K_p = c_p, the weight gradient), a_off = s_p a_step,
    b_off = s_p b_step + p b_e, c_off = s_p c_step + p c_e. The tiles run up to their total, computed
    here; the grid is a bound the host knows without reading the sizes (no host sync).
    GATHER = g > 0 (COUNTS, not GROUP_K): sorted row s_p + i of A is row idx[s_p + i] // g of a_ptr (its step
    0; idx: the dispatch order of (token, slot) rows, g: the slots per token): the MoE's token rows read in
    place, the same values as from a gathered copy, hence the same bits.

    PER_N (table mode): each row also holds the problem's own N_p and C row stride ldc_p (rows of 8:
    first tile, M_p, K_p, a_off, b_off, c_off, N_p, ldc_p); N and scm are then unused. Several
    linears of one input (q, k, v) in one launch: b_off places each weight relative to b_ptr.
    MASK_M: A rows past M are masked loads (zeros) instead of reads of row 0 (scheduling only: those
    rows are never stored, a row's MMAs ignore the other rows).
    SWIGLU (no PER_N): B's N columns are [gate | up] and C [*, N / 2] receives swiglu(gate, up) of the product
    rounded to C's dtype (_tile): the bits of swiglu_halves over the plain GEMM's output, without writing it.

    Scheduling only (never the bits): NUM_SMS is the number of persistent programs (the grid), FLATTEN
    lets triton pipeline the loads of a program's next tile under its current one (one loop over (tile, K
    chunk)); each tile still runs its own K chunks in order. HALF_TAIL: a problem's last M tile holding at most
    BLOCK_M / 2 rows runs as a tile BLOCK_M / 2 high (the same K chunks and MMA chain: its rows' bits are the
    full tile's, at about half the MMAs).

    TMA (both operands K-contiguous, rows of a 16-byte multiple, 16-byte aligned bases, every offset a whole number
    of rows, one K = K1, no GATHER; the host checks): the chunks reach shared memory through tensor descriptors
    (the copy engine) over the operands' a_rows (b_rows) x K1 elements, made once per program; the same K chunks
    into the same tl.dot, so the same bits. Rows past M_p (columns past N_p) read the next problem's or zeros and
    are never stored."""
    pid = tl.program_id(0)
    a_desc = a_ptr
    b_desc = b_ptr
    a_half = a_ptr
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[a_rows, K1], strides=[sam, 1], block_shape=[BLOCK_M, BLOCK_K])
        if HALF_TAIL:
            a_half = tl.make_tensor_descriptor(a_ptr, shape=[a_rows, K1], strides=[sam, 1],
                                               block_shape=[BLOCK_M // 2, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[b_rows, K1], strides=[sbn, 1], block_shape=[BLOCK_N, BLOCK_K])
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    if COUNTS:
        pr = tl.arange(0, P2)
        cnt = tl.maximum(tl.load(prob_ptr + pr, mask=pr < P, other=0).to(tl.int32), 0)
        csum = tl.cumsum(cnt, 0)
        ends = tl.minimum(csum, R)
        starts = tl.minimum(csum - cnt, R)  # a group past R rows is cut at R, never moved onto the one before
        cnt = ends - starts
        if GROUP_K:
            tiles = tl.where(pr < P, tl.cdiv(M1, BLOCK_M) * num_pid_n, 0)
        else:
            tiles = tl.cdiv(cnt, BLOCK_M) * num_pid_n
        firsts = tl.cumsum(tiles, 0) - tiles  # past P: the total, beyond every tile
        num_tiles = tl.sum(tiles, 0)
    elif not SINGLE:
        pr = tl.arange(0, P2)
        firsts = tl.load(prob_ptr + pr * (8 if PER_N else 6), mask=pr < P, other=num_tiles)
    for tile in tl.range(pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        if COUNTS:
            p = tl.sum((firsts <= tile).to(tl.int32), 0) - 1  # the last group starting at or before it
            here = pr == p
            local = tile - tl.sum(tl.where(here, firsts, 0), 0)
            s_p = tl.sum(tl.where(here, starts, 0), 0)
            c_p = tl.sum(tl.where(here, cnt, 0), 0)
            if GROUP_K:
                M = M1
                K = c_p
            else:
                M = c_p
                K = K1
            a_off = s_p * a_step
            b_off = s_p * b_step + p * b_e
            c_off = s_p * c_step + p * c_e
            if ALIGNED:  # the host checked: every step is a multiple of 16 elements
                a_off = tl.multiple_of(a_off, 16)
                b_off = tl.multiple_of(b_off, 16)
                c_off = tl.multiple_of(c_off, 16)
            a_base = a_ptr + a_off
            b_base = b_ptr + b_off
            c_base = c_ptr + c_off
            N_t = N
            ldc = scm
        elif SINGLE:
            s_p = 0
            local = tile
            M = M1
            K = K1
            a_off = 0
            b_off = 0
            a_base = a_ptr
            b_base = b_ptr
            c_base = c_ptr
            N_t = N
            ldc = scm
        else:
            p = tl.sum((firsts <= tile).to(tl.int32)) - 1  # the problem this tile belongs to
            s_p = 0
            row = prob_ptr + p * (8 if PER_N else 6)
            local = (tile - tl.load(row)).to(tl.int32)
            if PER_N:
                N_t = tl.load(row + 6).to(tl.int32)
                ldc = tl.load(row + 7).to(tl.int32)
            else:
                N_t = N
                ldc = scm
            M = tl.load(row + 1).to(tl.int32)
            K = tl.load(row + 2).to(tl.int32)
            a_off = tl.load(row + 3)
            b_off = tl.load(row + 4)
            c_off = tl.load(row + 5)
            if ALIGNED:  # the host checked: every offset is a multiple of 16 elements
                a_off = tl.multiple_of(a_off, 16)
                b_off = tl.multiple_of(b_off, 16)
                c_off = tl.multiple_of(c_off, 16)
            a_base = a_ptr + a_off
            b_base = b_ptr + b_off
            c_base = c_ptr + c_off
        if EVEN_K:
            K = tl.multiple_of(K, BLOCK_K)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        if PER_N:
            num_pid_n = tl.cdiv(N_t, BLOCK_N)
            in_group = GROUP_M * num_pid_n
        group = local // in_group
        first_m = group * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (local % size_m)
        pid_n = (local % in_group) // size_m
        a_row = 0
        b_row = 0
        if TMA:
            a_row = (a_off // sam).to(tl.int32)
            b_row = (b_off // sbn).to(tl.int32)
        if HALF_TAIL:  # a last M tile holding at most BLOCK_M / 2 rows: the same rows in one tile half as high
            if M - pid_m * BLOCK_M <= BLOCK_M // 2:
                _tile(a_base, b_base, c_base, idx_ptr, s_p, pid_m * BLOCK_M, pid_n, M, K, N_t, sam, sak, sbk, sbn,
                      ldc, scn, a_half, b_desc, a_row, b_row, BLOCK_M // 2, BLOCK_N, BLOCK_K, UPCAST, IEEE, EVEN_K,
                      A_M_CONTIG, B_N_CONTIG, MASK_M, GATHER, SWIGLU, TMA)
            else:
                _tile(a_base, b_base, c_base, idx_ptr, s_p, pid_m * BLOCK_M, pid_n, M, K, N_t, sam, sak, sbk, sbn,
                      ldc, scn, a_desc, b_desc, a_row, b_row, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, IEEE, EVEN_K,
                      A_M_CONTIG, B_N_CONTIG, MASK_M, GATHER, SWIGLU, TMA)
        else:
            _tile(a_base, b_base, c_base, idx_ptr, s_p, pid_m * BLOCK_M, pid_n, M, K, N_t, sam, sak, sbk, sbn, ldc,
                  scn, a_desc, b_desc, a_row, b_row, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, IEEE, EVEN_K, A_M_CONTIG,
                  B_N_CONTIG, MASK_M, GATHER, SWIGLU, TMA)


def _config(dtype, m: int | None = None, small: dict | None = None) -> dict:
    """The pinned config for dtype; m (rows per problem) picks the first entry (max rows, config) of the
    table `small` that fits, else the main config."""
    if INTERPRET:
        return dict(INTERPRET_MATMUL)
    for max_m, cfg in (small or {}).get(dtype, ()):
        if m is not None and m <= max_m:
            return dict(cfg)
    return dict(MATMUL_CONFIGS[dtype])


def small_m_config(dtype, m: int, ns: list[int], sms: int) -> dict:
    """The config of m rows against output widths ns (one launch: a linear, or linears' several weights)
    on sms SMs: the small-M rule above, else the main config (or, where its tiles fill less than half a wave,
    the main tiles half as wide or the widest member). Scheduling only: the bits are the main config's whatever
    it picks."""
    if INTERPRET:
        return dict(INTERPRET_SMALL_M[1] if m <= INTERPRET_SMALL_M[0] else INTERPRET_MATMUL)
    if dtype not in MATMUL_SMALL_M:
        return dict(MATMUL_CONFIGS[dtype])
    max_m, mask_m, cfgs = MATMUL_SMALL_M[dtype]

    def tiles(cfg: dict) -> int:
        return triton.cdiv(m, cfg["BLOCK_M"]) * sum(triton.cdiv(n, cfg["BLOCK_N"]) for n in ns)

    main = MATMUL_CONFIGS[dtype]
    if m > max_m:  # of the main tiles, the half-width ones, then the widest small-M member: the first whose
        # tiles fill half a wave (narrow weights, few rows: k/v's 512 x 2048 gradient is 32 main tiles), else
        # the last
        for cfg in (main, *MATMUL_PAST_SMALL_M.get(dtype, ()), cfgs[-1]):
            if 2 * tiles(cfg) >= sms:
                break
        if cfg is main:
            return dict(main)
    else:
        cfg = next((c for c in cfgs if tiles(c) <= sms), None)
    if cfg is None:  # no member fits one wave: the main config where its own tiles fill one
        if tiles(main) >= sms:
            return dict(main)
        cfg = cfgs[-1]
    if "FLATTEN" not in cfg:
        cfg = dict(cfg, FLATTEN=tiles(cfg) > sms)  # the next tile's loads under this one: with tiles to spare
    return dict(cfg, MASK_M=True) if m <= mask_m else cfg


def _launch_cfg(cfg: dict, device) -> tuple[dict, int]:
    """(A config's kernel constexprs and launch options, its number of persistent programs): FLATTEN, MASK_M
    off unless set; PER_SM (default 1) programs per SM. Scheduling only: the tiles and their K order stay
    the config's."""
    cfg = dict({"FLATTEN": False, "MASK_M": False, "GATHER": 0, "HALF_TAIL": False, "SWIGLU": False}, **cfg)
    cfg.pop("TMA", None)  # decided by the plan (_tma_rows)
    return cfg, cfg.pop("PER_SM", 1) * num_sms(device)


def _rows(t: torch.Tensor, stride: int, k: int) -> int:
    """Rows of k elements, stride apart from t's first element, that lie inside t's span (its last element
    included): the extent of a descriptor over t, so that no read leaves t's memory."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (span - k) // stride + 1


def _tma_rows(cfg: dict, a, b, K: int | None, strides: tuple, a_offs, b_offs) -> tuple[int, int] | None:
    """(a_rows, b_rows), the extents of the tensor descriptors over A and B, where cfg asks for TMA and both
    operands allow it: read K-contiguous, rows of a 16-byte multiple, every problem's offset a whole number of
    rows, one K (None: the problems' K differ); else None. The bases' alignment is checked per call
    (_TmaLaunch)."""
    sam, sak, sbk, sbn = strides[:4]
    size = a.element_size()
    if not cfg.get("TMA") or cfg.get("SWIGLU") or not K or sak != 1 or sbk != 1:  # SWIGLU: B's halves by pointers
        return None
    for stride, offs in ((sam, a_offs), (sbn, b_offs)):
        if (stride * size) % 16 or stride < K or any(o % stride for o in offs):
            return None
    return _rows(a, sam, K), _rows(b, sbn, K)


def _tma_alloc(size: int, alignment: int, stream):
    """Global scratch for the kernels' tensor descriptors (128 bytes each per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


class _TmaLaunch:
    """A plan's launch with its operands read through tensor descriptors, or the same plan through pointers
    (the same bits) for a call whose A or B base is not 16-byte aligned."""

    __slots__ = ("tma", "plain")

    def __init__(self, tma: Launch, plain: Launch):
        self.tma, self.plain = tma, plain

    def __call__(self, *tensors: torch.Tensor) -> None:
        if tensors[0].data_ptr() & 15 == 0 and tensors[1].data_ptr() & 15 == 0:
            triton.set_allocator(_tma_alloc)  # a context variable: set in the thread that launches
            self.tma(*tensors)
        else:
            self.plain(*tensors)


def _launch(grid: tuple, scalars: tuple, meta: dict, rows: tuple[int, int] | None):
    """The Launch of _gemm_kernel; through _TmaLaunch where rows (_tma_rows) holds the descriptors' extents."""
    plain = Launch(_gemm_kernel, grid, (*scalars, 0, 0), dict(meta, TMA=False))
    if rows is None:
        return plain
    return _TmaLaunch(Launch(_gemm_kernel, grid, (*scalars, *rows), dict(meta, TMA=True)), plain)


def _wgrad_config(dtype) -> dict:
    """The pinned config of the grouped weight gradient."""
    return dict(GROUPED_WGRAD[dtype]) if dtype in GROUPED_WGRAD and not INTERPRET else _config(dtype)


def _grouped_config(dtype, rows: int, k: int | None = None) -> dict:
    """The pinned config of the grouped GEMM (forward, dX) at `rows` rows per group and K = k of K-contiguous
    weights (None: any K, or weights read otherwise)."""
    short = None if INTERPRET or k is None else GROUPED_SHORT_K.get(dtype)
    if short is not None and k <= short[0] and rows > short[1]:
        return dict(short[2])
    return _config(dtype, rows, GROUPED_SMALL_M)


def _gemm(a, b, c, problems: list[tuple[int, int, int, int, int]], N: int, strides: tuple, cfg: dict,
          even_k: bool = True) -> None:
    """Launch _gemm_kernel over problems (M_p, K_p, a_off, b_off, c_off); strides (sam, sak, sbk, sbn,
    scm, scn) are shared by all problems; a, b, c are the base tensors the offsets index. The plan
    (tile table on the device, grid, layout flags) is cached: the host work per call is one lookup.
    even_k=False: K runs over tokens (a weight gradient), whose count changes with the batch: the
    K loop stays masked whatever the count (one compiled variant; the same bits, see _gemm_plan)."""
    numels = (a.numel(), b.numel(), c.numel())
    key = ("gemm", tuple(problems), N, strides, tuple(cfg.values()), a.dtype, a.device, numels, even_k)
    plan = cached(key, lambda: _gemm_plan(a, numels, problems, N, strides, cfg, even_k, (a, b)))
    if plan is not None:
        launch, table = plan
        launch(a, b, c, a if table is None else table, a)


def _check_numel(numels: tuple) -> None:
    if max(numels) >= 2**31:
        raise ValueError(f"triton matmul: operands of {max(numels)} elements exceed the kernel's 32-bit tile offsets")


def _gemm_plan(a, numels, problems, N, strides, cfg, even_k: bool = True, ops: tuple | None = None):
    """(Launch, tile table or None) for these problems, or None when there is no tile. EVEN_K only
    drops the K mask (the loads read the same values): even_k=False keeps it, with the same bits.
    N None: every problem carries its own N_p and C row stride, (M_p, K_p, a_off, b_off, c_off, N_p,
    ldc_p) (the kernel's PER_N table; strides' scm unused). ops: (A, B) as the kernel reads them (tensors or
    meta tensors of their shapes and strides), for the tensor descriptors' extents; None: pointer loads only."""
    _check_numel(numels)
    per_n = N is None
    rows, first = [], 0
    for prob in problems:
        M_p, K_p, ao, bo, co = prob[:5]
        rows.append((first, M_p, K_p, ao, bo, co, *prob[5:7]) if per_n else (first, M_p, K_p, ao, bo, co))
        first += triton.cdiv(M_p, cfg["BLOCK_M"]) * triton.cdiv(prob[5] if per_n else N, cfg["BLOCK_N"])
    if first == 0:
        return None
    sam, sak, sbk, sbn = strides[:4]
    ns = [r[6] for r in rows] if per_n else [N]
    flags = dict(
        ALIGNED=all(v % 16 == 0 for r in rows for v in r[3:6]),
        EVEN_K=even_k and all(r[2] % cfg["BLOCK_K"] == 0 for r in rows),
        A_M_CONTIG=sam == 1 and sak != 1 and all(r[1] % 16 == 0 for r in rows),
        B_N_CONTIG=sbn == 1 and sbk != 1 and all(n % (32 if cfg.get("SWIGLU") else 16) == 0 for n in ns),
    )
    ks = {r[2] for r in rows}
    K = ks.pop() if len(ks) == 1 else None
    tma = None if per_n or not ops else _tma_rows(cfg, *ops, K, strides, [r[3] for r in rows], [r[4] for r in rows])
    if per_n:
        N = max(ns)  # the scalar slot: unused under PER_N
    single = not per_n and len(rows) == 1 and rows[0][3:] == (0, 0, 0)
    # one problem at offset 0 (a plain matmul) needs no table: M, K as arguments (the slot: any tensor, unread)
    table = None if single else host_table(rows, torch.int64, a.device)
    cfg, sms = _launch_cfg(cfg, a.device)
    meta = dict(P=len(rows), P2=max(2, triton.next_power_of_2(len(rows))), NUM_SMS=sms, UPCAST=INTERPRET,
                IEEE=a.dtype == torch.float32, SINGLE=single, COUNTS=False, GROUP_K=False, **flags, **cfg,
                PER_N=per_n)
    M1, K1 = (rows[0][1], rows[0][2]) if single else (0, 0 if tma is None else K)
    scalars = (first, N, M1, K1, *strides, 0, 0, 0, 0, 0, 0)
    return _launch((min(sms, first),), scalars, meta, tma), table


def _gemm_counts(a, b, c, counts: torch.Tensor, R: int, N: int, M1: int, K1: int, strides: tuple, steps: tuple,
                 group_k: bool, cfg: dict, idx: torch.Tensor | None = None, per: int = 1) -> None:
    """Launch _gemm_kernel over P = len(counts) groups whose sizes stay on the device (COUNTS mode):
    rows sorted by group, R in all; steps (a_step, b_step, b_e, c_step, c_e) place group p at row s_p
    (see the kernel). The grid is a bound known on the host, so nothing is read back: no sync.
    idx [R] (GATHER, not group_k): sorted row i of A is row idx[i] // per of a; its step is 0."""
    numels = (a.numel(), b.numel(), c.numel())
    gather = None if idx is None else (idx.dtype, per)
    key = ("gemm-counts", counts.numel(), R, N, M1, K1, strides, steps, group_k, tuple(cfg.values()), a.dtype,
           a.device, numels, counts.dtype, gather)
    launch = cached(key, lambda: _counts_plan(a, numels, counts.numel(), R, N, M1, K1, strides, steps, group_k, cfg,
                                              0 if idx is None else per, b))
    if launch is not None:
        launch(a, b, c, counts, counts if idx is None else idx)


def _counts_plan(a, numels, P, R, N, M1, K1, strides, steps, group_k, cfg, gather: int = 0, b=None):
    _check_numel(numels)
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    if group_k:  # every group owns all tiles of its [M1, N] output
        bound = P * triton.cdiv(M1, cfg["BLOCK_M"]) * n_tiles
    else:  # sum_p cdiv(c_p, BLOCK_M) <= cdiv(R, BLOCK_M) + (groups holding a row)
        bound = (triton.cdiv(R, cfg["BLOCK_M"]) + min(P, R)) * n_tiles
    if bound == 0:
        return None
    sam, sak, sbk, sbn = strides[:4]
    a_step, b_step, b_e = steps[:3]
    tma = None if group_k or gather or b is None else _tma_rows(cfg, a, b, K1, strides, [a_step], [b_step, b_e])
    cfg, sms = _launch_cfg(cfg, a.device)
    meta = dict(P=P, P2=max(2, triton.next_power_of_2(P)), NUM_SMS=sms, UPCAST=INTERPRET,
                IEEE=a.dtype == torch.float32, SINGLE=False, COUNTS=True, GROUP_K=group_k,
                ALIGNED=all(v % 16 == 0 for v in steps), EVEN_K=not group_k and K1 % cfg["BLOCK_K"] == 0,
                A_M_CONTIG=group_k and sam == 1 and sak != 1 and M1 % 16 == 0,
                B_N_CONTIG=sbn == 1 and sbk != 1 and N % (32 if cfg["SWIGLU"] else 16) == 0, **cfg, PER_N=False)
    meta["GATHER"] = gather
    return _launch((min(sms, bound),), (0, N, M1, K1, *strides, R, *steps), meta, tma)


def _usable(t: torch.Tensor) -> torch.Tensor:
    """A 2-D operand the kernel can read in place: one of its dims contiguous (else a copy)."""
    return t if 1 in t.stride() or t.numel() <= 1 else t.contiguous()


def _needs_copy(t: torch.Tensor) -> bool:
    return not (1 in t.stride() or t.numel() <= 1)


_MATMUL_PLANS: dict = {}  # (shapes, strides, dtypes, devices) -> (M, N, K, copy a, copy b, Launch)


def clear_plans() -> None:
    """Forget the matmul launch plans (each holds the config its table gave): after a table entry changes."""
    _MATMUL_PLANS.clear()


def _matmul_plan(a, b, even_k: bool = True):
    """Everything about a matmul that its shapes, strides, dtypes and devices decide, checked once."""
    check_inputs("matmul", a, b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"triton matmul: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    if a.dtype != b.dtype:
        raise TypeError(f"triton matmul: dtypes differ ({a.dtype} vs {b.dtype})")
    M, K = a.shape
    N = b.shape[1]
    copy_a, copy_b = _needs_copy(a), _needs_copy(b)
    if M == 0 or N == 0 or K == 0:
        return M, N, K, copy_a, copy_b, None
    sa = (K, 1) if copy_a else a.stride()  # read in place: K-, M- or N-contiguous operands, same bits
    sb = (N, 1) if copy_b else b.stride()
    ops = (torch.empty_strided((M, K), sa, dtype=a.dtype, device="meta"),
           torch.empty_strided((K, N), sb, dtype=b.dtype, device="meta"))
    plan = _gemm_plan(a, (a.numel(), b.numel(), M * N), [(M, K, 0, 0, 0)], N, (*sa, *sb, N, 1),
                      small_m_config(a.dtype, M, [N], num_sms(a.device)), even_k, ops)
    return M, N, K, copy_a, copy_b, plan[0]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N] -> [M, N] in a's dtype, fp32 accumulation; any strides. Bits of a row of
    the result are independent of M (fixed config, no split-K). Host work per call: one plan lookup
    (the plan: checks, config, layout flags, launch, all decided by shapes/strides/dtypes once)."""
    return _matmul(a, b, False)


def _matmul(a: torch.Tensor, b: torch.Tensor, b_transposed: bool, token_k: bool = False) -> torch.Tensor:
    """matmul(a, b), or matmul(a, b.t()) when b_transposed (a linear's weight, read through its
    strides: no transposed view to build). token_k: K is the batch's token count (a weight
    gradient): the masked K loop for every count (same bits as the unmasked one)."""
    key = (b_transposed, a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device, token_k,
           id(MATMUL_SMALL_M.get(a.dtype)))  # a benchmark may set another small-M table: its own plans
    plan = _MATMUL_PLANS.get(key)
    if plan is None:
        plan = _matmul_plan(a, b.t() if b_transposed else b, not token_k)
        if len(_MATMUL_PLANS) >= 4096:
            _MATMUL_PLANS.clear()
        _MATMUL_PLANS[key] = plan
    M, N, K, copy_a, copy_b, launch = plan
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if launch is None:
        return c.zero_() if K == 0 else c
    if copy_b:
        b = b.t().contiguous() if b_transposed else b.contiguous()
    launch(a.contiguous() if copy_a else a, b, c, a, a)
    return c


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        return _matmul(x2, w, True)

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        g = g.to(x2.dtype)
        gx = matmul(g, w) if ctx.needs_input_grad[0] else None
        # K = tokens, in order; the K mask kept for every token count: one compiled variant
        gw = _matmul(g.t(), x2, False, token_k=True).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x, w, bias=None):
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        y = _Linear.apply(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    elif x.dim() == 2:  # no graph to record: the same kernel without autograd's bookkeeping
        y = _matmul(x, w, True)
    else:
        y = _matmul(x.reshape(-1, x.shape[-1]), w, True).reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)


# linears: several weights at one input in ONE launch (q, k, v of a decode step: three latency-bound launches
# become one), the small-M rule over all its weights' tiles. Any config of the family reduces K through the same
# k16 MMA chain into one fp32 accumulator: the separate linears' bits whatever the tiles
# (tests/gpu/test_linears_gpu.py; experiments/results/linears_sweep_H200.json).


def _linears_plan(x2, ws, ns, cfg):
    """(Launch, table, index of the base weight) for x2 [M, K] against weights ws ([N_i, K], one layout): weight
    i's offset from the lowest-addressed one (b_ptr) in elements, outputs packed one after another
    (output i is [M, N_i], contiguous, at M * (N_0 + ... + N_{i-1}))."""
    M, K = x2.shape
    size = x2.element_size()
    i0 = min(range(len(ws)), key=lambda i: ws[i].data_ptr())
    base = ws[i0]
    probs, co = [], 0
    for w, n in zip(ws, ns):
        probs.append((M, K, 0, (w.data_ptr() - base.data_ptr()) // size, co, n, n))
        co += M * n
    w0 = ws[0]
    strides = (x2.stride(0), x2.stride(1), w0.stride(1), w0.stride(0), 0, 1)
    plan = _gemm_plan(x2, (x2.numel(), max(w.numel() for w in ws), max(ns) * M), probs, None, strides, cfg)
    return None if plan is None else (*plan, i0)  # no weight kept alive by the cache


def _linears_ok(x2, ws) -> bool:
    """One launch reads every weight through the first one's strides at an element offset from the
    lowest address: same dtype, device, K and strides (one of them 1), element-aligned addresses."""
    w0 = ws[0]
    if x2.dtype not in SUPPORTED or 1 not in w0.stride() or x2.numel() == 0:
        return False
    size = x2.element_size()
    return all(w.dim() == 2 and w.dtype == x2.dtype and w.device == x2.device and w.shape[1] == x2.shape[1]
               and w.shape[0] > 0 and w.stride() == w0.stride() and (w.data_ptr() - w0.data_ptr()) % size == 0
               for w in ws)


def linears(x, ws, biases):
    """[linear(x, w_i, b_i)], the same bits: one launch of _gemm_kernel for all weights (a PER_N
    problem table, one row per weight) when no autograd graph is recorded; outputs are contiguous
    views of one buffer. Under autograd (or weights it cannot read in place): the separate linears.
    The plan's table holds the weights' offsets from each other, so its key holds their addresses
    (an engine's CUDA graphs are captured against fixed weight addresses anyway)."""
    ws = list(ws)
    if len(ws) < 2 or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))):
        return [linear(x, w, b) for w, b in zip(ws, biases)]
    x2 = _usable(x.reshape(-1, x.shape[-1]))
    if not _linears_ok(x2, ws):
        return [linear(x, w, b) for w, b in zip(ws, biases)]
    M, ns = x2.shape[0], [w.shape[0] for w in ws]
    cfg = small_m_config(x2.dtype, M, ns, num_sms(x2.device))
    key = ("linears", M, x2.stride(), tuple((w.data_ptr(), w.shape[0]) for w in ws), ws[0].stride(), x2.shape[1],
           tuple(cfg.values()), x2.dtype, x2.device)
    plan = cached(key, lambda: _linears_plan(x2, ws, ns, cfg))
    buf = torch.empty(M * sum(ns), dtype=x.dtype, device=x.device)
    if plan is not None:
        launch, table, i0 = plan
        launch(x2, ws[i0], buf, table, x2)
    outs, o = [], 0
    for n, b in zip(ns, biases):
        y = buf[o:o + M * n].view(*x.shape[:-1], n)
        o += M * n
        outs.append(y if b is None else (y.float() + b.float()).to(x.dtype))
    return outs


def _starts(counts: list[int]) -> list[int]:
    """First row of each group of rows sorted by group."""
    out, s = [], 0
    for c in counts:
        out.append(s)
        s += c
    return out


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor,
               rows: torch.Tensor | None = None, per: int = 1, swiglu: bool = False) -> torch.Tensor:
    """Rows of x [R, K] sorted by group, group e times w[e]^T (w [E, N, K], any strides) -> [R, N],
    ONE launch. Every row's bits equal matmul(row, w[e]^T): same kernel, same config, same K order.
    counts: a host list (problem table built on the host) or a device tensor (table built in the
    kernel; no host sync). rows [R] (with device counts): sorted row i is x[rows[i] // per], read in place.
    swiglu: w's N rows are [gate | up] and the result is swiglu_halves of the product, [R, N / 2], from the
    same launch (the kernel's SWIGLU: the same config and tiles, the same bits)."""
    R, N = x.shape[0] if rows is None else rows.numel(), w.shape[1]
    if swiglu and N % 2:
        raise ValueError(f"triton grouped_mm: swiglu over w {tuple(w.shape)}: N must be [gate | up], even")
    n_out = N // 2 if swiglu else N
    out = torch.empty(R, n_out, dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return out
    if w.stride(2) != 1 and w.stride(1) != 1:
        w = w.contiguous()
    x = _usable(x)
    if isinstance(counts, torch.Tensor):  # the sizes are unknown here: rows per group guessed as R / min(E, R)
        cfg = _grouped_config(x.dtype, -(-R // min(w.shape[0], R)), x.shape[1] if w.stride(2) == 1 else None)
        if swiglu:
            cfg["SWIGLU"] = True
        _gemm_counts(x, w, out, counts, R, N, 0, x.shape[1],
                     (x.stride(0), x.stride(1), w.stride(2), w.stride(1), n_out, 1),
                     (x.stride(0) if rows is None else 0, 0, w.stride(0), n_out, 0), False, cfg, rows, per)
        return out
    groups = sum(1 for c in counts if c)
    cfg = _grouped_config(x.dtype, -(-R // max(groups, 1)), x.shape[1] if w.stride(2) == 1 else None)
    if swiglu:
        cfg["SWIGLU"] = True
    st = _starts(counts)
    probs = [(c, x.shape[1], s * x.stride(0), e * w.stride(0), s * n_out)
             for e, (c, s) in enumerate(zip(counts, st)) if c]
    _gemm(x, w, out, probs, N, (x.stride(0), x.stride(1), w.stride(2), w.stride(1), n_out, 1), cfg)
    return out


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """dW[e] = g_e^T x_e for rows sorted by group: [E, N, K] in ONE launch, no atomics: each program
    owns a tile of one expert's dW and reduces that expert's rows in order, BLOCK_K at a time (the
    chunks of matmul(g_e^T, x_e)). Read in place: g^T is an M-contiguous A, x an N-contiguous B."""
    E, N, K = len(counts), g.shape[1], x.shape[1]
    dw = torch.empty(E, N, K, dtype=x.dtype, device=x.device)
    g, x = g.contiguous(), x.contiguous()
    if isinstance(counts, torch.Tensor):  # group sizes on the device: K_p = c_p, read in the kernel
        _gemm_counts(g, x, dw, counts, g.shape[0], K, N, 0, (1, N, K, 1, K, 1), (N, K, 0, 0, N * K), True,
                     _wgrad_config(x.dtype))
        return dw
    probs = [(N, c, s * N, s * K, e * N * K) for e, (c, s) in enumerate(zip(counts, _starts(counts)))]
    _gemm(g, x, dw, probs, K, (1, N, K, 1, K, 1), _wgrad_config(x.dtype), even_k=False)
    return dw


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return grouped_mm(x, w, counts)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous().to(x.dtype)
        gx = grouped_mm(g, w.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
        gw = grouped_wgrad(g, x, ctx.counts).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def _grouped_args(x, w, counts: list[int] | torch.Tensor):
    """(counts, w) of grouped_linear checked: a device tensor or a host list of ints; w in x's dtype."""
    check_inputs("grouped_linear", x, w)
    if isinstance(counts, torch.Tensor) and counts.device != x.device:
        counts = counts.tolist()
    if isinstance(counts, torch.Tensor):
        if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or counts.shape != (w.shape[0],) \
                or counts.is_floating_point() or counts.is_complex():
            raise ValueError(f"triton grouped_linear: x {tuple(x.shape)}, w {tuple(w.shape)} and counts "
                             f"(tensor {tuple(counts.shape)} {counts.dtype}) do not fit")
    elif x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or len(counts) != w.shape[0] \
            or sum(counts) != x.shape[0]:
        raise ValueError(f"triton grouped_linear: x {tuple(x.shape)}, w {tuple(w.shape)} and counts "
                         f"(len {len(counts)}, sum {sum(counts)}) do not fit")
    else:
        counts = [int(c) for c in counts]
    return counts, w.to(x.dtype)


def grouped_linear(x, w, counts: list[int] | torch.Tensor):
    """Expert GEMMs over rows sorted by expert ([R, K] x [E, N, K] -> [R, N]): one launch forward,
    one for dX, one for dW (plus the layout copies). counts: a host list, or an integer tensor on x's
    device whose values are never read on the host (no sync: the path a CUDA graph can capture; the
    caller promises they sum to R, the kernel clamps them to R so a wrong tensor cannot write out of
    bounds). Same bits either way."""
    counts, w = _grouped_args(x, w, counts)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _GroupedLinear.apply(x, w, counts)
    return grouped_mm(x, w, counts)


def grouped_swiglu(x, w, counts: list[int] | torch.Tensor):
    """swiglu_halves(grouped_linear(x, w, counts)) (w [E, 2I, K]: gate | up) -> [R, I], the same bits; without a
    gradient ONE launch that never writes the [R, 2I] product (the GEMM's epilogue applies the SwiGLU), with
    one the two ops (their backward needs the product)."""
    counts, w = _grouped_args(x, w, counts)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return swiglu_halves(_GroupedLinear.apply(x, w, counts))
    return grouped_mm(x, w, counts, swiglu=True)

