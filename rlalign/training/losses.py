"""GRPO advantages and the PPO-clip policy loss with off-policy corrections.

Per token t of a sample with advantage A:
    ratio_t  = exp(logp_t - old_t)
    pg_t     = max(-A * ratio_t, -A * clip(ratio_t, 1 - clip_low, 1 + clip_high))
old_t is the generator's logprob (algorithm.old_logprobs=generator, the default) or the
trainer's own pre-update logprob (=trainer). In deterministic mode the two are the same bits,
so ratio_t == 1 exactly in the first epoch.

Corrections for setups that are not bitwise (kernels.mode=default, another engine), on the
per-token mismatch weight w_t = exp(trainer_old_t - generator_t) (no gradient):
    TIS     pg_t *= min(w_t, tis.cap)                          (truncated importance sampling)
    IcePop  pg_t *= [icepop.low <= w_t <= icepop.high]         (mask tokens that drifted too far)
Optional reference KL (kl_coef > 0): k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1.
The loss returned is the SUM over tokens; the caller divides by the global token count.

Diagnostics (sums over tokens, no gradient), with old_t as above and logp_t the policy at this
forward (in the first epoch's first minibatch the pre-update policy; later, after the updates so far):
    kl_k1_t = old_t - logp_t                 (unbiased estimate of KL(old || current), samples from old)
    kl_k3_t = ratio_t - 1 - log ratio_t      (>= 0, lower variance; Schulman's k3)
    clip_high: A > 0 and ratio_t > 1 + clip_high (the clip removes the gradient),
    clip_low:  A < 0 and ratio_t < 1 - clip_low.
"""

from __future__ import annotations

import math

import torch


def grpo_advantages(rewards: list[float], group_size: int, norm_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """(r - mean of its group) / (std of its group + eps), groups of `group_size` consecutive samples.
    Computed in Python floats in a fixed order: identical on every run."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out = []
    for g in range(0, len(rewards), group_size):
        rs = rewards[g : g + group_size]
        mean = math.fsum(rs) / len(rs)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rs) / len(rs))
        out += [(r - mean) / (std + eps) if norm_by_std else r - mean for r in rs]
    return out


def policy_loss(
    logprobs: torch.Tensor,
    generator_logprobs: torch.Tensor,
    trainer_old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    alg,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All inputs per token [T] (advantages broadcast per token). Returns (sum of token losses,
    stats: sums '..._sum', extremes '..._max'/'..._min')."""
    gen = generator_logprobs.to(logprobs.device).float()
    t_old = trainer_old_logprobs.to(logprobs.device).float()
    old = gen if alg.old_logprobs == "generator" else t_old
    adv = advantages.to(logprobs.device).float()
    ratio = torch.exp(logprobs - old)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - alg.clip_low, 1.0 + alg.clip_high)
    pg = torch.maximum(pg1, pg2)
    w = torch.exp(t_old - gen)  # mismatch weight, no gradient (both inputs detached)
    log_ratio = (logprobs - old).detach()
    stats = {
        "clipped_sum": (pg2 > pg1).float().sum(),
        "clip_high_sum": ((adv > 0) & (ratio > 1.0 + alg.clip_high)).float().sum(),
        "clip_low_sum": ((adv < 0) & (ratio < 1.0 - alg.clip_low)).float().sum(),
        "kl_k1_sum": (-log_ratio).sum(),
        "kl_k3_sum": (torch.expm1(log_ratio) - log_ratio).sum(),
        "ratio_sum": ratio.detach().sum(),
        "ratio_max": ratio.detach().max() if ratio.numel() else torch.tensor(-math.inf),
        "ratio_min": ratio.detach().min() if ratio.numel() else torch.tensor(math.inf),
    }
    if alg.tis.enabled:
        pg = pg * w.clamp(max=alg.tis.cap)
        stats["tis_weight_sum"] = w.sum()
        stats["tis_weight_max"] = w.max() if w.numel() else torch.tensor(-math.inf)
        stats["tis_weight_min"] = w.min() if w.numel() else torch.tensor(math.inf)
        stats["tis_clipped_sum"] = (w > alg.tis.cap).float().sum()
    if alg.icepop.enabled:
        keep = (w >= alg.icepop.low) & (w <= alg.icepop.high)
        pg = pg * keep.float()
        stats["icepop_masked_sum"] = (~keep).float().sum()
    loss = pg.sum()
    stats["pg_loss_sum"] = pg.detach().sum()
    if ref_logprobs is not None and alg.kl_coef > 0:
        d = ref_logprobs.to(logprobs.device).float() - logprobs
        k3 = torch.exp(d) - d - 1.0
        loss = loss + alg.kl_coef * k3.sum()
        stats["ref_kl_sum"] = k3.detach().sum()
    return loss, stats
