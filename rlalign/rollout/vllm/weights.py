"""Weights by name into an rlalign Transformer, for vLLM's loader and weight pushes: HF names
(experts one by one, or fused) or rlalign's own; under EP only this rank's experts are kept."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlalign.model import Transformer
from rlalign.model.hf import fuse_experts, group_experts, require_experts
from rlalign.parallel.ep import is_expert_param


def load_named(model: Transformer, weights: Iterable[tuple[str, torch.Tensor]], rank: int, world: int,
               prefix: str = "") -> set[str]:
    """Copy tensors into `model` (this rank's expert shard of each expert tensor); every name must
    be one of the model's, with its shape. Returns the loaded parameter names, with `prefix`."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    per_layer, named = group_experts(weights)
    with torch.no_grad():
        for name, t in named.items():
            if name == "lm_head.weight" and model.args.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"weights: unexpected tensor {name!r} for this model")
            if world > 1 and is_expert_param(name):
                n = params[name].shape[0]
                t = t[rank * n : (rank + 1) * n]
            _copy(params[name], t, name)
            loaded.add(name)
        for pre, per_expert in per_layer.items():
            gate_up, down = params.get(f"{pre}.gate_up_proj"), params.get(f"{pre}.down_proj")
            if gate_up is None:
                raise ValueError(f"weights: unexpected tensor {pre}.*: layer has no experts")
            mine = range(rank * gate_up.shape[0], (rank + 1) * gate_up.shape[0])
            require_experts(pre, per_expert, mine, "weights")
            fused_gate_up, fused_down = fuse_experts(per_expert, mine)
            _copy(gate_up, fused_gate_up, f"{pre}.{mine.start}..{mine.stop - 1}.gate/up_proj.weight")
            _copy(down, fused_down, f"{pre}.{mine.start}..{mine.stop - 1}.down_proj.weight")
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
