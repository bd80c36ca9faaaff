"""The fingerprint kernel (the definition: kernels/fingerprint.py): one launch over a table of
chunks of any number of tensors, each byte read once, per-result (A, B) sums in a device buffer.

A program takes one chunk (address, word count, its first word's two key bases, result index),
hashes its words BLOCK at a time in 32-bit integer arithmetic (keys, murmur3's fmix32, one more
multiply-xorshift: ~17 integer operations a word, below the memory's pace on an H200) and adds
its two sums into the result with integer atomics (order-free: the same bits for any grid).
Addresses are word offsets from the base tensor passed in (the result buffer), so the loads of
the aligned table's chunks are known to be 16-byte aligned and become vector loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rlalign.kernels import fingerprint as fp

from .common import INTERPRET

BLOCK, NUM_WARPS = 4096, 8  # words per loop step; 16 a thread (four 16-byte loads of 32-bit words)
_WORD_DTYPE = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _hash(w, k1, k2, M1: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr):
    """(h, g) of words w (uint32) under keys k1, k2: the definition's two bijections."""
    h = w ^ k1
    h ^= h >> 16
    h *= M1
    h ^= h >> 13
    h *= M2
    h ^= h >> 16
    g = (h ^ k2) * M3
    g ^= g >> 15
    return h, g


@triton.jit
def _unsigned(w, WORD: tl.constexpr):
    """Loaded words as uint32, zero-extended (an int16 word is reinterpreted first, not sign-extended)."""
    if WORD == 2:
        w = w.to(tl.uint16, bitcast=True)
    return w.to(tl.uint32, bitcast=WORD == 4)


@triton.jit
def _fingerprint_kernel(base_ptr, table_ptr, out_ptr, K1: tl.constexpr, K2: tl.constexpr, STEP1: tl.constexpr,
                        STEP2: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr, M3: tl.constexpr, WORD: tl.constexpr,
                        VEC: tl.constexpr, BLOCK: tl.constexpr):
    """base_ptr: words of WORD bytes (int32, int16 or uint8); VEC > 1: every chunk starts at a
    multiple of VEC words from base_ptr, i.e. at a 16-byte boundary (vector loads)."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * 5
    start = tl.load(row)  # words from base_ptr
    n = tl.load(row + 1)
    k1 = tl.load(row + 2).to(tl.uint32)
    k2 = tl.load(row + 3).to(tl.uint32)
    dst = tl.load(row + 4)
    lane = tl.arange(0, BLOCK)
    lk1 = lane.to(tl.uint32) * K1
    lk2 = lane.to(tl.uint32) * K2
    acc_h = tl.zeros([BLOCK], tl.uint32)
    acc_g = tl.zeros([BLOCK], tl.uint32)
    full = (n // BLOCK) * BLOCK
    # the next block's words are loaded before this block is hashed: its load latency overlaps the
    # hashing (one block in flight per warp would leave the loop waiting on memory)
    offs = start + lane
    if VEC > 1:
        offs = tl.multiple_of(offs, VEC)
    nxt = tl.load(base_ptr + offs, mask=lane < full, other=0)
    for off in range(0, full, BLOCK):  # k1, k2: the key bases of word off (STEP = BLOCK * K mod 2**32)
        w = _unsigned(nxt, WORD)
        offs = start + off + BLOCK + lane
        if VEC > 1:
            offs = tl.multiple_of(offs, VEC)
        nxt = tl.load(base_ptr + offs, mask=off + BLOCK + lane < full, other=0)
        h, g = _hash(w, k1 + lk1, k2 + lk2, M1, M2, M3)
        acc_h += h
        acc_g += g
        k1 += STEP1
        k2 += STEP2
    if full < n:
        m = full + lane < n
        w = _unsigned(tl.load(base_ptr + start + full + lane, mask=m, other=0), WORD)
        h, g = _hash(w, k1 + lk1, k2 + lk2, M1, M2, M3)
        acc_h += tl.where(m, h, 0)
        acc_g += tl.where(m, g, 0)
    a = tl.sum(acc_h, 0).to(tl.int32, bitcast=True)
    b = tl.sum(acc_g, 0).to(tl.int32, bitcast=True)
    tl.atomic_add(out_ptr + dst * 2, a, sem="relaxed")
    tl.atomic_add(out_ptr + dst * 2 + 1, b, sem="relaxed")


_CONSTS = dict(K1=fp.K1, K2=fp.K2, M1=fp.M1, M2=fp.M2, M3=fp.M3)


def fingerprint_sums(parts: Sequence[fp.Part]) -> torch.Tensor:
    """[N, 2] int32 (A, B) on the parts' device (CUDA, or the CPU under TRITON_INTERPRET=1): one
    launch per word size and alignment class present (one for the usual float tensors)."""
    if not parts:
        raise ValueError("fingerprint_sums: no tensors")
    device = parts[0].tensor.device
    for k, p in enumerate(parts):
        if p.tensor.device != device:
            raise ValueError(f"fingerprint_sums: {p.name or f'tensor {k}'} is on {p.tensor.device}, "
                             f"tensor 0 on {device}: one call fingerprints tensors of one device")
    tables, copies, n_out = fp.work_table(parts)  # copies: freed after the launch (stream order)
    out = torch.zeros(n_out, 2, dtype=torch.int32, device=device)
    base = out.data_ptr()
    for w, (main, odd) in sorted(tables.items()):
        for vec, t in ((16 // w, main), (1, odd)):
            if not len(t):
                continue
            t = t.copy()
            t[:, 0] = (t[:, 0] - base) // w  # addresses -> words from the base tensor
            host = torch.from_numpy(t)
            table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
            _fingerprint_kernel[(len(t),)](out.view(_WORD_DTYPE[w]), table, out, WORD=w, VEC=vec, BLOCK=BLOCK,
                                           STEP1=BLOCK * fp.K1 % 2**32, STEP2=BLOCK * fp.K2 % 2**32,
                                           num_warps=1 if INTERPRET else NUM_WARPS, **_CONSTS)
    return out
