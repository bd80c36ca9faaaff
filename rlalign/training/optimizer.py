"""The trainer's fp32 master weights and their AdamW: whole parameters, or (trainer.shard_dense) the
experts whole and this rank's dense units (rlalign.training.shards). AdamW holds the hyperparameters
and the state (step, exp_avg, exp_avg_sq: what checkpoints save); the update itself is kernels.adamw_
(one definition, IEEE fp32 operations one at a time: the same bits on every device; one pass per tensor
on the Triton backend), which also rounds the update into the compute-dtype model."""

from __future__ import annotations

from collections import defaultdict

import torch
from omegaconf import DictConfig

from rlalign import kernels
from rlalign.kernels import torch_default as _default
from rlalign.training.shards import DEFAULT_UNIT_NUMEL, Unit, assign_units, dense_units, gather_dense, unit_rows


class AdamW:
    """AdamW's hyperparameters (param_groups[0]: lr, betas, eps, weight_decay) and its state per master
    (`state[m]`: step, exp_avg, exp_avg_sq), laid out as torch.optim.AdamW lays them out; the update is
    kernels.adamw_. Not a torch.optim optimizer: building one imports torch._dynamo (~1.4 s of every
    trainer process's start on a CPU core), and its own update is not the one the bits are kept in."""

    def __init__(self, params: list[torch.Tensor], lr: float, betas, eps: float, weight_decay: float):
        self.param_groups = [{"params": list(params), "lr": lr, "betas": tuple(betas), "eps": eps,
                              "weight_decay": weight_decay}]
        self.state: defaultdict[torch.Tensor, dict] = defaultdict(dict)


def adam_state(opt: AdamW, m: torch.Tensor) -> dict:
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
        self.opt = AdamW(list(self.master.values()), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
                         ) if self.master else None  # (a rank of a dense-only model may own no unit)

    def my_units(self) -> list[Unit]:
        """The dense units whose fp32 master, AdamW state and (after the grad norm) gradient this
        rank holds: its own when sharded, every unit (views of whole tensors) otherwise."""
        if not self.shard:
            return list(self.units)
        return [u for u, r in zip(self.units, self.owners) if r == self.rank]

    def _whole(self, u: Unit) -> tuple[str, bool]:
        """(the key unit u's master and gradient are stored under, whether its rows must be cut out)."""
        return (u.key, False) if self.shard else (u.name, True)

    def _view(self, t: torch.Tensor | None, u: Unit, cut: bool) -> torch.Tensor | None:
        return unit_rows(t, u) if cut and t is not None else t

    def held(self, u: Unit, grads: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """(fp32 master, gradient or None, AdamW state or {}) of unit u on this rank (views)."""
        key, cut = self._whole(u)
        m = self.master[key]
        st = self.opt.state.get(m, {}) if self.opt else {}
        return self._view(m.data, u, cut), self._view(grads.get(key), u, cut), {
            k: (self._view(v, u, cut) if k != "step" else v) for k, v in st.items()}

    def held_for_records(self, u: Unit, grads: dict[str, torch.Tensor], moments: bool
                         ) -> tuple[torch.Tensor | None, ...]:
        """Unit u's (gradient, exp_avg, exp_avg_sq) on this rank as `held` gives them (views; None
        where absent), only the gradient without `moments`: the monitor's per-step records (no master
        view, no moment views at the steps that skip them)."""
        key, cut = self._whole(u)
        st = self.opt.state.get(self.master[key], {}) if moments and self.opt else {}
        ts = (grads.get(key), st.get("exp_avg"), st.get("exp_avg_sq")) if moments else (grads.get(key),)
        return tuple(self._view(t, u, cut) for t in ts)

    def keep_own_grads(self, grads: dict[str, torch.Tensor], dense_names: list[str]) -> None:
        """Sharded: the dense gradients become copies of this rank's units (by unit key); the whole
        dense total (one flat buffer that every dense gradient is a view of) is released."""
        dense = {n: grads.pop(n) for n in dense_names}
        for u in self.my_units():
            grads[u.key] = unit_rows(dense[u.name], u).clone()

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], coef: float, model=None) -> set[str]:
        """AdamW on the masters with the gradients scaled by the clip coefficient (coef 1.0: the
        gradients as they are; x * 1.0 == x). The masters that are whole model parameters are rounded
        into `model` in the same pass; returns their names (write_into does the rest)."""
        if self.opt is None:
            return set()
        group = self.opt.param_groups[0]
        if kernels.current()["mode"] == "default" and _fused_adamw(self.opt, self.master, grads, coef):
            return set()  # kernels.mode=default: torch's fused AdamW; write_into rounds the masters
        params = dict(model.named_parameters()) if model is not None else {}
        scalars: dict[float, torch.Tensor] = {}
        written = set()
        for n, m in self.master.items():
            st = adam_state(self.opt, m)
            st["step"] += 1
            t = float(st["step"])
            if t not in scalars:
                scalars[t] = adamw_scalars(group["lr"], group["betas"], group["eps"], group["weight_decay"], t,
                                           coef, m.device)
            out = params.get(n)
            if out is not None and (out.shape != m.shape or not out.is_contiguous()):
                out = None
            g = grads[n]
            kernels.adamw_(m.data, g if g.is_contiguous() else g.contiguous(), st["exp_avg"], st["exp_avg_sq"],
                           scalars[t], None if out is None else out.data)
            if out is not None:
                written.add(n)
        return written

    @torch.no_grad()
    def write_into(self, model, group, skip: set[str] = frozenset()) -> None:
        """The updated masters rounded into the compute-dtype model (sharded: the dense units
        all-gathered from their owners), except those `step` has written (`skip`)."""
        if self.shard:
            gather_dense(model, self.master, self.units, self.owners, self.rank, self.world, group)
        for n, p in model.named_parameters():
            if n in self.master and n not in skip:  # unsharded: all; sharded: the experts (dense: gather_dense)
                p.copy_(self.master[n].to(p.dtype))


