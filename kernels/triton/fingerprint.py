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
