"""One rank of the trainer group: the policy model in its compute dtype, fp32 master weights with
AdamW, and (optionally) an expert-parallel process group.

A step: micro-batches of sequences -> scored with the generator's logprob function -> loss ->
backward; each micro-batch's gradients are added to fp32 accumulators in a fixed order;
non-expert gradients are summed over ranks in rank order; global-norm clipping with a norm
reduced in a fixed order; AdamW (foreach=False: plain elementwise math) on the fp32 masters,
which are then rounded into the model. Every rank runs the same number of micro-batches (empty
ones included) so that the MoE all-to-alls of forward and backward stay in lockstep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from kernels import fixed_order as fo
from rlalign.factory import model_from_config
from rlalign.parallel.ep import apply_ep, full_state_dict, is_expert_param, shard_state_dict
from rlalign.training.scoring import micro_batches, score_micro_batch


@dataclass
class Sample:
    """One finished sequence as the trainer sees it."""

    prompt: list[int]
    response: list[int]
    generator_logprobs: torch.Tensor  # [len(response)] fp32
    advantage: float = 0.0
    ref_logprobs: torch.Tensor | None = None


# loss_fn(logprobs per sample, samples) -> (sum of per-token losses, {stat: sum over tokens})
LossFn = Callable[[list[torch.Tensor], list[Sample]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


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


class Trainer:
    def __init__(self, cfg: DictConfig, group=None):
        self.cfg, self.group = cfg, group
        self.model = model_from_config(cfg)
        if group is not None:
            apply_ep(self.model, group)
        self.device = self.model.lm_head.weight.device
        t = cfg.trainer
        self.names = [n for n, p in self.model.named_parameters()]
        self.master = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in self.model.named_parameters()}
        self.opt = torch.optim.AdamW(
            list(self.master.values()), lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
            foreach=False, fused=False,
        )
        g = cfg.generator
        self.score_kw = dict(
            layout=t.layout, temperature=1.0 if g.greedy else g.temperature, top_k=g.top_k, top_p=g.top_p,
        )

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    # --- scoring and gradients -------------------------------------------------------------
    @torch.no_grad()
    def score(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Logprobs of this rank's samples (no grad), micro-batched like training."""
        mbs = micro_batches(len(samples), self.cfg.trainer.micro_batch_size)
        out: list[torch.Tensor] = []
        for i in range(_max_over_ranks(len(mbs), self.group, self.device)):
            mb = [samples[j] for j in mbs[i]] if i < len(mbs) else []
            out += score_micro_batch(self.model, [s.prompt for s in mb], [s.response for s in mb], **self.score_kw)
        return [x.float().cpu() for x in out]

    def forward_backward(self, samples: Sequence[Sample], loss_fn: LossFn, global_tokens: int) -> dict[str, float]:
        """Accumulate d(sum of token losses / global_tokens) into fp32 gradients (self.grads)."""
        self.grads = {n: torch.zeros_like(m) for n, m in self.master.items()}
        stats: dict[str, torch.Tensor] = {}
        mbs = micro_batches(len(samples), self.cfg.trainer.micro_batch_size)
        for i in range(_max_over_ranks(len(mbs), self.group, self.device)):
            mb = [samples[j] for j in mbs[i]] if i < len(mbs) else []
            if mb:
                lps = score_micro_batch(self.model, [s.prompt for s in mb], [s.response for s in mb], **self.score_kw)
                loss, st = loss_fn(lps, mb)
                for k, v in st.items():
                    stats[k] = stats.get(k, 0.0) + v.detach().double()
            else:  # still runs forward and backward through the MoE collectives
                loss = self.model(torch.zeros(0, dtype=torch.long, device=self.device), [0]).float().sum() * 0.0
            (loss / max(1, global_tokens)).backward()
            for n, p in self.model.named_parameters():
                if p.grad is not None:
                    self.grads[n] += p.grad.float()
                    p.grad = None
        return {k: float(v) for k, v in stats.items()}

    def reduce_grads(self) -> None:
        """Non-expert gradients summed over ranks in rank order (experts: already complete)."""
        if self.world == 1:
            return
        shared = [n for n in self.names if not is_expert_param(n)]
        flat = torch.cat([self.grads[n].reshape(-1) for n in shared])
        total = _sum_in_rank_order(flat, self.group)
        off = 0
        for n in shared:
            k = self.grads[n].numel()
            self.grads[n] = total[off : off + k].view_as(self.grads[n])
            off += k

    def grad_norm(self) -> float:
        """Global L2 norm: shared grads counted once, expert shards summed over ranks in order."""
        shared = [self.grads[n].reshape(-1) for n in self.names if not is_expert_param(n)]
        expert = [self.grads[n].reshape(-1) for n in self.names if is_expert_param(n)]
        sq = lambda ts: fo.tree_sum(torch.cat(ts) ** 2, 0) if ts else torch.zeros((), device=self.device)  # noqa: E731
        total = sq(shared) + _sum_in_rank_order(sq(expert).reshape(1), self.group)[0]
        return float(torch.sqrt(total))

    def optimizer_step(self) -> dict[str, float]:
        self.reduce_grads()
        norm = self.grad_norm()
        clip = self.cfg.trainer.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip and clip > 0 else 1.0
        for n, m in self.master.items():
            m.grad = self.grads[n] * coef if coef < 1.0 else self.grads[n]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.master[n].to(p.dtype))
        return {"grad_norm": norm, "grad_clip_coef": coef}

    # --- weights -------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model, self.group)

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        local = shard_state_dict(full, self.rank, self.world)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(local[n].to(p.dtype))
                self.master[n].copy_(local[n].float())