def _fused_adamw(opt: AdamW, master: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], coef: float) -> bool:
    """kernels.mode=default: one torch._fused_adamw_ over every master (torch.optim.AdamW(fused=True)'s
    kernel, not bitwise kernels.adamw_); False (logged once) where torch has none for this device."""
    ms = list(master.values())
    if not hasattr(torch, "_fused_adamw_") or ms[0].device.type not in ("cuda", "cpu"):
        _default.fallback("adamw", "torch._fused_adamw_ is missing here", "kernels.adamw_ per tensor")
        return False
    group = opt.param_groups[0]
    sts = [adam_state(opt, m) for m in ms]
    for st in sts:
        st["step"] += 1
    steps = {float(st["step"]) for st in sts}
    gs = [g if g.is_contiguous() else g.contiguous() for g in (grads[n] for n in master)]
    if coef != 1.0:
        gs = torch._foreach_mul(gs, coef)
    on_dev = {t: torch.full((), t, dtype=torch.float32, device=ms[0].device) for t in steps}
    torch._fused_adamw_([m.data for m in ms], gs, [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts],
                        [], [on_dev[float(st["step"])] for st in sts], lr=group["lr"], beta1=group["betas"][0],
                        beta2=group["betas"][1], weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                        maximize=False)
    return True


def adamw_scalars(lr: float, betas, eps: float, weight_decay: float, step: float, coef: float,
                  device) -> torch.Tensor:
    """kernels.adamw_'s scalars for AdamW step `step` (1, 2, ...), computed in float64 as
    torch.optim.AdamW does, each rounded once to fp32: (coef, 1 - lr wd, 1 - beta1, beta2, 1 - beta2,
    1 / sqrt(1 - beta2^step), eps, -lr / (1 - beta1^step)); one small copy to the device."""
    beta1, beta2 = float(betas[0]), float(betas[1])
    vals = [coef, 1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 / (1.0 - beta2**step) ** 0.5, eps,
            -(lr / (1.0 - beta1**step))]
    t = torch.tensor(vals, dtype=torch.float32)
    if torch.device(device).type == "cuda":  # from pinned memory: an asynchronous copy
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
