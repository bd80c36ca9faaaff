"""Order-sensitive 64-bit tensor fingerprints for the monitor, the weight sync and checkpoints.

The definition and its kernels live in rlalign.kernels.fingerprint: the bytes as words, each
mixed with its position, two integer sums, a dtype/shape salt. Any changed bit, moved element,
other dtype or other shape changes the value. It is the same value on every device and for any
batching of tensors into launches: a fingerprint taken on the GPU (a trace record, a checkpoint's
meta.json, the weight sync) equals the one taken of the same tensor on the CPU (numpy, or the
Triton kernel under TRITON_INTERPRET=1), so every fingerprint is comparable with every other.

    fingerprint(t), state_fingerprints({name: t})   now: one launch, one read back
    launch(parts) -> Pending                         launched now, read back when ready (traces)
    row_fingerprints(t)                              one per dim-0 row (per-token reports)
    combined(fps)                                    one fingerprint of a named collection
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from rlalign import kernels
from rlalign.kernels.fingerprint import Part, fingerprint_values, result_salts

__all__ = ["Part", "Pending", "combined", "fingerprint", "launch", "result_salts", "row_fingerprints",
           "state_fingerprints"]


class Pending:
    """Fingerprints launched on the tensors' device (their values as of the launch, in stream
    order) and copied to pinned host memory behind an event: `ready()` never waits, `hex()` waits
    only if the copy has not landed yet. On the CPU they are computed at once."""

    def __init__(self, sums: torch.Tensor, salts: np.ndarray):
        self.salts = salts
        if sums.is_cuda:
            self._host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            self._host.copy_(sums, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = sums, None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def values(self) -> np.ndarray:
        """The fingerprints as uint64 (waits for the copy if it has not landed)."""
        if self._event is not None:
            self._event.synchronize()
        return fingerprint_values(self._host.numpy().view(np.uint32), self.salts)

    def hex(self) -> list[str]:
        h = self.values().astype(">u8").tobytes().hex()  # big-endian bytes: each value's 16 hex digits
        return [h[i : i + 16] for i in range(0, len(h), 16)]


def launch(parts: Sequence[Part]) -> Pending:
    """One launch (per device) over all parts: their results in order (rows parts: one per row)."""
    return Pending(kernels.fingerprint_sums(parts), result_salts(parts))


def fingerprint(t: torch.Tensor) -> str:
    """The whole tensor (dtype and shape included) as 16 hex digits."""
    return launch([Part(t)]).hex()[0]


def state_fingerprints(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name: fingerprint} in name order, all tensors in one launch per device."""
    names = sorted(state)
    out: dict[str, str] = {}
    for device in dict.fromkeys(state[n].device for n in names):
        mine = [n for n in names if state[n].device == device]
        out.update(zip(mine, launch([Part(state[n], name=n) for n in mine]).hex()))
    return {n: out[n] for n in names}


def row_fingerprints(t: torch.Tensor) -> torch.Tensor:
    """One fingerprint per dim-0 row (each row a tensor of shape t.shape[1:]), int64 on the CPU."""
    return torch.from_numpy(launch([Part(t, rows=True)]).values().view(np.int64))


def combined(fps: dict[str, str]) -> str:
    """One fingerprint for a whole named collection (names and order included)."""
    h = hashlib.blake2b(digest_size=8)
    for k in sorted(fps):
        h.update(f"{k}={fps[k]};".encode())
    return h.hexdigest()
