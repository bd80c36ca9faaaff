"""The gradient tree of rlalign/training/reduce.py: the root over B leaves is the same bits however
the leaves are dealt to ranks (strided, as the trainer deals micro-batches, or contiguous) and
whatever order the ranks' nodes arrive in — including reduce_nodes' merging of sibling pairs as
they arrive in leaf order, which keeps O(log B) nodes alive instead of one per rank."""

import pytest
import torch
from conftest import same_bits

from rlalign.parallel.launch import shard_range
from rlalign.training.partition import micro_batch_share
from rlalign.training.reduce import TreeSum, _merge, _root


def _leaves(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(33, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("deal", [micro_batch_share, shard_range])
@pytest.mark.parametrize("num_leaves", [1, 2, 5, 8, 13, 32])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_streamed_merge_of_rank_nodes_is_the_one_tree(num_leaves, world, deal):
    leaves = _leaves(num_leaves)
    whole = TreeSum()
    for i, x in enumerate(leaves):
        whole.add(i, x)
    ref = whole.total(num_leaves)
    ranks = []
    for r in range(world):
        t = TreeSum()
        for i in deal(num_leaves, world, r):
            t.add(i, leaves[i])
        ranks.append(t)
    union = {k: v for t in ranks for k, v in t.nodes.items()}
    assert same_bits(_root(union, num_leaves), ref)  # all nodes at once (the old reduce_nodes)
    arrivals = sorted((k, r) for r in range(world) for k in ranks[r].nodes)  # reduce_nodes: leaf order
    for order in (arrivals, arrivals[::-1], sorted(arrivals, key=lambda kr: kr[1])):  # + rank-major
        nodes, peak = {}, 0
        for key, r in order:
            _merge(nodes, key[0], key[1], ranks[r].nodes[key])
            peak = max(peak, len(nodes))
        assert same_bits(_root(nodes, num_leaves), ref)
        if order is arrivals:
            assert peak <= max(1, num_leaves).bit_length() + 1


def test_strided_shares_merge_each_lockstep_step_at_once():
    """The trainer's deal (micro_batch_share): the ranks' i-th micro-batches are consecutive
    indices, so an expert owner's tree, fed one lockstep step at a time by every source rank, holds
    one node per set bit of the number of steps done (at most 2 over 4 steps). Twin: contiguous
    shares hold that many per source rank (8 at 4 ranks)."""
    B, W = 16, 4

    def peak(deal):
        t, most = TreeSum(), 0
        for i in range(len(deal(B, W, 0))):
            for s in range(W):
                t.add(deal(B, W, s)[i], torch.ones(3))
            most = max(most, len(t.nodes))
        assert same_bits(t.total(B), torch.full((3,), float(B)))
        return most

    assert peak(micro_batch_share) == 2
    assert peak(shard_range) == 2 * W


def test_negative_twin_a_running_sum_is_other_bits():
    leaves = _leaves(13, seed=1)
    tree = TreeSum()
    for i, x in enumerate(leaves):
        tree.add(i, x)
    running = leaves[0]
    for x in leaves[1:]:
        running = running + x
    assert not same_bits(running, tree.total(13))


@pytest.mark.parametrize("num_leaves", [1, 2, 3, 5, 8])
def test_bf16_leaves_sum_in_fp32_as_their_conversions_do(num_leaves):
    """Leaves may wait in bf16 (the expert gradients' own dtype): every addition is in fp32, so the
    root is the fp32 tree of their exact conversions, in any arrival order. Twin: the same tree
    added in bf16 is other bits."""
    g = torch.Generator().manual_seed(num_leaves)
    leaves = [(torch.randn(257, generator=g) * 10 ** torch.randn(257, generator=g)).bfloat16()
              for _ in range(num_leaves)]
    ref = TreeSum()
    for i, v in enumerate(leaves):
        ref.add(i, v.float())
    want = ref.total(num_leaves)
    for order in (range(num_leaves), reversed(range(num_leaves))):
        t = TreeSum()
        for i in order:
            t.add(i, leaves[i])
            assert t.has(i) and not t.has(num_leaves)
        got = t.total(num_leaves)
        assert got.dtype == torch.float32 and same_bits(got, want)
    if num_leaves > 2:
        low = TreeSum()
        for i, v in enumerate(leaves):
            low.nodes[(i, 1)] = v  # bypass add: a tree summed in bf16 throughout
        assert not same_bits(_root_bf16(low.nodes, num_leaves).float(), want)


def _root_bf16(nodes, n):
    out = nodes[(0, 1)]
    size = 1
    while size < n:  # the same pairing, bf16 additions
        level = {}
        for a in range(0, n, 2 * size):
            left, right = nodes.get((a, size)), nodes.get((a + size, size))
            level[(a, 2 * size)] = left if right is None else left + right
        nodes, size = level, size * 2
        out = nodes[(0, size)]
    return out
