"""The trainer's fp32 master weights and their AdamW (foreach=False: plain elementwise math):
whole parameters, or (trainer.shard_dense) the experts whole and this rank's dense units
(rlalign.training.shards). The update is rounded into the compute-dtype model."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from rlalign.training.shards import DEFAULT_UNIT_NUMEL, Unit, assign_units, dense_units, gather_dense, unit_rows


def adam_state(opt, m: torch.Tensor) -> dict:
    """AdamW's state of master `m`, created (step 0, zero moments) if it has none yet, so that a
    checkpoint can be loaded into it in place."""
    st = opt.state[m]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(m)
        st["exp_avg_sq"] = torch.zeros_like(m)
    return st


class MasterWeights:
    """fp32 masters + AdamW of one trainer rank. Every rank knows every dense unit and its owner."""

    def __init__(self, model, t: DictConfig, dense_names: list[str], expert_names: list[str], rank: int, world: int):
        params = dict(model.named_parameters())
        self.rank, self.world = rank, world
        self.shard = bool(t.get("shard_dense", False))
        self.units = dense_units([(n, tuple(params[n].shape)) for n in dense_names],
                                 int(t.get("shard_unit_numel", DEFAULT_UNIT_NUMEL)))
        self.owners = assign_units([u.numel for u in self.units], world) if self.shard else None
        self.units_of: dict[str, list[Unit]] = {}
        for u in self.units:
            self.units_of.setdefault(u.name, []).append(u)
        if self.shard:  # the experts whole + this rank's dense units by key
            self.master = {n: torch.nn.Parameter(params[n].detach().float().clone()) for n in expert_names}
            for u in self.my_units():
                self.master[u.key] = torch.nn.Parameter(unit_rows(params[u.name].detach(), u).float().clone())
        else:
            self.master = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in params.items()}
        self.opt = torch.optim.AdamW(
            list(self.master.values()), lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
            foreach=False, fused=False,
        ) if self.master else None  # (a rank of a dense-only model may own no unit)

    def my_units(self) -> list[Unit]:
        """The dense units whose fp32 master, AdamW state and (after the grad norm) gradient this
        rank holds: its own when sharded, every unit (views of whole tensors) otherwise."""
        if not self.shard:
            return list(self.units)
        return [u for u, r in zip(self.units, self.owners) if r == self.rank]

    def held(self, u: Unit, grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """(fp32 master, gradient or None, AdamW state or {}) of unit u on this rank (views)."""
        if self.shard:
            m = self.master[u.key]
            return m.data, grads.get(u.key), (self.opt.state.get(m, {}) if self.opt else {})
        m, g = self.master[u.name], grads.get(u.name)
        st = self.opt.state.get(m, {})
        return unit_rows(m.data, u), None if g is None else unit_rows(g, u), {
            k: (unit_rows(v, u) if k != "step" else v) for k, v in st.items()}

    def keep_own_grads(self, grads: dict[str, torch.Tensor], dense_names: list[str]) -> None:
        """Sharded: the dense gradients become copies of this rank's units (by unit key); the whole
        dense total (one flat buffer that every dense gradient is a view of) is released."""
        dense = {n: grads.pop(n) for n in dense_names}
        for u in self.my_units():
            grads[u.key] = unit_rows(dense[u.name], u).clone()

    def step(self, grads: dict[str, torch.Tensor], coef: float) -> None:
        """AdamW on the masters with the gradients scaled by the clip coefficient."""
        for n, m in self.master.items():
            m.grad = grads[n] * coef if coef < 1.0 else grads[n]
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def write_into(self, model, group) -> None:
        """The updated masters rounded into the compute-dtype model (sharded: the dense units
        all-gathered from their owners)."""
        if self.shard:
            gather_dense(model, self.master, self.units, self.owners, self.rank, self.world, group)
        for n, p in model.named_parameters():
            if n in self.master:  # unsharded: all; sharded: the experts (dense: gather_dense)
                p.copy_(self.master[n].to(p.dtype))
