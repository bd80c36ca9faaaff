"""Order-sensitive 64-bit tensor fingerprints.

torch.hash_tensor XOR-reduces, so it cannot see a permutation, and equal values in bf16 and
fp32 can collide. We hash the raw bytes (blake2b, 8-byte digest) together with dtype and shape:
any changed bit, moved element, changed dtype or shape changes the fingerprint.
"""

from __future__ import annotations

import hashlib

import torch


def fingerprint(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint_rows(t: torch.Tensor) -> list[str]:
    """One fingerprint per row (dim 0): per-token records."""
    return [fingerprint(r) for r in t]


def state_fingerprints(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: fingerprint(v) for k, v in sorted(state.items())}


def combined(fps: dict[str, str]) -> str:
    """One fingerprint for a whole named collection (names and order included)."""
    h = hashlib.blake2b(digest_size=8)
    for k in sorted(fps):
        h.update(f"{k}={fps[k]};".encode())
    return h.hexdigest()
