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

from rlalign.factory import model_from_config, sampling_params
from rlalign.kernels import fixed_order as fo
from rlalign.parallel.ep import apply_ep, full_state_dict, is_expert_param
from rlalign.parallel.launch import shard_range
from rlalign.training.losses import policy_loss
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
        self.ref_model = None
        if cfg.get("algorithm") is not None and cfg.algorithm.kl_coef > 0:
            self.ref_model = model_from_config(cfg).requires_grad_(False)  # the initial policy
            if group is not None:
                apply_ep(self.ref_model, group)
        self.score_kw = dict(layout=t.layout, **sampling_params(cfg).logprob_kwargs())

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

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
        return [x.float().cpu() for x in out]

    def _kw(self, mb: list[Sample]) -> dict:
        ids = [s.sample_id for s in mb]
        return {**self.score_kw, "sample_ids": ids if None not in ids else None}

    def _global_sum(self, n: int) -> int:
        if self.group is None:
            return n
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, group=self.group)
        return int(t.item())

    def train_step(self, samples: list[Sample], alg) -> tuple[list[torch.Tensor], dict[str, float]]:
        """PPO epochs over mini-batches of this rank's samples. Returns the trainer's pre-update
        logprobs of each sample (what the monitor compares with the generator's) and stats."""
        updates = alg.ppo_epochs * alg.num_minibatches
        pre = self.score(samples) if updates > 1 or self.cfg.trainer.separate_scoring_pass else None
        ref = self.score(samples, self.ref_model) if self.ref_model is not None else None
        captured: list[torch.Tensor | None] = list(pre) if pre is not None else [None] * len(samples)
        stats: dict[str, float] = {}
        for _ in range(alg.ppo_epochs):
            for k in range(alg.num_minibatches):
                part = list(shard_range(len(samples), alg.num_minibatches, k))
                sub = [samples[i] for i in part]

                def loss_fn(lps, idx, part=part, sub=sub):
                    for lp, j in zip(lps, idx):
                        if captured[part[j]] is None:  # single update: this forward is pre-update
                            captured[part[j]] = lp.detach().float().cpu()
                    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)  # noqa: E731
                    return policy_loss(
                        torch.cat(lps),
                        cat([sub[j].generator_logprobs for j in idx]),
                        cat([captured[part[j]] for j in idx]),
                        cat([torch.full((len(sub[j].response),), sub[j].advantage) for j in idx]),
                        alg,
                        cat([ref[part[j]] for j in idx]) if ref is not None else None,
                    )

                tokens = self._global_sum(sum(len(s.response) for s in sub))
                for key, v in self.forward_backward(sub, loss_fn, tokens).items():
                    stats[key] = merge_stat(key, stats.get(key), v)
                upd = self.optimizer_step()
                stats["grad_norm_max"] = merge_stat("grad_norm_max", stats.get("grad_norm_max"), upd["grad_norm"])
                stats["grad_norm_last"] = upd["grad_norm"]
        return [c if c is not None else torch.zeros(0) for c in captured], stats

    def forward_backward(self, samples: Sequence[Sample], loss_fn: LossFn, global_tokens: int) -> dict[str, float]:
        """Accumulate d(sum of token losses / global_tokens) into fp32 gradients (self.grads).
        Stats: keys ending in _max/_min are reduced by max/min, all others summed."""
        self.grads = {n: torch.zeros_like(m) for n, m in self.master.items()}
        stats: dict[str, float] = {}
        mbs = micro_batches(len(samples), self.cfg.trainer.micro_batch_size)
        for i in range(_max_over_ranks(len(mbs), self.group, self.device)):
            idx = list(mbs[i]) if i < len(mbs) else []
            mb = [samples[j] for j in idx]
            if mb:
                lps = score_micro_batch(self.model, [s.prompt for s in mb], [s.response for s in mb], **self._kw(mb))
                loss, st = loss_fn(lps, idx)
                for k, v in st.items():
                    stats[k] = merge_stat(k, stats.get(k), float(v))
            else:  # still runs forward and backward through the MoE collectives
                loss = self.model(torch.zeros(0, dtype=torch.long, device=self.device), [0]).float().sum() * 0.0
            (loss / max(1, global_tokens)).backward()
            for n, p in self.model.named_parameters():
                if p.grad is not None:
                    self.grads[n] += p.grad.float()
                    p.grad = None
        return stats

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

    # --- checkpoint state (torch.distributed.checkpoint) -----------------------------------------
    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Flat {key: tensor} of model, fp32 masters and AdamW state. Expert tensors are split per
        global expert id ('.../expert{e}'), so the keys don't depend on the EP size; the values
        are views, so loading in place restores the trainer."""
        flat: dict[str, torch.Tensor] = {}

        def put(key: str, name: str, t: torch.Tensor) -> None:
            if is_expert_param(name):
                off = self.rank * t.shape[0]
                for i in range(t.shape[0]):
                    flat[f"{key}/expert{off + i}"] = t[i]
            else:
                flat[key] = t

        params = dict(self.model.named_parameters())
        for n in self.names:
            put(f"model/{n}", n, params[n].data)
            put(f"master/{n}", n, self.master[n].data)
            st = self.opt.state.get(self.master[n])
            if not st:  # before the first step: create AdamW's state so it can be loaded into
                st = self.opt.state[self.master[n]]
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(self.master[n])
                st["exp_avg_sq"] = torch.zeros_like(self.master[n])
            put(f"optim/{n}/exp_avg", n, st["exp_avg"])
            put(f"optim/{n}/exp_avg_sq", n, st["exp_avg_sq"])
            flat[f"optim/{n}/step"] = st["step"]
        return flat

    # --- weights -------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model, self.group)
