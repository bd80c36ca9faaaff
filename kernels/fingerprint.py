"""Tensor fingerprints: one definition, the same 64-bit value on every device.

The value of a tensor t (dtype d, shape s, n bytes):
  words   t's bytes in row-major order as little-endian 32-bit words w_0, w_1, ...; a tail of 1-3
          bytes is zero-padded to a word (n is in the salt, so padding cannot make two tensors
          collide). Every dtype is read this way: a bf16 pair, four int8, half an int64 is a word.
          Word i (i from 0) has keys
              key1(i) = lo * K1 + hi * K3 + C1,  key2(i) = lo * K2 + hi * K4 + C2   (mod 2**32)
          with lo, hi the low and high 32 bits of i.
  mix     h_i = fmix32(w_i + key1(i))  (murmur3's finaliser): a bijection in w_i for a fixed i.
  sums    A = sum of h_i, B = sum of h_i * key2(i), each mod 2**32: integer additions, so the value
          does not depend on the order of the sums, the chunking or the launch grid. raw = A << 32 | B.
  value   mix64(raw ^ salt(d, s)), salt a 64-bit hash of the dtype's name, the shape and n.

What it sees. One changed word changes A (h_i is a bijection of w_i, the other words' terms
stay), so any changed bit changes the value. Two changed words (a moved or swapped element) at a
distance of D words change it unless A collides (~2**-32) and, with it, D * K2 * (change of h)
vanishes mod 2**32 (~2**-(32 - v) for D = 2**v * odd): adjacent swaps are always seen, far ones
with a collision chance of ~2**-64 .. 2**-33. Another dtype or shape changes the salt.
torch.hash_tensor (an XOR of the elements) sees neither moves nor dtypes.

Cost. Per word one load, one three-input add, fmix32 (two multiplies, three xor-shifts) and two
accumulations (a GPU program sums h and h * (block offset), then forms B from key2 being linear
in i within a chunk): ~11 integer operations per 4 bytes, below the memory's pace on an H200.

Shares. A piece holding dim-0 rows r0.. of a larger tensor hashes its words with their indices
in the whole (`Part.first_row`; its rows must be whole words); the pieces' (A, B) add up,
componentwise mod 2**32 (`add_raw`), to the whole tensor's: the weight sync checks tensors sharded
over EP ranks this way. Rows (`Part.rows`): each dim-0 row is a tensor of its own (words from 0,
its tail padded).

Where it runs. CUDA: one Triton launch over a table of chunks of any number of tensors
(kernels/triton/fingerprint.py), results in a device buffer. CPU: numpy over the same words
(~1.5 GB/s on one core), and under TRITON_INTERPRET=1 the Triton kernel itself. All give the
same bits for the same bytes: a fingerprint taken on the GPU (a trace, a checkpoint's meta.json)
is comparable with one taken on the CPU. A tensor that is not contiguous is read through a
contiguous copy (the value is that of its elements in logical order); one whose start is not at
a 4-byte boundary, or whose rows are not whole words, is read through a zero-padded copy; a
tensor with no byte layout (sparse, quantized, meta) is an error naming it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

K1, K2, K3, K4 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F
C1, C2 = 0x165667B1, 0xD3A2646C
M1, M2 = 0x85EBCA6B, 0xC2B2AE35
CHUNK = 1 << 18  # words per work item (GPU: one program); a divisor of 2**32
_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1
_NP_BLOCK = 1 << 16  # numpy: words per pass (cache-sized temporaries)
_TINY = 1024  # numpy: tensors of at most this many words are hashed together


class FingerprintError(TypeError):
    pass


@dataclass(frozen=True)
class Part:
    """One tensor to fingerprint. rows=False: one result, the whole tensor (first_row > 0: it is
    dim-0 rows first_row.. of a larger tensor, hashed with that tensor's word indices: a share).
    rows=True: one result per dim-0 row, each row a tensor of shape tensor.shape[1:]."""

    tensor: torch.Tensor
    rows: bool = False
    first_row: int = 0
    name: str = ""


@functools.lru_cache(maxsize=65536)
def salt(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    name = str(dtype).removeprefix("torch.")
    nbytes = dtype.itemsize * math.prod(shape)
    return int.from_bytes(hashlib.blake2b(f"rlalign-fp|{name}|{list(shape)}|{nbytes}".encode(),
                                          digest_size=8).digest(), "little")


def mix64(z: int) -> int:
    """splitmix64's finaliser (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def add_raw(values: Sequence[int]) -> int:
    """The raw sums (A << 32 | B) of a tensor's shares added up: A and B each mod 2**32."""
    a = sum(v >> 32 for v in values) & _M32
    b = sum(v & _M32 for v in values) & _M32
    return a << 32 | b


def finalize(raw: int, dtype: torch.dtype, shape: Sequence[int]) -> int:
    """The fingerprint of a tensor of this dtype and shape whose raw sums are `raw`."""
    return mix64((raw & _M64) ^ salt(dtype, tuple(shape)))


def hex64(v: int) -> str:
    return f"{v & _M64:016x}"


def result_salts(parts: Sequence[Part]) -> np.ndarray:
    """uint64 [N]: the salt that finalizes each result of `parts`, in order (a rows part: its row
    shape's, one per row; a share: its piece's, the caller finalizes a merged share itself)."""
    salts, counts = [], []
    for p in parts:
        t = p.tensor
        if p.rows:
            salts.append(salt(t.dtype, tuple(t.shape[1:])))
            counts.append(t.shape[0] if t.dim() else 0)
        else:
            salts.append(salt(t.dtype, tuple(t.shape)))
            counts.append(1)
    return np.repeat(np.array(salts, np.uint64), counts)


_PLAIN = {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool}


def _words(p: Part, where: str) -> tuple[torch.Tensor, int]:
    """(b, first): what is hashed, b a contiguous uint8 [R, 4 x words] at a 4-byte boundary (R
    results: the rows, or 1; a copy where t was not contiguous, not 4-byte aligned or its rows not
    whole words, the copy's rows zero-padded), first the word index of b's first word."""
    t = p.tensor
    if not isinstance(t, torch.Tensor):
        raise FingerprintError(f"fingerprint of {where}: not a tensor ({type(t).__name__})")
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise FingerprintError(f"fingerprint of {where}: a {t.layout} {t.dtype} tensor on {t.device} has no plain "
                               f"byte layout to hash (make it a dense tensor first)")
    if p.rows and t.dim() == 0:
        raise FingerprintError(f"fingerprint of {where}: rows of a 0-d tensor")
    if p.first_row and (p.rows or p.first_row < 0):
        raise FingerprintError(f"fingerprint of {where}: first_row={p.first_row} needs a whole tensor (rows=False)")
    if t.dtype not in _PLAIN:
        try:
            t.reshape(-1)[:0].view(torch.uint8)
        except RuntimeError as e:
            raise FingerprintError(f"fingerprint of {where}: dtype {t.dtype} cannot be read as bytes ({e})") from None
    row_bytes = t.dtype.itemsize * math.prod(t.shape[1:])  # one dim-0 row (a 0-d tensor: its item)
    if p.first_row and row_bytes % 4:
        raise FingerprintError(f"fingerprint of {where}: a share (first_row={p.first_row}) needs dim-0 rows of "
                               f"whole 32-bit words; a row of {tuple(t.shape[1:])} {t.dtype} is {row_bytes} bytes")
    R = t.shape[0] if p.rows else 1
    nb = t.numel() * t.dtype.itemsize
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    b = t.reshape(-1).view(torch.uint8).view(R, nb // R if R else 0)
    if b.shape[1] % 4:
        b = torch.nn.functional.pad(b, (0, -b.shape[1] % 4))
    elif b.data_ptr() % 4:
        b = b.clone()
    return b, p.first_row * row_bytes // 4


# --- CPU: numpy ---------------------------------------------------------------------------------------
def _u32(v: int) -> np.uint32:
    return np.uint32(v & _M32)


def _hash_np(words: np.ndarray, k1: np.ndarray, k2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(h, h * key2) of uint32 words under keys k1, k2 (broadcast): the definition's two terms."""
    h = words + k1
    h ^= h >> np.uint32(16)
    h *= _u32(M1)
    h ^= h >> np.uint32(13)
    h *= _u32(M2)
    h ^= h >> np.uint32(16)
    return h, h * k2


def _keys_np(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """key1, key2 of word indices idx (uint64)."""
    lo, hi = idx.astype(np.uint32), (idx >> np.uint64(32)).astype(np.uint32)
    return lo * _u32(K1) + hi * _u32(K3) + _u32(C1), lo * _u32(K2) + hi * _u32(K4) + _u32(C2)


_LANE = np.arange(_NP_BLOCK, dtype=np.uint32)
_LANE_K1, _LANE_K2 = _LANE * _u32(K1), _LANE * _u32(K2)


def _np_sums_long(words: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """A, B [R] of rows words [R, n] (row r's word j has index first + j), a block of columns at a
    time; blocks end at multiples of _NP_BLOCK in the index (a divisor of 2**32: one high word)."""
    R, n = words.shape
    A, B = np.zeros(R, np.uint32), np.zeros(R, np.uint32)
    step = max(1, _NP_BLOCK // max(1, R))
    i = first
    while i < first + n:
        end = min(first + n, i + step, (i // _NP_BLOCK + 1) * _NP_BLOCK)
        lo, hi, m = i & _M32, i >> 32, end - i
        k1 = _LANE_K1[:m] + _u32(lo * K1 + hi * K3 + C1)
        k2 = _LANE_K2[:m] + _u32(lo * K2 + hi * K4 + C2)
        h, g = _hash_np(words[:, i - first : end - first], k1, k2)
        A += h.sum(axis=1, dtype=np.uint32)
        B += g.sum(axis=1, dtype=np.uint32)
        i = end
    return A, B


def _np_sums_short(blocks: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """A, B of the rows of many small [R, n] word blocks (with each block's first index) at once:
    one pass over their concatenation."""
    lens = np.concatenate([np.full(w.shape[0], w.shape[1], np.int64) for w, _ in blocks])
    firsts = np.concatenate([np.full(w.shape[0], f, np.int64) for w, f in blocks])
    starts = np.cumsum(lens) - lens
    flat = np.concatenate([w.reshape(-1) for w, _ in blocks])
    idx = (np.arange(len(flat), dtype=np.int64) + np.repeat(firsts - starts, lens)).astype(np.uint64)
    h, g = _hash_np(flat, *_keys_np(idx))
    return np.add.reduceat(h, starts, dtype=np.uint32), np.add.reduceat(g, starts, dtype=np.uint32)


def sums_cpu(parts: Sequence[Part]) -> np.ndarray:
    """[N, 2] uint32 (A, B) of every result of `parts` (CPU tensors), in order: long rows a block
    at a time, the short ones together in passes of about _NP_BLOCK words."""
    results: list[tuple[np.ndarray, np.ndarray]] = []  # (result indices, their (A, B))
    tiny: list[tuple[np.ndarray, np.ndarray, int]] = []  # (result indices, words [R, n], first index)
    n_out = 0
    for k, p in enumerate(parts):
        where = p.name or f"tensor {k}"
        b, first = _words(p, where)
        if b.device.type != "cpu":
            raise FingerprintError(f"fingerprint of {where}: on {b.device}, expected the CPU")
        words = b.numpy().view("<u4") if b.shape[1] else np.zeros((b.shape[0], 0), np.uint32)
        R, n = words.shape
        ids = n_out + np.arange(R)
        if words.size > _TINY or (n and R > 1):
            results.append((ids, np.stack(_np_sums_long(words, first), 1)))
        elif n and R:
            tiny.append((ids, words, first))
        n_out += R
    while tiny:  # tensors of a few words: one pass over many (the per-call overhead would dominate)
        size, cut = 0, 0
        while cut < len(tiny) and (size < _NP_BLOCK or not cut):
            size += tiny[cut][1].size
            cut += 1
        batch, tiny = tiny[:cut], tiny[cut:]
        ab = np.stack(_np_sums_short([(words, first) for _, words, first in batch]), 1)
        results.append((np.concatenate([ids for ids, _, _ in batch]), ab))
    out = np.zeros((n_out, 2), np.uint32)
    for ids, ab in results:
        out[ids] = ab
    return out


# --- the GPU kernel's work table ----------------------------------------------------------------------
ALIGN = 16  # bytes: a chunk of the aligned table starts here (vector loads)


def segments(parts: Sequence[Part]) -> tuple[list[tuple[int, int, int, int, int]], list[torch.Tensor], int]:
    """(segs, copies, n): per part with bytes, (address, rows, row bytes, first word index, first
    result index) of what is hashed; the byte views built for the other parts (`_words`: copies
    where one was needed; keep them alive until the launch has read them); the number of results.
    A contiguous whole tensor of a plain dtype at a 4-byte boundary with rows of whole words is
    read in place without building a view (the common case, a few attribute reads per tensor)."""
    segs: list[tuple[int, int, int, int, int]] = []
    copies: list[torch.Tensor] = []
    n_out = 0
    for k, p in enumerate(parts):
        t = p.tensor
        if (isinstance(t, torch.Tensor) and t.dtype in _PLAIN and not p.first_row and t.layout == torch.strided
                and t.device.type != "meta" and (t.dim() or not p.rows) and t.is_contiguous()):
            R = t.shape[0] if p.rows else 1
            nb = t.numel() * t.dtype.itemsize // R if R else 0
            addr = t.data_ptr()
            if nb % 4 == 0 and addr % 4 == 0:
                if R and nb:
                    segs.append((addr, R, nb, 0, n_out))
                n_out += R
                continue
        b, first = _words(p, p.name or f"tensor {k}")
        copies.append(b)
        R, nb = b.shape
        if R and nb:
            segs.append((b.data_ptr(), R, nb, first, n_out))
        n_out += R
    return segs, copies, n_out


def work_table(parts: Sequence[Part]) -> tuple[np.ndarray, np.ndarray, list[torch.Tensor], int]:
    """The chunks of `parts`: (table of aligned chunks, table of the rest), each int64 [C, 5] =
    (address, words, key1 base, key2 base, result index); the byte views and copies read for parts
    not read in place (`segments`); the number of results. A chunk holds at most CHUNK words of one row, never crosses
    a multiple of 2**32 word indices (its words' high index word is one), and the aligned table's
    chunks start at ALIGN-byte addresses (a row that does not starts with a chunk of its first few
    words in the other table). Both tables are new arrays (the caller may change them in place)."""
    segs, copies, n_out = segments(parts)
    main, odd = segment_tables(segs)
    return main, odd, copies, n_out


def segment_tables(segs: Sequence[tuple[int, int, int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """`work_table`'s two tables of `segments`' segs. A part's chunks depend only on its address
    mod ALIGN, rows, row bytes and first word index: they are built once per such key
    (`_seg_chunks`, cached; a step's weights, gradients and moments repeat a few hundred keys) and
    here shifted to each part's address and first result."""
    if not segs:
        return np.zeros((0, 5), np.int64), np.zeros((0, 5), np.int64)
    pieces = [_seg_chunks(addr % ALIGN, R, nb, first, CHUNK) for addr, R, nb, first, _ in segs]
    seg = np.array(segs, np.int64)
    shift, dst = seg[:, 0] - seg[:, 0] % ALIGN, seg[:, 4]
    out = []
    for which in (0, 1):
        table = np.concatenate([p[which] for p in pieces])  # a new array
        lens = [len(p[which]) for p in pieces]
        table[:, 0] += np.repeat(shift, lens)
        table[:, 4] += np.repeat(dst, lens)
        out.append(table)
    return out[0], out[1]


@functools.lru_cache(maxsize=1024)
def _seg_chunks(mis: int, R: int, nb: int, first: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The two tables of one part at address `mis` (< ALIGN) whose results start at 0, in chunks
    of at most `chunk` words (read-only)."""
    main, odd = chunk_tables([(mis, R, nb, first, 0)], chunk)
    main.setflags(write=False)
    odd.setflags(write=False)
    return main, odd


def chunk_tables(segs, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    if not segs:
        return np.zeros((0, 5), np.int64), np.zeros((0, 5), np.int64)
    addr, rows, row_nb, first0, dst0 = (np.array(c, np.int64) for c in zip(*segs))
    j = np.arange(rows.sum()) - np.repeat(np.cumsum(rows) - rows, rows)  # row index within its part
    base = np.repeat(addr, rows) + j * np.repeat(row_nb, rows)
    n, first, dst = np.repeat(row_nb // 4, rows), np.repeat(first0, rows), np.repeat(dst0, rows) + j
    peel = np.minimum(((-base) % ALIGN) // 4, n)  # words before the first aligned address
    return _chunks(base, n, first, dst, peel, chunk), _chunks(base, peel, first, dst, np.zeros_like(base), chunk)


def _chunks(base, n, first, dst, start, chunk: int) -> np.ndarray:
    """Chunks of words [start, n) of each row: at most `chunk` words, split at its multiples of the
    row-local index and where the global index first + j crosses a multiple of 2**32."""
    m = n - start
    sel = m > 0
    base, n, first, dst, start, m = base[sel], n[sel], first[sel], dst[sel], start[sel], m[sel]
    if not len(m):
        return np.zeros((0, 5), np.int64)
    counts = -(-m // chunk)
    r = np.repeat(np.arange(len(m)), counts)
    j0 = start[r] + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * chunk
    j1 = np.minimum(j0 + chunk, n[r])
    g0 = first[r] + j0
    nxt = ((g0 >> 32) + 1) << 32  # the next multiple of 2**32 in the global index
    cross = nxt < first[r] + j1
    if cross.any():  # rows past 2**32 words (16 GiB): cut those chunks there (CHUNK divides 2**32: once)
        cut = nxt[cross] - first[r[cross]]
        j1 = np.concatenate([np.where(cross, nxt - first[r], j1), j1[cross]])
        j0 = np.concatenate([j0, cut])
        r = np.concatenate([r, r[cross]])
        g0 = first[r] + j0
    lo, hi = (g0 & _M32).astype(np.uint64), (g0 >> 32).astype(np.uint64)
    k1 = (lo * np.uint64(K1) + hi * np.uint64(K3) + np.uint64(C1)) & np.uint64(_M32)
    k2 = (lo * np.uint64(K2) + hi * np.uint64(K4) + np.uint64(C2)) & np.uint64(_M32)
    return np.stack([base[r] + j0 * 4, j1 - j0, k1.astype(np.int64), k2.astype(np.int64), dst[r]], 1)


def raw_values(ab: np.ndarray) -> list[int]:
    """[N, 2] (A, B) -> N raw sums A << 32 | B as Python ints."""
    ab = ab.astype(np.uint64)
    return ((ab[:, 0] << np.uint64(32)) | ab[:, 1]).tolist()


def finalize_np(raw: np.ndarray, salts: np.ndarray) -> np.ndarray:
    """`finalize` of uint64 arrays (raw sums, salts): the fingerprints as uint64."""
    z = raw ^ salts
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def fingerprint_values(ab: np.ndarray, salts: np.ndarray) -> np.ndarray:
    """The fingerprints (uint64) of results (A, B) [N, 2] uint32 with their salts."""
    ab = ab.astype(np.uint64)
    return finalize_np((ab[:, 0] << np.uint64(32)) | ab[:, 1], salts)
