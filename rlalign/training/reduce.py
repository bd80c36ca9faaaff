"""Gradient sums whose bits do not depend on the topology.

A step's gradient is a sum over global micro-batches (a fixed partition of the step's
sequences, independent of the number of ranks). `TreeSum` adds the per-micro-batch gradients in
ONE binary tree over the global micro-batch indices 0..B-1 (padded to a power of two; a missing
right child leaves the left one as it is): node [a, a+2s) = node [a, a+s) + node [a+s, a+2s).
A rank holding any set of leaves builds every node whose leaves it holds, so that nodes computed
on different ranks are the same bits; `reduce_nodes` then finishes the same tree on every rank
from the nodes all ranks hold. EP 1 (all leaves on one rank) and EP 4 (a quarter each) compute
identical nodes, hence identical sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlalign import kernels


class TreeSum:
    """Leaves by global index; complete sibling pairs are merged as soon as both exist. A leaf may
    come in a narrower float dtype (a bf16 autograd gradient): it is kept as it is until it is
    added, in fp32 (the conversion is exact: the same sums as fp32 leaves, half the memory while
    a leaf waits for its sibling); every node and the root are fp32.
    reorder=True (an injected fault, RLALIGN_FAULT='reorder:trainer:<param>': rlalign.faults) keeps the leaves and
    sums them last to first instead: another grouping, which the baseline gate must catch."""

    def __init__(self, reorder: bool = False) -> None:
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}  # (start, size) -> partial sum
        self.reorder = reorder

    def add(self, index: int, value: torch.Tensor) -> None:
        a, size, v = index, 1, value
        if (a, size) in self.nodes:
            raise ValueError(f"gradient of global micro-batch {index} added twice")
        if self.reorder:
            self.nodes[(a, size)] = v
            return
        _merge(self.nodes, a, size, v)

    def has(self, index: int) -> bool:
        """Whether leaf `index` has been added (merged nodes count for the leaves they hold)."""
        return any(a <= index < a + size for a, size in self.nodes)

    def total(self, num_leaves: int) -> torch.Tensor | None:
        """The root over leaves 0..num_leaves-1 (every one of them must have been added)."""
        if self.reorder:
            out = None
            for key in sorted(self.nodes, reverse=True):
                out = self.nodes[key].float() if out is None else out + self.nodes[key].float()
            return out
        return _root(self.nodes, num_leaves)


def _merge(nodes: dict[tuple[int, int], torch.Tensor], a: int, size: int, v: torch.Tensor) -> None:
    """Put node [a, a+size) into `nodes`, merging it with its sibling (left child + right child) as
    long as the sibling is there: nodes stay maximal complete subtrees, whatever the arrival order.
    When the merged node's own sibling is there too, both adds are one pass (kernels.add_f32's
    three-term form; IEEE addition commutes, so the parent's operand order is the tree's)."""
    while True:
        sibling = (a ^ size, size)
        if sibling not in nodes:
            nodes[(a, size)] = v
            return
        other = nodes.pop(sibling)
        left, right = (v, other) if a < sibling[0] else (other, v)
        a, size = min(a, sibling[0]), size * 2
        uncle = (a ^ size, size)
        if uncle in nodes:  # (left + right) + uncle, the next merge, in one pass
            v = kernels.add_f32(nodes.pop(uncle), left, right)
            a, size = min(a, uncle[0]), size * 2
        else:
            v = kernels.add_f32(left, right)


def _root(nodes: dict[tuple[int, int], torch.Tensor], num_leaves: int) -> torch.Tensor | None:
    if num_leaves == 0:
        return None
    size = 1
    while size < num_leaves:
        size *= 2

    def node(a: int, s: int):
        if a >= num_leaves:
            return None
        if (a, s) in nodes:
            return nodes[(a, s)]
        if s == 1:
            raise ValueError(f"gradient of global micro-batch {a} is missing")
        left, right = node(a, s // 2), node(a + s // 2, s // 2)
        return left if right is None else kernels.add_f32(left, right)

    out = node(0, size)
    return None if out is None else out.float()


def reduce_nodes(tree: TreeSum, num_leaves: int, group) -> torch.Tensor | None:
    """Finish the tree on every rank of `group` from all ranks' nodes (a node is computed by
    exactly one rank and broadcast, in fp32, by it; nodes go in the order of their first leaf,
    whichever rank holds them). Complete sibling pairs are merged as they arrive, so a rank holds
    O(log num_leaves) received nodes at a time however the leaves are dealt to the ranks (at
    trainer EP 8 the dense nodes of a 30B model are 6 GB each); the sums are the tree's."""
    if group is None or dist.get_world_size(group) == 1:
        return tree.total(num_leaves)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    keys: list = [None] * world
    dist.all_gather_object(keys, sorted(tree.nodes), group=group)
    like = next(iter(tree.nodes.values()), None)
    shapes = [None] * world
    dist.all_gather_object(shapes, None if like is None else tuple(like.shape), group=group)
    shape = next(s for s in shapes if s is not None)
    dev = like.device if like is not None else _device(group)
    nodes: dict[tuple[int, int], torch.Tensor] = {}
    for key, r in sorted((tuple(k), src) for src in range(world) for k in keys[src]):
        t = tree.nodes[key].float() if r == me else torch.empty(shape, dtype=torch.float32, device=dev)
        dist.broadcast(t, src=dist.get_global_rank(group, r), group=group)
        _merge(nodes, key[0], key[1], t)
    return _root(nodes, num_leaves)


def _device(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device(
        "cpu")
