"""One rank of the trainer group: the policy model in its compute dtype, fp32 master weights with
AdamW, and (optionally) an expert-parallel process group.

A step: micro-batches of sequences -> scored with the generator's logprob function -> loss ->
backward; each micro-batch's gradients are added to fp32 accumulators in a fixed order;
non-expert gradients are summed over ranks in rank order; global-norm clipping with a norm
reduced in a fixed order; AdamW (foreach=False: plain elementwise math) on the fp32 masters,
which are then rounded into the model. Every rank runs the same number of micro-batches (empty
ones included) so that the MoE all-to-alls of forward and backward stay in lockstep.

trainer.shard_dense (ZeRO-1/2 style): the dense (non-expert) fp32 masters and AdamW moments are
split across the ranks in units (`dense_units`: row blocks of at most trainer.shard_unit_numel
elements, starting at 64-element offsets; their identity depends on the shapes and that budget,
never on the number of ranks), contiguous runs of units per rank (`assign_units`). The dense
gradient total is finished on every rank as without sharding and the grad norm is computed from
it exactly as before; then each rank keeps copies of its own units' gradients only, runs AdamW
(the same elementwise math on a slice as on the whole tensor: tests/test_shard.py) on its units,
and the compute-dtype weights are all-gathered so that every rank's model is the same bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from rlalign.factory import model_from_config, sampling_params
from rlalign.kernels import fixed_order as fo
from rlalign.monitor.taps import Injection
from rlalign.parallel.ep import ExpertParallel, apply_ep, full_state_dict, is_expert_param
from rlalign.parallel.launch import shard_range
from rlalign.training.losses import policy_loss
from rlalign.training.reduce import TreeSum, reduce_nodes
from rlalign.training.scoring import micro_batches, score_micro_batch


@dataclass
class Sample:
    """One finished sequence as the trainer sees it."""

    prompt: list[int]
    response: list[int]
    generator_logprobs: torch.Tensor  # [len(response)] fp32
    advantage: float = 0.0
    sample_id: int | None = None


# loss_fn(logprobs per sample, indices of those samples) -> (sum of token losses, {stat: value})
LossFn = Callable[[list[torch.Tensor], list[int]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def merge_stat(key: str, a: float | None, b: float) -> float:
    if a is None:
        return b
    return max(a, b) if key.endswith("_max") else min(a, b) if key.endswith("_min") else a + b


def step_plan(n: int, micro_batch_size: int, num_minibatches: int) -> list[list[list[int]]]:
    """The step's work as a fixed partition of its n sequences, whatever the number of ranks:
    minibatches (one optimizer update each) of global micro-batches of global sample indices."""
    out = []
    for k in range(num_minibatches):
        part = list(shard_range(n, num_minibatches, k))
        out.append([[part[j] for j in mb] for mb in micro_batches(len(part), micro_batch_size)])
    return out


DEFAULT_UNIT_NUMEL = 4 * 1024 * 1024  # trainer.shard_unit_numel's default (16 MiB of fp32)
UNIT_ALIGN = 64  # every unit starts at a multiple of this many elements of its parameter


@dataclass(frozen=True)
class Unit:
    """Rows [lo, hi) of dense parameter `name` (elements of a 1-d one): the unit of dense sharding.
    `key` names it in checkpoints and traces: the parameter's own name when one unit covers the
    whole parameter, else 'NAME/rows{lo}-{hi}'."""

    name: str
    lo: int
    hi: int
    numel: int
    key: str


def dense_units(shapes: list[tuple[str, tuple[int, ...]]], budget: int) -> list[Unit]:
    """Every parameter of `shapes` (in that order) cut into row blocks of at most `budget`
    elements (at least one row), each block a whole number of UNIT_ALIGN-element groups except a
    parameter's last: a unit's elements sit at the same offsets, modulo the vector width, as in
    the whole tensor, so a vectorised kernel with a scalar tail treats them alike. Depends only on
    the shapes and the budget, never on the number of ranks."""
    out = []
    for name, shape in shapes:
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if shape else 1
        step = UNIT_ALIGN // math.gcd(row, UNIT_ALIGN) if row else 1
        per = max(step, (budget // max(1, row)) // step * step)
        cuts = list(range(0, rows, per)) + [rows]
        for lo, hi in zip(cuts, cuts[1:]):
            key = name if (lo, hi) == (0, rows) else f"{name}/rows{lo}-{hi}"
            out.append(Unit(name, lo, hi, (hi - lo) * row, key))
    return out


def assign_units(sizes: list[int], world: int) -> list[int]:
    """The owner rank of each unit: contiguous runs in unit order, unit i to the rank whose
    1/world of the total its midpoint falls in (integer arithmetic; balanced to within one unit
    at each boundary)."""
    total, off, out = sum(sizes), 0, []
    for s in sizes:
        out.append(min(world - 1, (2 * off + s) * world // (2 * total)) if total else 0)
        off += s
    return out


def _rows(t: torch.Tensor, u: Unit) -> torch.Tensor:
    return (t if t.dim() else t.reshape(1))[u.lo : u.hi]


def _adam_state(opt, m: torch.Tensor) -> dict:
    """AdamW's state of master `m`, created (step 0, zero moments) if it has none yet, so that a
    checkpoint can be loaded into it in place."""
    st = opt.state[m]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(m)
        st["exp_avg_sq"] = torch.zeros_like(m)
    return st


def sum_of_squares(x: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """fo.tree_sum(x ** 2, 0) of a 1-d x, the same bits, without x ** 2 in memory: the tree's first
    level (element i + element i + h, h = next_pow2(n) / 2) is built chunk by chunk from squares of
    at most `chunk` elements; the rest of the tree is tree_sum's own loop on that level (n = h)."""
    n = x.shape[0]
    if n <= 1:
        return fo.tree_sum(x**2, 0)
    h = fo.next_pow2(n) // 2
    m = n - h  # elements i < m have a partner i + h; m <= i < h pass up alone
    level = torch.empty(h, dtype=x.dtype, device=x.device)
    for a in range(0, h, chunk):
        b = min(h, a + chunk)
        level[a:b] = x[a:b] ** 2
        if a < m:
            e = min(b, m)
            level[a:e] += x[a + h : e + h] ** 2
    return fo.tree_sum(level, 0)


