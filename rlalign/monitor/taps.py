"""What the monitor hangs on the model's taps: per-token row fingerprints, per-op trace records,
and (for tests of the monitor itself) injected faults.

Per-token rows are keyed by (sample id, position) — the same key on the generator (prefill and
decode steps) and on the trainer (teacher-forced micro-batches) — so a token whose logprobs
differ can be traced back to the first op where its row, or an earlier row of its sequence,
stopped matching.

Injection specs (monitor.inject = "<side>:<site>:<kind>"), side generator|trainer|both:
  <site>:default   run that module (layers.{i}.attn or layers.{i}.mlp) with the default,
                   non-batch-invariant kernels
  <site>:noise     flip the last bit of a random element at that tap (not repeatable)
  sampling:seed    the generator samples with seed + 1
"""

from __future__ import annotations

import os

import numpy as np
import torch

from rlalign import kernels
from rlalign.fingerprint import Part, Pending, result_salts
from rlalign.monitor.trace import Trace


class Injection:
    def __init__(self, spec: str | None, side: str):
        self.site = self.kind = None
        if not spec:
            return
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in ("generator", "trainer", "both") or parts[2] not in (
            "default", "noise", "seed", "reorder"
        ):
            raise ValueError(f"monitor.inject={spec!r}: expected '<generator|trainer|both>:<site>:"
                             "<default|noise|seed|reorder>' (reorder: trainer:<parameter name>)")
        if parts[0] in (side, "both"):
            self.site, self.kind = parts[1], parts[2]

    @property
    def seed_offset(self) -> int:
        return 1 if (self.site, self.kind) == ("sampling", "seed") else 0

    def apply(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "noise" or name != self.site or x.numel() == 0:
            return x
        flat = x.detach().reshape(-1).clone()
        i = int.from_bytes(os.urandom(4), "little") % flat.numel()  # a random element: not repeatable
        flat[i : i + 1].view({2: torch.int16, 4: torch.int32}[x.element_size()]).bitwise_xor_(1)
        return x + (flat.view(x.shape) - x.detach())

    def wrap_modules(self, model) -> None:
        """site:default -> that module runs with the default (not batch-invariant) kernels."""
        if self.kind != "default":
            return
        parts = self.site.split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in ("attn", "mlp"):
            raise ValueError(f"monitor.inject site {self.site!r}: expected layers.<i>.attn or layers.<i>.mlp")
        layer = model.model.layers[int(parts[1])]
        mod = layer.self_attn if parts[2] == "attn" else layer.mlp
        for method in ("forward", "decode", "paged"):
            if hasattr(mod, method):
                orig = getattr(mod, method)

                def run_default(*a, _orig=orig, **k):
                    with kernels.use(mode="default"):
                        return _orig(*a, **k)

                setattr(mod, method, run_default)


class TapRecorder:
    """model.taps = TapRecorder(...): row fingerprints by (sample id, position), trace records.
    A tap launches its rows' fingerprints on the device and goes on; `pop_table` reads all of
    them back at once (one copy per device, not one host sync per tap)."""

    def __init__(self, rows: bool, trace: Trace | None, injection: Injection | None = None, layers: bool = False):
        self.rows, self.trace, self.layers, self.injection = rows, trace, layers, injection
        self.table: dict[tuple[int, int], dict[str, int]] = {}
        self._launched: list[tuple[list, str, torch.Tensor, np.ndarray]] = []  # (row keys, op, sums, salts)
        self.prefix, self.keys = "", None

    @property
    def inert(self) -> bool:
        """Records nothing and injects nothing: a CUDA graph may run without calling it."""
        return not self.rows and not (self.layers and self.trace is not None) and (
            self.injection is None or self.injection.kind is None)

    def set_rows(self, prefix: str, keys: list[tuple[int, int]] | None) -> None:
        self.prefix, self.keys = prefix, keys

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.injection is not None:
            x = self.injection.apply(name, x)
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


def attach_taps(model, inject: str | None, side: str) -> TapRecorder:
    """The monitor's taps on one side's model: fault injection (monitor.inject) wrapped into its
    modules, and a recorder (rows off, no trace until a run opens one) as `model.taps`."""
    injection = Injection(inject, side)
    injection.wrap_modules(model)
    model.taps = TapRecorder(rows=False, trace=None, injection=injection)
    return model.taps
