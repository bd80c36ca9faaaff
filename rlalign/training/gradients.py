"""The trainer's gradients: per micro-batch into fp32 totals, over ranks, and their global norm.

topology_invariant (the default): each micro-batch's gradient is a leaf of one binary tree over
global micro-batch indices (rlalign.training.reduce): dense gradients finished on every rank from
all ranks' nodes; expert gradients on the owner, one leaf per (expert, source micro-batch). The
same bits at every trainer EP size. Otherwise: summed per rank in micro-batch order, then over
ranks in rank order (the same bits run to run, not across EP sizes)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from rlalign import kernels
from rlalign.kernels import fixed_order as fo
from rlalign.parallel.ep import ExpertParallel
from rlalign.training.reduce import TreeSum, reduce_nodes


def sum_in_rank_order(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over ranks as r0 + r1 + ... (the same bits on every rank, every run)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _into_tree(tree: TreeSum, index: int, leaf: torch.Tensor) -> None:
    """post-accumulate-grad hook of a per-source expert leaf: its gradient becomes leaf `index`."""
    tree.add(index, leaf.grad)
    leaf.grad = None


class Gradients:
    """One rank's fp32 gradients by parameter name (`grads`; sharded, after the norm: by unit key)
    and how each backward's gradients get there. Per step: start(B), then around each lockstep
    backward i: before_backward(i), after_backward(g, i) (g: this rank's global micro-batch, None
    for an empty one); finish(); then reduce() and norm()."""

    def __init__(self, model, dense_names: list[str], expert_names: list[str], invariant: bool, group,
                 world: int, reorder: str | None = None):
        self.model, self.dense_names, self.expert_names = model, dense_names, expert_names
        self.invariant, self.group, self.world, self.reorder = invariant, group, world, reorder
        self.grads: dict[str, torch.Tensor] = {}
        self.dense_flat: torch.Tensor | None = None  # the dense gradients, flat (they are views of it)
        modules = dict(model.named_modules())
        self.expert_modules = {}  # expert param name -> (its ExpertParallel module or None, attribute)
        for n in expert_names:
            owner, _, attr = n.rpartition(".")
            m = modules[owner]
            self.expert_modules[n] = (m, attr) if isinstance(m, ExpertParallel) else (None, attr)
            if isinstance(m, ExpertParallel):
                m.per_source = invariant

    def start(self, num_micro_batches: int, starts: list[range]) -> None:
        """A step over `num_micro_batches` global micro-batches; starts[r]: rank r's share."""
        self.B, self.starts, self.dense_flat = num_micro_batches, starts, None
        self.grads = {} if self.invariant and self.B else {
            n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in self.model.named_parameters()}
        self.trees = {n: TreeSum(reorder=n == self.reorder) for n in self.expert_names} if self.invariant else {}
        self.dense_tree = TreeSum()

    def before_backward(self, i: int) -> None:
        """Before the backward of lockstep step i: each per-source expert leaf (ExpertParallel under
        EP > 1) goes into its tree the moment autograd has accumulated its gradient, and that
        gradient is dropped. The tree merges sibling leaves as they come, so a backward holds one
        layer's per-source gradients at a time instead of every layer's for every source rank
        (8 x 7.2 GB of bf16 expert gradients at the 30B shape, EP 8). The same leaves at the same
        indices, hence the same sums; after_backward adds the ones no gradient reached."""
        if not self.invariant:
            return
        for n in self.expert_names:
            module, attr = self.expert_modules[n]
            if module is None:
                continue
            for s, leaves in enumerate(module.leaves):
                if i < len(self.starts[s]):
                    leaves[attr].register_post_accumulate_grad_hook(
                        functools.partial(_into_tree, self.trees[n], self.starts[s][i]))

    def after_backward(self, g: int | None, i: int) -> None:
        """The just-finished backward's gradients: tree leaves (dense ones under this rank's
        micro-batch g; each expert weight's per source rank s under s's micro-batch of this step,
        as zeros where no gradient reached), or added to the per-rank totals; then cleared."""
        if self.invariant:
            self._collect_leaves(g, i)
        else:
            for n, p in self.model.named_parameters():
                if p.grad is not None:
                    self.grads[n] += p.grad.float()
        for p in self.model.parameters():
            p.grad = None

    def _collect_leaves(self, g: int | None, i: int) -> None:
        params = dict(self.model.named_parameters())
        raw = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731
        if g is not None:  # waits in the compute dtype; the tree adds in fp32 (the same values)
            self.dense_tree.add(g, torch.cat([raw(params[n]).reshape(-1) for n in self.dense_names]))
        for n in self.expert_names:
            module, attr = self.expert_modules[n]
            if module is None:  # EP 1: the whole gradient is this micro-batch's
                if g is not None:
                    self.trees[n].add(g, raw(params[n]))
                continue
            for s, leaves in enumerate(module.leaves):
                if i < len(self.starts[s]) and not self.trees[n].has(self.starts[s][i]):
                    self.trees[n].add(self.starts[s][i], raw(leaves[attr]))
        for module in {id(m): m for m, _ in self.expert_modules.values() if m is not None}.values():
            module.leaves = []

    def finish(self) -> None:
        """Topology-invariant: the trees' totals (dense: over all ranks' nodes) become the gradients."""
        if not (self.invariant and self.B):
            return
        total = self.dense_flat = reduce_nodes(self.dense_tree, self.B, self.group)
        params, off = dict(self.model.named_parameters()), 0
        for n in self.dense_names:
            k = params[n].numel()
            self.grads[n] = total[off : off + k].view(params[n].shape)
            off += k
        for n, tree in self.trees.items():
            self.grads[n] = tree.total(self.B)

    def reduce(self) -> None:
        """Non-expert gradients summed over ranks in rank order (experts: already complete); the
        topology-invariant path has finished its tree in finish()."""
        if self.world == 1 or self.invariant:
            return
        flat = torch.cat([self.grads[n].reshape(-1) for n in self.dense_names])
        total = self.dense_flat = sum_in_rank_order(flat, self.group)
        off = 0
        for n in self.dense_names:
            k = self.grads[n].numel()
            self.grads[n] = total[off : off + k].view_as(self.grads[n])
            off += k

    def norm(self) -> float:
        """Global L2 norm. Topology-invariant: dense squares in one fixed tree, plus one sum of
        squares per global expert (computed by its owner), all gathered in global expert order
        and summed in one tree; else expert shards' sums added over ranks in rank order."""
        shared = self.dense_flat
        if shared is None:
            shared = torch.cat([self.grads[n].reshape(-1) for n in self.dense_names])
        device = self.model.lm_head.weight.device
        total = kernels.sum_of_squares(shared) if shared.numel() else torch.zeros((), device=device)
        expert = [self.grads[n] for n in self.expert_names]
        if not expert:
            return float(torch.sqrt(total))
        if self.invariant:
            per_expert = torch.cat([kernels.sum_of_squares(g.reshape(g.shape[0], -1)) for g in expert])
            if self.world > 1:
                parts = [torch.empty_like(per_expert) for _ in range(self.world)]
                dist.all_gather(parts, per_expert, group=self.group)
                # [rank][param][local expert] -> [param][global expert]
                E = len(expert)
                per_expert = torch.stack([p.view(E, -1) for p in parts], 1).reshape(-1)
            return float(torch.sqrt(total + fo.tree_sum(per_expert, 0)))
        sq = fo.tree_sum(torch.cat([g.reshape(-1) for g in expert]) ** 2, 0)
        return float(torch.sqrt(total + sum_in_rank_order(sq.reshape(1), self.group)[0]))
