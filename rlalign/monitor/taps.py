"""What the monitor hangs on the model's taps: per-token row fingerprints, per-op trace records,
and the side's injected faults (rlalign.faults: an op's output perturbed, a module on the default
kernels), for tests of the monitor itself.

Per-token rows are keyed by (sample id, position) — the same key on the generator (prefill and
decode steps) and on the trainer (teacher-forced micro-batches) — so a token whose logprobs
differ can be traced back to the first op where its row, or an earlier row of its sequence,
stopped matching.
"""

from __future__ import annotations

import numpy as np
import torch

from rlalign import kernels
from rlalign.faults import SideFaults
from rlalign.fingerprint import Part, Pending, result_salts
from rlalign.monitor.trace import Trace


class TapRecorder:
    """model.taps = TapRecorder(...): row fingerprints by (sample id, position), trace records.
    A tap launches its rows' fingerprints on the device and goes on; `pop_table` reads all of
    them back at once (one copy per device, not one host sync per tap)."""

    def __init__(self, rows: bool, trace: Trace | None, faults: SideFaults | None = None, layers: bool = False):
        self.rows, self.trace, self.layers, self.faults = rows, trace, layers, faults
        self.table: dict[tuple[int, int], dict[str, int]] = {}
        self._launched: list[tuple[list, str, torch.Tensor, np.ndarray]] = []  # (row keys, op, sums, salts)
        self.prefix, self.keys = "", None

    @property
    def inert(self) -> bool:
        """Records nothing and injects nothing: a CUDA graph may run without calling it."""
        return not self.rows and not (self.layers and self.trace is not None) and (
            self.faults is None or not self.faults.touches_ops)

    def set_rows(self, prefix: str, keys: list[tuple[int, int]] | None) -> None:
        self.prefix, self.keys = prefix, keys

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.faults is not None and self.faults.noise:
            x = self.faults.apply(name, x)
        if self.rows and self.keys is not None and x.shape[0] == len(self.keys) and x.shape[0]:
            part = [Part(x, rows=True, name=name)]
            self._launched.append((self.keys, name, kernels.fingerprint_sums(part), result_salts(part)))
        if self.layers and self.trace is not None:
            self.trace.record(f"{self.prefix}{name}", x)
        return x

    def pop_table(self) -> dict:
        """{(sample id, position): {op: row fingerprint}} since the last call; the first forward of
        a token wins."""
        launched, self._launched = self._launched, []
        for device in dict.fromkeys(s.device for _, _, s, _ in launched):
            mine = [x for x in launched if x[2].device == device]
            values = Pending(torch.cat([s for _, _, s, _ in mine]), np.concatenate([x[3] for x in mine]))
            values = iter(values.values().view(np.int64).tolist())
            for keys, name, _, _ in mine:
                for key in keys:
                    self.table.setdefault(key, {}).setdefault(name, next(values))
        t, self.table = self.table, {}
        return t


def set_rows(model, prefix: str, keys) -> None:
    """Tell the model's recorder (if any) which (sample id, position) each row of the next call is."""
    taps = getattr(model, "taps", None)
    if isinstance(taps, TapRecorder):
        taps.set_rows(prefix, keys)


def tap(model, name: str, x: torch.Tensor) -> torch.Tensor:
    """A tap outside the model's forward (e.g. the sampled tokens), under the same recorder."""
    taps = getattr(model, "taps", None)
    return x if taps is None else taps(name, x)


def attach_taps(model, side: str) -> TapRecorder:
    """The monitor's taps on one side's model: the side's injected faults (rlalign.faults) wrapped into
    its modules, and a recorder (rows off, no trace until a run opens one) as `model.taps`."""
    faults = SideFaults(side)
    faults.wrap_modules(model)
    model.taps = TapRecorder(rows=False, trace=None, faults=faults)
    return model.taps
