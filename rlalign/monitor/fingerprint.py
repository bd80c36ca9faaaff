"""Order-sensitive 64-bit tensor fingerprints.

torch.hash_tensor XOR-reduces, so it cannot see a permutation, and equal values in bf16 and
fp32 can collide. Here the raw bytes are hashed together with a dtype/shape salt:
  - CPU tensors: blake2b (8-byte digest) of the bytes, ~1 GB/s;
  - GPU tensors: computed on the device, only 8 bytes leave it: the bytes as 32-bit words, each
    mixed (splitmix64) with its position and the salt, summed mod 2^64 (integer addition is
    associative: the same bits in any reduction order).
Any changed bit, moved element, other dtype or other shape changes the fingerprint. The two
methods give different values: compare fingerprints taken on the same device type.
`row_fingerprints` (one per token row, for per-token divergence reports) always uses the mix.
"""

from __future__ import annotations

import hashlib
import zlib

import torch

from rlalign.kernels.sampling import mix64

_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                   torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                   torch.bool])}


def _words(t: torch.Tensor) -> torch.Tensor:
    """[N, W] int64 words (32 bits each) of the rows of t viewed as [N, -1] bytes."""
    t = t.detach().contiguous()
    n = t.shape[0] if t.dim() else 1
    b = t.reshape(n, -1).view(torch.uint8) if t.numel() else torch.zeros(n, 0, dtype=torch.uint8, device=t.device)
    if b.shape[1] == 0:
        return torch.zeros(n, 0, dtype=torch.long, device=t.device)
    pad = (-b.shape[1]) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(n, pad)], 1)
    return b.view(torch.int32).long() & 0xFFFFFFFF


def _salt(t: torch.Tensor, row_shape: tuple) -> int:
    code = _DTYPE_CODE.get(t.dtype, 99)
    return zlib.crc32(f"{code}|{row_shape}".encode())


def row_fingerprints(t: torch.Tensor) -> torch.Tensor:
    """One 64-bit fingerprint per row (dim 0) as an int64 tensor on t's device."""
    w = _words(t)
    cols = torch.arange(w.shape[1], device=w.device, dtype=torch.long)
    salt = _salt(t, tuple(t.shape[1:]))
    h = mix64(w ^ mix64(cols + salt)[None, :])
    return mix64(h.sum(1) ^ salt)


def fingerprint(t: torch.Tensor) -> str:
    """The whole tensor (shape included) as 16 hex digits."""
    if t.device.type == "cpu":

        c = t.detach().contiguous()
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{c.dtype}|{tuple(c.shape)}|".encode())
        if c.numel():
            h.update(c.reshape(-1).view(torch.uint8).numpy().data)
        return h.hexdigest()
    flat = t.reshape(1, -1)
    rows = row_fingerprints(flat)
    v = int(mix64(rows ^ _salt(t, tuple(t.shape)))[0])
    return f"{v & 0xFFFFFFFFFFFFFFFF:016x}"


def state_fingerprints(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: fingerprint(v) for k, v in sorted(state.items())}


def combined(fps: dict[str, str]) -> str:
    """One fingerprint for a whole named collection (names and order included)."""

    h = hashlib.blake2b(digest_size=8)
    for k in sorted(fps):
        h.update(f"{k}={fps[k]};".encode())
    return h.hexdigest()
