"""The fingerprint kernel (the definition: kernels/fingerprint.py): one launch over a table of
chunks of any number of tensors, each byte read once, per-result (A, B) sums in a device buffer.

A program takes one chunk (address, word count, its first word's two key bases, result index)
and reads its 32-bit words BLOCK at a time: full blocks with unmasked vector loads at 32-bit
offsets from the chunk's start (the next block's loads issued before this block is hashed, so
their latency overlaps the hashing), the last partial block masked. Per word: one three-input add
(word + key1 base + the lane's key1 step), fmix32 and two accumulations, acc_h += h and
acc_j += h * (block offset): ~11 integer operations per 4 bytes, below the memory's pace on an
H200. The program's B follows from key2 being linear in the index within a chunk:
B = key2(first) * A + K2 * (sum over lanes of acc_j + lane * acc_h). It adds its (A, B) into the
result with integer atomics (order-free: the same bits for any grid). Addresses are word offsets
from the base tensor passed in (the result buffer), so the loads of the aligned table's chunks are
known to be 16-byte aligned.

`copy_fingerprint_sums` is the same loop with a store: each program also writes the words it loaded
to a destination (a sixth table column), so one pass copies tensors and fingerprints them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rlalign.kernels import fingerprint as fp

from .common import INTERPRET

BLOCK, NUM_WARPS = 4096, 8  # words per loop step; 16 a thread (four 16-byte loads)


@triton.jit
def _fmix32(x, M1: tl.constexpr, M2: tl.constexpr):
    x ^= x >> 16
    x *= M1
    x ^= x >> 13
    x *= M2
    x ^= x >> 16
    return x


@triton.jit
def fingerprint_kernel(base_ptr, table_ptr, out_ptr, K1: tl.constexpr, K2: tl.constexpr, STEP1: tl.constexpr,
                        M1: tl.constexpr, M2: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """base_ptr: int32 words; VEC > 1: every chunk starts at a multiple of VEC words from
    base_ptr, i.e. at a 16-byte boundary (vector loads)."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * 5
    start = tl.load(row)  # words from base_ptr
    n = tl.load(row + 1).to(tl.int32)  # at most fp.CHUNK
    k1 = tl.load(row + 2).to(tl.uint32)
    k2 = tl.load(row + 3).to(tl.uint32)
    dst = tl.load(row + 4)
    if VEC > 1:
        start = tl.multiple_of(start, VEC)
    ptr = base_ptr + start
    lane = tl.arange(0, BLOCK)
    lk1 = lane.to(tl.uint32) * K1
    acc_h = tl.zeros([BLOCK], tl.uint32)
    acc_j = tl.zeros([BLOCK], tl.uint32)
    full = (n // BLOCK) * BLOCK
    nxt = tl.load(ptr + lane, mask=tl.full([BLOCK], 0, tl.int32) < full, other=0)
    o = k1 * 0  # off as uint32
    for off in range(0, full, BLOCK):
        w = nxt.to(tl.uint32, bitcast=True)
        ahead = tl.multiple_of(tl.minimum(off + BLOCK, full - BLOCK), BLOCK)  # the last block reloads itself
        nxt = tl.load(ptr + ahead + lane)
        h = _fmix32(w + lk1 + k1, M1, M2)
        acc_h += h
        acc_j += h * o
        k1 += STEP1
        o += BLOCK
    if full < n:
        m = full + lane < n
        w = tl.load(ptr + full + lane, mask=m, other=0).to(tl.uint32, bitcast=True)
        h = tl.where(m, _fmix32(w + lk1 + k1, M1, M2), 0)
        acc_h += h
        acc_j += h * o
    a = tl.sum(acc_h, 0)
    b = k2 * a + K2 * tl.sum(acc_j + lane.to(tl.uint32) * acc_h, 0)
    tl.atomic_add(out_ptr + dst * 2, a.to(tl.int32, bitcast=True), sem="relaxed")
    tl.atomic_add(out_ptr + dst * 2 + 1, b.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def copy_fingerprint_kernel(base_ptr, table_ptr, out_ptr, K1: tl.constexpr, K2: tl.constexpr,
                             STEP1: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, VEC: tl.constexpr,
                             BLOCK: tl.constexpr):
    """fingerprint_kernel's loop over a copy table (kernels.fingerprint.copy_tables, addresses as
    words from base_ptr): every word loaded from the chunk's source is stored to its destination and
    hashed from the same register. VEC > 1: sources and destinations at 16-byte boundaries."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * 6
    start = tl.load(row)
    n = tl.load(row + 1).to(tl.int32)
    k1 = tl.load(row + 2).to(tl.uint32)
    k2 = tl.load(row + 3).to(tl.uint32)
    dst = tl.load(row + 4)
    to = tl.load(row + 5)
    if VEC > 1:
        start = tl.multiple_of(start, VEC)
        to = tl.multiple_of(to, VEC)
    ptr = base_ptr + start
    wptr = base_ptr + to
    lane = tl.arange(0, BLOCK)
    lk1 = lane.to(tl.uint32) * K1
    acc_h = tl.zeros([BLOCK], tl.uint32)
    acc_j = tl.zeros([BLOCK], tl.uint32)
    full = (n // BLOCK) * BLOCK
    nxt = tl.load(ptr + lane, mask=tl.full([BLOCK], 0, tl.int32) < full, other=0)
    o = k1 * 0
    for off in range(0, full, BLOCK):
        w = nxt
        ahead = tl.multiple_of(tl.minimum(off + BLOCK, full - BLOCK), BLOCK)
        nxt = tl.load(ptr + ahead + lane)
        tl.store(wptr + off + lane, w)
        h = _fmix32(w.to(tl.uint32, bitcast=True) + lk1 + k1, M1, M2)
        acc_h += h
        acc_j += h * o
        k1 += STEP1
        o += BLOCK
    if full < n:
        m = full + lane < n
        w = tl.load(ptr + full + lane, mask=m, other=0)
        tl.store(wptr + full + lane, w, mask=m)
        h = tl.where(m, _fmix32(w.to(tl.uint32, bitcast=True) + lk1 + k1, M1, M2), 0)
        acc_h += h
        acc_j += h * o
    a = tl.sum(acc_h, 0)
    b = k2 * a + K2 * tl.sum(acc_j + lane.to(tl.uint32) * acc_h, 0)
    tl.atomic_add(out_ptr + dst * 2, a.to(tl.int32, bitcast=True), sem="relaxed")
    tl.atomic_add(out_ptr + dst * 2 + 1, b.to(tl.int32, bitcast=True), sem="relaxed")


def fingerprint_sums(parts: Sequence[fp.Part]) -> torch.Tensor:
    """[N, 2] int32 (A, B) on the parts' device (CUDA, or the CPU under TRITON_INTERPRET=1): one
    launch for the chunks at 16-byte boundaries, one for the few others."""
    if not parts:
        raise ValueError("fingerprint_sums: no tensors")
    device = parts[0].tensor.device
    for k, p in enumerate(parts):
        if p.tensor.device != device:
            raise ValueError(f"fingerprint_sums: {p.name or f'tensor {k}'} is on {p.tensor.device}, "
                             f"tensor 0 on {device}: one call fingerprints tensors of one device")
    main, odd, copies, n_out = fp.work_table(parts)  # copies: freed after the launch (stream order)
    out = torch.zeros(n_out, 2, dtype=torch.int32, device=device)
    base = out.data_ptr()
    for vec, t in ((4, main), (1, odd)):
        if not len(t):
            continue
        t[:, 0] -= base  # addresses -> words from the base tensor (work_table's tables are new arrays)
        t[:, 0] //= 4
        host = torch.from_numpy(t)
        table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        fingerprint_kernel[(len(t),)](out, table, out, K1=fp.K1, K2=fp.K2, STEP1=BLOCK * fp.K1 % 2**32, M1=fp.M1,
                                       M2=fp.M2, VEC=vec, BLOCK=BLOCK, num_warps=1 if INTERPRET else NUM_WARPS)
    return out


def _words_in_place(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """The pair can be copied as whole 32-bit words in place: both contiguous, at 4-byte boundaries,
    of a whole number of words."""
    nb = dst.numel() * dst.element_size()
    return (src.is_contiguous() and dst.is_contiguous() and nb % 4 == 0 and src.data_ptr() % 4 == 0
            and dst.data_ptr() % 4 == 0)


def copy_fingerprint_sums(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """dst.copy_(src) for every (src, dst) pair (one device, equal dtypes and shapes) and [N, 2] int32
    (A, B) of each destination's fingerprint after the copy, in pair order. Pairs of whole words at
    4-byte boundaries: one launch that reads each source byte once, writes it and hashes the word it
    wrote (kernels.fingerprint.copy_tables); any other pair is copied by torch and its destination
    hashed after the copy (a second launch)."""
    if not pairs:
        raise ValueError("copy_fingerprint_sums: no tensors")
    device = pairs[0][1].device
    for k, (src, dst) in enumerate(pairs):
        if src.device != device or dst.device != device or src.dtype != dst.dtype or src.shape != dst.shape:
            raise ValueError(f"copy_fingerprint_sums: pair {k}: {tuple(src.shape)} {src.dtype} on {src.device} "
                             f"into {tuple(dst.shape)} {dst.dtype} on {dst.device} (pair 0's destination on {device})")
    fused = [_words_in_place(src, dst) for src, dst in pairs]
    out = torch.zeros(len(pairs), 2, dtype=torch.int32, device=device)
    rest = [k for k, f in enumerate(fused) if not f]
    for k in rest:
        pairs[k][1].copy_(pairs[k][0])
    main, odd = fp.copy_tables([(src.data_ptr(), dst.data_ptr(), dst.numel() * dst.element_size(), k)
                                for k, ((src, dst), f) in enumerate(zip(pairs, fused)) if f and dst.numel()])
    base = out.data_ptr()
    for vec, t in ((4, main), (1, odd)):
        if not len(t):
            continue
        t[:, [0, 5]] -= base  # addresses -> words from the base tensor
        t[:, [0, 5]] //= 4
        host = torch.from_numpy(t)
        table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        copy_fingerprint_kernel[(len(t),)](out, table, out, K1=fp.K1, K2=fp.K2, STEP1=BLOCK * fp.K1 % 2**32, M1=fp.M1,
                                            M2=fp.M2, VEC=vec, BLOCK=BLOCK, num_warps=1 if INTERPRET else NUM_WARPS)
    if rest:
        out[rest] = fingerprint_sums([fp.Part(pairs[k][1]) for k in rest])
    return out
