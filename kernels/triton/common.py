"""Shared by the Triton kernel modules: the interpreter switch, dtype/device checks, the SM count
and one LRU cache of work tables and launch plans."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROW_BLOCK = 1024  # rmsnorm / logprob / combine chunk along the row
SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def _check(name: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype not in SUPPORTED:
            raise TypeError(f"triton {name}: dtype {t.dtype} is not supported ({', '.join(map(str, SUPPORTED))})")
    devs = {t.device for t in ts}
    if len(devs) > 1:
        raise ValueError(f"triton {name}: tensors on different devices {sorted(map(str, devs))}")


def _num_sms(device) -> int:
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_CACHE: OrderedDict = OrderedDict()  # work tables and GEMM launch plans, by content (LRU)


def _cached(key: tuple, build):
    """build() once per key (LRU of 1024): a training step calls the same shapes layer after layer,
    so the host work per launch is one lookup and no host-to-device copy."""
    v = _CACHE.get(key)
    if v is None:
        v = _CACHE[key] = build()
        if len(_CACHE) > 1024:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return v


def _table(key: tuple, build, device) -> torch.Tensor:
    """The device tensor of build() -> (list of int rows, dtype), cached by key."""
    def make():
        rows, dtype = build()
        return torch.tensor(rows, dtype=dtype).to(device, non_blocking=True)
    return _cached((key, device), make)

