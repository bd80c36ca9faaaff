"""The step's work as a fixed partition, whatever the number of trainer ranks: minibatches of
global micro-batches of its sequences (rlalign.sequences.Sample; step_partition), and which rank
runs which micro-batch (micro_batch_share)."""

from __future__ import annotations

from rlalign.parallel.launch import shard_range
from rlalign.training.scoring import micro_batches


def step_partition(n: int, micro_batch_size: int, num_minibatches: int) -> list[list[list[int]]]:
    """The step's work as a fixed partition of its n sequences, whatever the number of ranks:
    minibatches (one optimizer update each) of global micro-batches of global sample indices."""
    out = []
    for k in range(num_minibatches):
        part = list(shard_range(n, num_minibatches, k))
        out.append([[part[j] for j in mb] for mb in micro_batches(len(part), micro_batch_size)])
    return out


def micro_batch_share(num_micro_batches: int, world: int, rank: int) -> range:
    """Rank r runs global micro-batches r, r + W, r + 2W, ... (W = world): the ranks' i-th
    micro-batches, run in lockstep, are the consecutive indices iW .. iW + W - 1, so the expert
    gradient leaves that an owner receives from every source rank in one lockstep step are
    siblings in the gradient tree (rlalign.training.reduce) and merge at once — with contiguous
    shares they would wait for their siblings, one fp32 copy of the rank's experts per source rank
    (8 x 14.5 GB at the 30B shape). Which rank runs a micro-batch changes no sum: the
    tree is over global indices."""
    return range(rank, num_micro_batches, world)
