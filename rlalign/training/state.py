"""The trainer's state under names that depend neither on the EP size nor on dense sharding:
checkpoints (torch.distributed.checkpoint) and trace records (the gates compare them)."""

from __future__ import annotations

import torch

from rlalign.parallel.ep import is_expert_param
from rlalign.training.optimizer import MasterWeights, adam_state


def checkpoint_state(model, weights: MasterWeights, grads: dict, dense_names: list[str], expert_names: list[str],
                     rank: int) -> dict[str, torch.Tensor]:
    """Flat {key: tensor} of model, fp32 masters and AdamW state. Expert tensors per global expert
    ('.../expert{e}'); dense masters and AdamW state per dense unit ('master/KEY',
    'optim/KEY/exp_avg', ...; KEY is the parameter's name unless it is cut into several units),
    held by every rank (unsharded: views of the whole tensors) or by the unit's owner (sharded);
    the compute-dtype model whole on every rank. The values are views, so loading in place
    restores the trainer."""
    flat: dict[str, torch.Tensor] = {}
    params, opt = dict(model.named_parameters()), weights.opt
    for n in dense_names:
        flat[f"model/{n}"] = params[n].data
    for n in expert_names:
        st = adam_state(opt, weights.master[n])
        off = rank * params[n].shape[0]
        for key, t in ((f"model/{n}", params[n].data), (f"master/{n}", weights.master[n].data),
                       (f"optim/{n}/exp_avg", st["exp_avg"]), (f"optim/{n}/exp_avg_sq", st["exp_avg_sq"])):
            for i in range(t.shape[0]):
                flat[f"{key}/expert{off + i}"] = t[i]
        flat[f"optim/{n}/step"] = st["step"]
    if not weights.shard:  # before the first step: create AdamW's state so it can be loaded into
        for n in dense_names:
            adam_state(opt, weights.master[n])
    for u in weights.my_units():
        if weights.shard:
            adam_state(opt, weights.master[u.key])
        m, _, st = weights.held(u, grads)
        flat[f"master/{u.key}"] = m
        flat[f"optim/{u.key}/exp_avg"] = st["exp_avg"]
        flat[f"optim/{u.key}/exp_avg_sq"] = st["exp_avg_sq"]
        flat[f"optim/{u.key}/step"] = st["step"]  # unsharded: the parameter's one step, per unit
    return flat


def topology_records(model, weights: MasterWeights, grads: dict, rank: int) -> dict[str, torch.Tensor]:
    """Gradients, AdamW moments and weights: the compute-dtype weights of non-expert parameters on
    rank 0; their gradients and moments per dense unit ('NAME', or 'NAME/rows{lo}-{hi}' for a
    parameter cut into several units) on rank 0, or (sharded) on the unit's owner; expert tensors
    per global expert ('NAME/expert{e}') on their owner. The union over ranks is the same set at
    every trainer EP size, sharded or not (the gates compare it across EP sizes)."""
    out: dict[str, torch.Tensor] = {}
    for name, t, first in topology_record_groups(model, weights, grads, rank):
        out.update({f"{name}{first + e}": t[e] for e in range(t.shape[0])} if first is not None else {name: t})
    return out


def topology_record_groups(model, weights: MasterWeights, grads: dict, rank: int, moments: bool = True
                           ) -> list[tuple[str, torch.Tensor, int | None]]:
    """topology_records as (name, tensor, None) and, for an expert tensor, ('.../expert', the rank's
    stacked tensor, its first global expert): row e is record name + str(first + e), read in place.
    In name order ('grad/' < 'optim/' < 'weights/', then parameter names). moments=False: without the
    AdamW moments ('optim/' records), whose views are then not built."""
    out: list[tuple[str, torch.Tensor, int | None]] = []
    params = dict(model.named_parameters())
    mine = {u.key: u for u in weights.my_units()} if weights.shard or rank == 0 else {}
    kinds = ("grad", "optim/exp_avg", "optim/exp_avg_sq") if moments else ("grad",)
    for n in params:
        if is_expert_param(n):
            st = weights.opt.state.get(weights.master[n], {})
            tensors = {"grad": grads.get(n), "weights": params[n].data}
            if moments:
                tensors.update({"optim/exp_avg": st.get("exp_avg"), "optim/exp_avg_sq": st.get("exp_avg_sq")})
            for prefix, t in tensors.items():
                if t is not None:
                    out.append((f"{prefix}/{n}/expert", t, rank * t.shape[0]))
            continue
        for u in weights.units_of[n]:
            if u.key in mine:
                for prefix, t in zip(kinds, weights.held_for_records(u, grads, moments)):
                    if t is not None:
                        out.append((f"{prefix}/{u.key}", t, None))
        if rank == 0:
            out.append((f"weights/{n}", params[n].data, None))
    return sorted(out, key=lambda item: item[0].removesuffix("/expert") if item[2] is not None else item[0])
