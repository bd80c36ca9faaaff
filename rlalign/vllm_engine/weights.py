"""Weights by name into an rlalign Transformer, for vLLM's loader and weight pushes: HF names
(experts one by one, or fused) or rlalign's own; under EP only this rank's experts are kept."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from rlalign.model import Transformer
from rlalign.parallel.ep import is_expert_param

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_named(model: Transformer, weights: Iterable[tuple[str, torch.Tensor]], rank: int, world: int,
               prefix: str = "") -> set[str]:
    """Copy tensors into `model` (this rank's expert shard of each expert tensor); every name must
    be one of the model's, with its shape. Returns the loaded parameter names, with `prefix`."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    with torch.no_grad():
        for name, t in weights:
            m = _EXPERT.match(name)
            if m:
                per_expert.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
                continue
            if name == "lm_head.weight" and model.args.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"weights: unexpected tensor {name!r} for this model")
            if world > 1 and is_expert_param(name):
                n = params[name].shape[0]
                t = t[rank * n : (rank + 1) * n]
            _copy(params[name], t, name)
            loaded.add(name)
        for pre, experts in per_expert.items():
            gate_up, down = params.get(f"{pre}.gate_up_proj"), params.get(f"{pre}.down_proj")
            if gate_up is None:
                raise ValueError(f"weights: unexpected tensor {pre}.*: layer has no experts")
            n = gate_up.shape[0]
            for e in range(rank * n, (rank + 1) * n):
                got = experts.get(e, {})
                for part in ("gate_proj", "up_proj", "down_proj"):
                    if part not in got:
                        raise ValueError(f"weights: missing tensor {pre}.{e}.{part}.weight")
                _copy(gate_up[e - rank * n], torch.cat([got["gate_proj"], got["up_proj"]], 0), f"{pre}.{e}.gate/up")
                _copy(down[e - rank * n], got["down_proj"], f"{pre}.{e}.down_proj.weight")
            loaded.update({f"{pre}.gate_up_proj", f"{pre}.down_proj"})
    if model.args.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights: missing tensor {missing[0]!r} (expected shape {tuple(params[missing[0]].shape)})")
    return {prefix + n for n in loaded}


def _copy(p: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(f"weights: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
    p.copy_(t.to(device=p.device, dtype=p.dtype))