def _max_over_ranks(n: int, group, device) -> int:
    if group is None:
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _sum_in_rank_order(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over ranks as r0 + r1 + ... (the same bits on every rank, every run)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def micro_batch_share(num_micro_batches: int, world: int, rank: int) -> range:
    """Rank r runs global micro-batches r, r + W, r + 2W, ... (W = world): the ranks' i-th
    micro-batches, run in lockstep, are the consecutive indices iW .. iW + W - 1, so the expert
    gradient leaves that an owner receives from every source rank in one lockstep step are
    siblings in the gradient tree (rlalign.training.reduce) and merge at once — with contiguous
    shares they would wait for their siblings, one fp32 copy of the rank's experts per source rank
    (issue 15: 8 x 14.5 GB at the 30B shape). Which rank runs a micro-batch changes no sum: the
    tree is over global indices."""
    return range(rank, num_micro_batches, world)


def _into_tree(tree: TreeSum, index: int, leaf: torch.Tensor) -> None:
    """post-accumulate-grad hook of a per-source expert leaf: its gradient becomes leaf `index`."""
    tree.add(index, leaf.grad)
    leaf.grad = None


class Trainer:
    def __init__(self, cfg: DictConfig, group=None):
        self.cfg, self.group = cfg, group
        self.model = model_from_config(cfg)
        if group is not None:
            apply_ep(self.model, group)
        self.device = self.model.lm_head.weight.device
        t = cfg.trainer
        self.names = [n for n, p in self.model.named_parameters()]
        params = dict(self.model.named_parameters())
        self.dense_names = [n for n in self.names if not is_expert_param(n)]
        self.expert_names = [n for n in self.names if is_expert_param(n)]
        # dense sharding (module docstring): every rank knows every unit and its owner
        self.shard = bool(t.get("shard_dense", False))
        self.units = dense_units([(n, tuple(params[n].shape)) for n in self.dense_names],
                                 int(t.get("shard_unit_numel", DEFAULT_UNIT_NUMEL)))
        self.owners = assign_units([u.numel for u in self.units], self.world) if self.shard else None
        self.units_of: dict[str, list[Unit]] = {}
        for u in self.units:
            self.units_of.setdefault(u.name, []).append(u)
        # fp32 masters: whole parameters, or (sharded) experts whole + this rank's dense units by key
        if self.shard:
            self.master = {n: torch.nn.Parameter(params[n].detach().float().clone()) for n in self.expert_names}
            for u in self.my_units():
                self.master[u.key] = torch.nn.Parameter(_rows(params[u.name].detach(), u).float().clone())
        else:
            self.master = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in params.items()}
        self.opt = torch.optim.AdamW(
            list(self.master.values()), lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
            foreach=False, fused=False,
        ) if self.master else None  # (a rank of a dense-only model may own no unit)
        self.grads: dict[str, torch.Tensor] = {}  # fp32, by parameter name (sharded, after a step: unit key)
        self._dense_flat: torch.Tensor | None = None  # the dense gradients, flat (they are views of it)
        self.ref_model = None
        if cfg.get("algorithm") is not None and cfg.algorithm.kl_coef > 0:
            self.ref_model = model_from_config(cfg).requires_grad_(False)  # the initial policy
            if group is not None:
                apply_ep(self.ref_model, group)
        self.score_kw = dict(layout=t.layout, **sampling_params(cfg).logprob_kwargs())
        self.invariant = bool(t.get("topology_invariant", True))
        inject = Injection(cfg.monitor.get("inject"), "trainer") if cfg.get("monitor") else None
        self.reorder = inject.site if inject is not None and inject.kind == "reorder" else None
        modules = dict(self.model.named_modules())
        self.expert_modules = {}  # expert param name -> (its ExpertParallel module or None, attribute)
        for n in self.expert_names:
            owner, _, attr = n.rpartition(".")
            m = modules[owner]
            self.expert_modules[n] = (m, attr) if isinstance(m, ExpertParallel) else (None, attr)
            if isinstance(m, ExpertParallel):
                m.per_source = self.invariant

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def my_units(self) -> list[Unit]:
        """The dense units whose fp32 master, AdamW state and (after the grad norm) gradient this
        rank holds: its own when sharded, every unit (views of whole tensors) otherwise."""
        if not self.shard:
            return list(self.units)
        return [u for u, r in zip(self.units, self.owners) if r == self.rank]

    def _held(self, u: Unit) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """(fp32 master, gradient or None, AdamW state or {}) of unit u on this rank (views)."""
        if self.shard:
            m = self.master[u.key]
            return m.data, self.grads.get(u.key), (self.opt.state.get(m, {}) if self.opt else {})
        m, g = self.master[u.name], self.grads.get(u.name)
        st = self.opt.state.get(m, {})
        return _rows(m.data, u), None if g is None else _rows(g, u), {
            k: (_rows(v, u) if k != "step" else v) for k, v in st.items()}

    def dense_state_numel(self) -> dict[str, int]:
        """Elements of dense fp32 state this rank holds: masters, AdamW moments, gradients (the
        memory record of dense sharding; the compute-dtype model copy is whole on every rank)."""
        out = {"master": 0, "adamw": 0, "grad": 0}
        for u in self.my_units():
            m, g, st = self._held(u)
            out["master"] += m.numel()
            out["adamw"] += sum(st[k].numel() for k in ("exp_avg", "exp_avg_sq") if k in st)
            out["grad"] += 0 if g is None else g.numel()
        return out

    # --- scoring and gradients -------------------------------------------------------------
    @torch.no_grad()
    def score(self, samples: Sequence[Sample], model=None) -> list[torch.Tensor]:
        """Logprobs of this rank's samples (no grad), micro-batched like training."""
        model = model or self.model
        mbs = micro_batches(len(samples), self.cfg.trainer.micro_batch_size)
        out: list[torch.Tensor] = []
        for i in range(_max_over_ranks(len(mbs), self.group, self.device)):
            mb = [samples[j] for j in mbs[i]] if i < len(mbs) else []
            out += score_micro_batch(model, [s.prompt for s in mb], [s.response for s in mb], **self._kw(mb))
        if not out:
            return []
        flat = torch.cat([x.float() for x in out]).cpu()  # one device-to-host copy
        return [x.clone() for x in flat.split([x.numel() for x in out])]

    def _kw(self, mb: list[Sample]) -> dict:
        ids = [s.sample_id for s in mb]
        return {**self.score_kw, "sample_ids": ids if None not in ids else None}

    def train_step(self, samples: list[Sample], alg) -> tuple[dict[int, torch.Tensor], list[tuple[tuple, dict]]]:
        """PPO epochs over the step's minibatches. `samples` is the WHOLE step (every rank gets
        the same list) so that minibatches and micro-batches are a fixed partition of it (see
        step_plan); this rank runs its share of each minibatch's micro-batches (micro_batch_share).
        Returns this rank's samples' pre-update logprobs by global index (what the monitor
        compares with the generator's) and stat records keyed (epoch, minibatch, micro-batch),
        which the driver merges in key order: the same bits at every trainer EP size."""
        plan = step_plan(len(samples), self.cfg.trainer.micro_batch_size, alg.num_minibatches)
        mine = [i for mbs in plan for mb in self.my_micro_batches(mbs)[1] for i in mb]
        updates = alg.ppo_epochs * alg.num_minibatches
        captured: dict[int, torch.Tensor] = {}
        if updates > 1 or self.cfg.trainer.separate_scoring_pass:
            captured = dict(zip(mine, self.score([samples[i] for i in mine])))
        ref = None
        if self.ref_model is not None:
            ref = dict(zip(mine, self.score([samples[i] for i in mine], self.ref_model)))
        records: list[tuple[tuple, dict]] = []
        for epoch in range(alg.ppo_epochs):
            for k, mbs in enumerate(plan):

                def loss_fn(lps, idx):
                    new = [(lp, j) for lp, j in zip(lps, idx) if j not in captured]  # single update: pre-update
                    if new:  # one device-to-host copy per micro-batch (each sample's own tensor: Ray pickles
                        flat = torch.cat([lp.detach().float() for lp, _ in new]).cpu()  # whole storages)
                        for (_, j), x in zip(new, flat.split([lp.numel() for lp, _ in new])):
                            captured[j] = x.clone()
                    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)  # noqa: E731
                    return policy_loss(
                        torch.cat(lps),
                        cat([samples[j].generator_logprobs for j in idx]),
                        cat([captured[j] for j in idx]),
                        cat([torch.full((len(samples[j].response),), samples[j].advantage) for j in idx]),
                        alg,
                        cat([ref[j] for j in idx]) if ref is not None else None,
                    )

                for g, st in self.forward_backward(samples, loss_fn, mbs=mbs).items():
                    records.append(((epoch, k, g), st))
                upd = self.optimizer_step()
                records.append(((epoch, k, len(mbs)), {"grad_norm_max": upd["grad_norm"],
                                                       "grad_norm_last": upd["grad_norm"]}))
        return {i: captured[i] for i in mine}, records

    def my_micro_batches(self, mbs: list[list[int]]) -> tuple[range, list[list[int]]]:
        """This rank's share of a minibatch's global micro-batches (indices, contents): every
        world-th one (micro_batch_share)."""
        share = micro_batch_share(len(mbs), self.world, self.rank)
        return share, [mbs[g] for g in share]

    def forward_backward(self, samples: Sequence[Sample], loss_fn: LossFn, global_tokens: int | None = None,
                         mbs: list[list[int]] | None = None) -> dict[int, dict[str, float]]:
        """d(sum of token losses / global_tokens) into fp32 gradients (self.grads) over the global
        micro-batches `mbs` (lists of indices into `samples`, the same on every rank; default:
        all samples in micro_batch_size chunks), this rank running its share. Returns each of its
        micro-batches' stats by global micro-batch index. topology_invariant: each micro-batch's
        gradient is a leaf of one tree over global micro-batch indices (dense: finished on every
        rank from all ranks' nodes; experts: on the owner, one leaf per (expert, source
        micro-batch)): the same bits at every EP size. Otherwise: summed per rank in order, then
        over ranks in rank order (the same bits run to run, not across EP sizes)."""
        if mbs is None:
            mbs = [list(mb) for mb in micro_batches(len(samples), self.cfg.trainer.micro_batch_size)]
        if global_tokens is None:
            global_tokens = sum(len(samples[j].response) for mb in mbs for j in mb)
        B, W = len(mbs), self.world
        share, mine = self.my_micro_batches(mbs)
        starts = [micro_batch_share(B, W, r) for r in range(W)]
        # fp32 gradients by parameter name (the topology-invariant path fills them after the loop)
        self._dense_flat = None
        self.grads = {} if self.invariant and B else {
            n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in self.model.named_parameters()}
        trees = {n: TreeSum(reorder=n == self.reorder) for n in self.expert_names} if self.invariant else {}
        dense_tree = TreeSum()
        stats: dict[int, dict[str, float]] = {}
        for i in range(len(starts[0])):  # rank 0 has the most: every rank steps in lockstep
            idx = mine[i] if i < len(mine) else []
            mb = [samples[j] for j in idx]
            if mb:
                lps = score_micro_batch(self.model, [s.prompt for s in mb], [s.response for s in mb], **self._kw(mb))
                loss, st = loss_fn(lps, idx)
                vals = [torch.as_tensor(v, device=self.device).float().reshape(()) for v in st.values()]
                stats[share[i]] = dict(zip(st, torch.stack(vals).tolist() if vals else []))  # one host read
            else:  # still runs forward and backward through the MoE collectives
                loss = self.model(torch.zeros(0, dtype=torch.long, device=self.device), [0]).float().sum() * 0.0
            if self.invariant:
                self._hook_expert_leaves(i, starts, trees)
            (loss / max(1, global_tokens)).backward()
            if self.invariant:
                self._collect_leaves(share[i] if mb else None, i, starts, dense_tree, trees)
            else:
                for n, p in self.model.named_parameters():
                    if p.grad is not None:
                        self.grads[n] += p.grad.float()
            for p in self.model.parameters():
                p.grad = None
        if self.invariant and B:
            total = self._dense_flat = reduce_nodes(dense_tree, B, self.group)
            params, off = dict(self.model.named_parameters()), 0
            for n in self.dense_names:
                k = params[n].numel()
                self.grads[n] = total[off : off + k].view(params[n].shape)
                off += k
            for n, tree in trees.items():
                self.grads[n] = tree.total(B)
        return stats

    def _hook_expert_leaves(self, i: int, starts: list[range], trees: dict) -> None:
        """Before the backward of step i: each per-source expert leaf (ExpertParallel under EP > 1)
        goes into its tree the moment autograd has accumulated its gradient, and that gradient is
        dropped. The tree merges sibling leaves as they come, so a backward holds one layer's
        per-source gradients at a time instead of every layer's for every source rank (issue 15:
        8 x 7.2 GB of bf16 expert gradients at the 30B shape, EP 8). The same leaves at the same
        indices, hence the same sums; `_collect_leaves` adds the ones no gradient reached."""
        for n in self.expert_names:
            module, attr = self.expert_modules[n]
            if module is None:
                continue
            for s, leaves in enumerate(module.leaves):
                if i < len(starts[s]):
                    leaves[attr].register_post_accumulate_grad_hook(
                        functools.partial(_into_tree, trees[n], starts[s][i]))

    def _collect_leaves(self, g: int | None, i: int, starts: list[range], dense_tree: TreeSum, trees: dict) -> None:
        """The just-finished backward's gradients as tree leaves: dense ones under this rank's
        micro-batch g; each expert weight's per source rank s under s's micro-batch of this step
        (those the backward's hooks have not added: leaves that no gradient reached, as zeros)."""
        params = dict(self.model.named_parameters())
        raw = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731
        if g is not None:  # waits in the compute dtype; the tree adds in fp32 (the same values)
            dense_tree.add(g, torch.cat([raw(params[n]).reshape(-1) for n in self.dense_names]))
        for n in self.expert_names:
            module, attr = self.expert_modules[n]
            if module is None:  # EP 1: the whole gradient is this micro-batch's
                if g is not None:
                    trees[n].add(g, raw(params[n]))
                continue
            for s, leaves in enumerate(module.leaves):
                if i < len(starts[s]) and not trees[n].has(starts[s][i]):
                    trees[n].add(starts[s][i], raw(leaves[attr]))
        for module in {id(m): m for m, _ in self.expert_modules.values() if m is not None}.values():
            module.leaves = []

    def reduce_grads(self) -> None:
        """Non-expert gradients summed over ranks in rank order (experts: already complete); the
        topology-invariant path has finished its tree in forward_backward."""
        if self.world == 1 or self.invariant:
            return
        flat = torch.cat([self.grads[n].reshape(-1) for n in self.dense_names])
        total = self._dense_flat = _sum_in_rank_order(flat, self.group)
        off = 0
        for n in self.dense_names:
            k = self.grads[n].numel()
            self.grads[n] = total[off : off + k].view_as(self.grads[n])
            off += k

    def grad_norm(self) -> float:
        """Global L2 norm. Topology-invariant: dense squares in one fixed tree, plus one sum of
        squares per global expert (computed by its owner), all gathered in global expert order
        and summed in one tree; else expert shards' sums added over ranks in rank order."""
        shared = self._dense_flat
        if shared is None:
            shared = torch.cat([self.grads[n].reshape(-1) for n in self.dense_names])
        total = sum_of_squares(shared) if shared.numel() else torch.zeros((), device=self.device)
        expert = [self.grads[n] for n in self.expert_names]
        if not expert:
            return float(torch.sqrt(total))
        if self.invariant:
            per_expert = torch.cat([fo.tree_sum(g.reshape(g.shape[0], -1) ** 2, 1) for g in expert])
            if self.world > 1:
                parts = [torch.empty_like(per_expert) for _ in range(self.world)]
                dist.all_gather(parts, per_expert, group=self.group)
                # [rank][param][local expert] -> [param][global expert]
                E = len(expert)
                per_expert = torch.stack([p.view(E, -1) for p in parts], 1).reshape(-1)
            return float(torch.sqrt(total + fo.tree_sum(per_expert, 0)))
        sq = fo.tree_sum(torch.cat([g.reshape(-1) for g in expert]) ** 2, 0)
        return float(torch.sqrt(total + _sum_in_rank_order(sq.reshape(1), self.group)[0]))

    def optimizer_step(self) -> dict[str, float]:
        self.reduce_grads()
        norm = self.grad_norm()  # from the whole dense gradient, sharded or not: the same bits
        if self.shard:
            self._keep_own_grads()
        clip = self.cfg.trainer.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip and clip > 0 else 1.0
        for n, m in self.master.items():
            m.grad = self.grads[n] * coef if coef < 1.0 else self.grads[n]
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            if self.shard:
                self._gather_dense()
            for n, p in self.model.named_parameters():
                if n in self.master:  # unsharded: all; sharded: the experts (dense: _gather_dense)
                    p.copy_(self.master[n].to(p.dtype))
        return {"grad_norm": norm, "grad_clip_coef": coef}

    def _keep_own_grads(self) -> None:
        """Sharded: the dense gradients become copies of this rank's units (by unit key); the whole
        dense total (one flat buffer that every dense gradient is a view of) is released."""
        dense = {n: self.grads.pop(n) for n in self.dense_names}
        self._dense_flat = None
        for u in self.my_units():
            self.grads[u.key] = _rows(dense[u.name], u).clone()

    def _gather_dense(self) -> None:
        """Sharded: every rank's updated dense units, rounded to the model's dtype on their owner,
        all-gathered as bytes (one buffer per rank, padded to the largest) into every rank's model:
        the same bits as rounding the whole master on every rank."""
        params = dict(self.model.named_parameters())

        def raw(u: Unit) -> torch.Tensor:
            return self.master[u.key].detach().to(params[u.name].dtype).reshape(-1).view(torch.uint8)

        def put(u: Unit, data: torch.Tensor) -> None:
            p = params[u.name]
            dst = _rows(p.data, u)
            dst.copy_(data.view(p.dtype).view(dst.shape))

        mine = self.my_units()
        if self.world == 1:
            for u in mine:
                put(u, raw(u))
            return
        nbytes = lambda u: u.numel * params[u.name].element_size()  # noqa: E731
        per_rank = [[u for u, r in zip(self.units, self.owners) if r == k] for k in range(self.world)]
        size = max(sum(nbytes(u) for u in us) for us in per_rank)
        local = torch.zeros(size, dtype=torch.uint8, device=self.device)
        off = 0
        for u in mine:
            local[off : off + nbytes(u)] = raw(u)
            off += nbytes(u)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        for k, us in enumerate(per_rank):
            off = 0
            for u in us:
                put(u, parts[k][off : off + nbytes(u)])
                off += nbytes(u)

    def topology_records(self) -> dict[str, torch.Tensor]:
        """Gradients, AdamW moments and weights under names that depend neither on the EP size nor
        on dense sharding: the compute-dtype weights of non-expert parameters on rank 0; their
        gradients and moments per dense unit ('NAME', or 'NAME/rows{lo}-{hi}' for a parameter cut
        into several units) on rank 0, or (sharded) on the unit's owner; expert tensors per global
        expert ('NAME/expert{e}') on their owner. The union over ranks is the same set at every
        trainer EP size, sharded or not (the gates compare it across EP sizes)."""
        out: dict[str, torch.Tensor] = {}
        for name, t, first in self.topology_record_groups():
            out.update({f"{name}{first + e}": t[e] for e in range(t.shape[0])} if first is not None else {name: t})
        return out

    def topology_record_groups(self) -> list[tuple[str, torch.Tensor, int | None]]:
        """topology_records as (name, tensor, None) and, for an expert tensor, ('.../expert', the
        rank's stacked tensor, its first global expert): row e is record name + str(first + e), read
        in place. In name order ('grad/' < 'optim/' < 'weights/', then parameter names)."""
        out: list[tuple[str, torch.Tensor, int | None]] = []
        params = dict(self.model.named_parameters())
        held = {u.key: self._held(u) for u in self.my_units()} if self.shard or self.rank == 0 else {}
        for n in self.names:
            if is_expert_param(n):
                st = self.opt.state.get(self.master[n], {})
                tensors = {"grad": self.grads.get(n), "optim/exp_avg": st.get("exp_avg"),
                           "optim/exp_avg_sq": st.get("exp_avg_sq"), "weights": params[n].data}
                for prefix, t in tensors.items():
                    if t is not None:
                        out.append((f"{prefix}/{n}/expert", t, self.rank * t.shape[0]))
                continue
            mine = [u.key for u in self.units_of[n] if u.key in held]
            for prefix, get in (("grad", lambda h: h[1]), ("optim/exp_avg", lambda h: h[2].get("exp_avg")),
                                ("optim/exp_avg_sq", lambda h: h[2].get("exp_avg_sq"))):
                for key in mine:
                    if get(held[key]) is not None:
                        out.append((f"{prefix}/{key}", get(held[key]), None))
            if self.rank == 0:
                out.append((f"weights/{n}", params[n].data, None))
        return sorted(out, key=lambda item: item[0].removesuffix("/expert") if item[2] is not None else item[0])

    # --- checkpoint state (torch.distributed.checkpoint) -----------------------------------------
    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Flat {key: tensor} of model, fp32 masters and AdamW state. Keys depend neither on the EP
        size nor on dense sharding: expert tensors per global expert ('.../expert{e}'); dense
        masters and AdamW state per dense unit ('master/KEY', 'optim/KEY/exp_avg', ...; KEY is the
        parameter's name unless it is cut into several units), held by every rank (unsharded: views
        of the whole tensors) or by the unit's owner (sharded); the compute-dtype model whole on
        every rank. The values are views, so loading in place restores the trainer."""
        flat: dict[str, torch.Tensor] = {}
        params = dict(self.model.named_parameters())
        for n in self.dense_names:
            flat[f"model/{n}"] = params[n].data
        for n in self.expert_names:
            st = _adam_state(self.opt, self.master[n])
            off = self.rank * params[n].shape[0]
            for key, t in ((f"model/{n}", params[n].data), (f"master/{n}", self.master[n].data),
                           (f"optim/{n}/exp_avg", st["exp_avg"]), (f"optim/{n}/exp_avg_sq", st["exp_avg_sq"])):
                for i in range(t.shape[0]):
                    flat[f"{key}/expert{off + i}"] = t[i]
            flat[f"optim/{n}/step"] = st["step"]
        if not self.shard:  # before the first step: create AdamW's state so it can be loaded into
            for n in self.dense_names:
                _adam_state(self.opt, self.master[n])
        for u in self.my_units():
            if self.shard:
                _adam_state(self.opt, self.master[u.key])
            m, _, st = self._held(u)
            flat[f"master/{u.key}"] = m
            flat[f"optim/{u.key}/exp_avg"] = st["exp_avg"]
            flat[f"optim/{u.key}/exp_avg_sq"] = st["exp_avg_sq"]
            flat[f"optim/{u.key}/step"] = st["step"]  # unsharded: the parameter's one step, per unit
        return flat

    # --- weights -------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model, self.group)
