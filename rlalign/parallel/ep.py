"""Expert parallelism, applied around the model's MoE layers (the model knows nothing of it).

`apply_ep(model, group)` shards every MoE layer's experts over the group's ranks (rank r owns
experts [r*E/W, (r+1)*E/W)) and swaps in `ExpertParallel`, whose forward takes the rows the
MoE layer sorted by expert, sends each block to the rank owning that expert (all-to-all),
computes there and sends the outputs back. The combine stays on the token's home rank, in
top-k slot order, in fp32 (kernels.moe_combine): with batch-invariant expert GEMMs, a token's
output bits are the same at every EP size and whatever order ranks answer in.

Two ways to move the rows: exact split sizes read on the host (training, prefill), or, once the
generator's ranks agreed on a bound of the rows any of them runs this step (`set_step_rows`), the
fixed-capacity all-to-all of rlalign.parallel.alltoall, which reads nothing on the host, so a
decode step can be captured in a CUDA graph. Same bits either way.

The ranks also split the batch (data parallel for the non-expert parts): the trainer sums the
non-expert gradients over ranks in rank order (all_gather, then r0 + r1 + ...), so the result is
the same bits on every rank and in every run (rlalign/training/trainer.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlalign import kernels
from rlalign.model.model import Experts, MoE, Transformer, expert_mlp
from rlalign.parallel import alltoall


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward sends gradients back the way rows came."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty(sum(in_splits), *g.shape[1:])
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallel(Experts):
    """This rank's shard of the experts plus the dispatch/return around their computation."""

    def __init__(self, full: Experts, group, top_k: int):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        E, d, inter = full.down_proj.shape
        if E % world:
            raise ValueError(f"ep_size={world} does not divide num_experts={E}")
        super().__init__(E // world, d, inter)
        self.group, self.world, self.rank = group, world, rank
        self.num_experts, self.num_local = E, E // world
        self.per_source, self.leaves = False, []  # set by a topology-invariant trainer
        self.top_k = top_k
        self.step_rows: int | None = None  # set_step_rows: the fixed-capacity all-to-all's bound
        self.overflow: torch.Tensor | None = None  # device flag: a step overflowed its capacity
        lo, hi = rank * self.num_local, (rank + 1) * self.num_local
        self.to(device=full.down_proj.device, dtype=full.down_proj.dtype)
        with torch.no_grad():
            self.gate_up_proj.copy_(full.gate_up_proj[lo:hi])
            self.down_proj.copy_(full.down_proj[lo:hi])

    def forward(self, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        if self.step_rows is not None and not torch.is_grad_enabled():
            return self._fixed(x_sorted, counts)
        W, El = self.world, self.num_local
        # send[r, e]: rows for rank r's local expert e; recv[s, e]: rows from rank s for my expert e
        send = torch.as_tensor(counts, dtype=torch.long, device=x_sorted.device).view(W, El)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1).clone(), group=self.group)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        x_recv = all_to_all(x_sorted, out_splits, in_splits, self.group)  # source-major, expert within
        recv_c = recv.cpu()
        if self.per_source and torch.is_grad_enabled():
            return all_to_all(self._per_source(x_recv, recv_c), in_splits, out_splits, self.group)
        # regroup expert-major: for each local expert, the rows of source 0, 1, ... in order
        starts = (torch.cumsum(recv_c.view(-1), 0) - recv_c.view(-1)).tolist()
        blocks = [(starts[s * El + e], int(recv_c[s, e])) for e in range(El) for s in range(W)]
        perm = torch.cat([torch.arange(a, a + n) for a, n in blocks]) if blocks else torch.zeros(0, dtype=torch.long)
        perm = perm.to(x_sorted.device)
        y = super().forward(x_recv.index_select(0, perm), recv_c.sum(0).tolist())
        y = y.index_select(0, torch.argsort(perm))
        return all_to_all(y, in_splits, out_splits, self.group)

    def _fixed(self, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """forward through the fixed-capacity all-to-all: no value read on the host."""
        cap = alltoall.capacity(self.step_rows, self.top_k, self.num_local)
        send = torch.as_tensor(counts, dtype=torch.long, device=x_sorted.device).view(self.world, self.num_local)
        x_recv, recv, over = alltoall.send_rows(x_sorted, send, cap, self.group)
        if self.overflow is None or self.overflow.device != over.device:
            self.overflow = torch.zeros((), dtype=torch.bool, device=over.device)
        self.overflow.logical_or_(over)
        order, dest, local_counts = alltoall.by_expert(recv, cap)
        y = expert_mlp(x_recv.index_select(0, order), local_counts, self.gate_up_proj, self.down_proj)
        return alltoall.return_rows(y.index_select(0, dest), send, cap, x_sorted.shape[0], self.group)

    def forward_tokens(self, x: torch.Tensor, order: torch.Tensor, dest: torch.Tensor, k: int,
                       counts: list[int] | torch.Tensor) -> torch.Tensor:
        """The token rows copied out (they travel to their experts' ranks), then forward."""
        return self.forward(kernels.moe_slot_rows(x, order, dest, k), counts)

    def _per_source(self, x_recv: torch.Tensor, recv_c: torch.Tensor) -> torch.Tensor:
        """Each source rank's rows through their own leaf view of this rank's expert weights, so
        that the weight gradient of every (expert, source micro-batch) block stays apart
        (`leaves[s]`, read by the trainer after backward; rlalign.training.reduce sums them in
        one tree over global micro-batches). Output bits equal the joint path's: rows are
        independent in the expert GEMMs."""
        ys, off, self.leaves = [], 0, []
        for s in range(self.world):
            n = int(recv_c[s].sum())
            gate_up = self.gate_up_proj.detach().requires_grad_()
            down = self.down_proj.detach().requires_grad_()
            ys.append(expert_mlp(x_recv[off : off + n], recv_c[s].tolist(), gate_up, down))
            self.leaves.append({"gate_up_proj": gate_up, "down_proj": down})
            off += n
        return torch.cat(ys)


def moe_layers(model: Transformer) -> list[MoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]


def apply_ep(model: Transformer, group) -> Transformer:
    """Shard experts over `group` in place; a group of size 1 leaves the model unchanged."""
    if dist.get_world_size(group) == 1:
        return model
    for moe in moe_layers(model):
        moe.experts = ExpertParallel(moe.experts, group, moe.top_k)
    return model


def set_step_rows(model: Transformer, rows: int | None) -> None:
    """The most token rows any rank of the group runs in the next steps (the same on every rank):
    the MoE layers' no-grad forwards then move rows through the fixed-capacity all-to-all, which a
    CUDA graph can capture (read at capture). None: exact sizes through the host."""
    for m in model.modules():
        if isinstance(m, ExpertParallel):
            m.step_rows = rows


def capacity_overflowed(model: Transformer) -> bool:
    """Whether a fixed-capacity step since the last call sent a rank more rows than its capacity (a
    rows bound below a step's rows: their outputs were zeros); reads the device flags and clears them."""
    hit = False
    for m in model.modules():
        if isinstance(m, ExpertParallel) and m.overflow is not None:
            hit |= bool(m.overflow)
            m.overflow.zero_()
    return hit


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def full_state_dict(model: Transformer, group) -> dict[str, torch.Tensor]:
    """The unsharded state dict on every rank (expert shards all-gathered in rank order)."""
    world = dist.get_world_size(group) if group is not None else 1
    out = {}
    for name, t in model.state_dict().items():
        if world > 1 and is_expert_param(name):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, 0)
        out[name] = t.detach().clone()
    return out


def shard_state_dict(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's slice of an unsharded state dict (experts split on dim 0)."""
    out = {}
    for name, t in full.items():
        if world > 1 and is_expert_param(name):
            n = t.shape[0] // world
            t = t[rank * n : (rank + 1) * n]
        out[name] = t
    return out
