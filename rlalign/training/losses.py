"""GRPO advantages and the policy losses: chosen by name (`algorithm.name`) or a user's function
(`algorithm.loss='pkg.module:function'` or '/path/to/file.py:function').

A loss is `fn(batch: LossBatch, alg) -> (loss, metrics)` for one micro-batch:
  loss     the SUM of the micro-batch's token losses (0-d, with grad); the trainer divides the
           minibatch's total by its response tokens (a token mean), so a loss normalised otherwise
           rescales its sum (dr_grpo, gspo)
  metrics  {name: 0-d tensor or float}, merged over micro-batches and trainer ranks in one fixed
           order (merge_stat, by the name's suffix) and logged (logged_stats):
             X_sum        summed; logged as X, the mean per updated token
             X_max, X_min the extreme; logged as X_max, X_min
             X_last       the last minibatch's; logged as X
             other        summed; logged as the step's total
           a name without a '/' is logged under actor/ (e.g. pg_loss_sum -> actor/pg_loss)

Built in, per token t of a sample with advantage A (the group-relative one of grpo_advantages):
  ppo-clip  pg_t = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high)), r_t = exp(logp_t - old_t)
  grpo      ppo-clip + the reference KL in the loss (kl_coef > 0): k3_t = exp(ref_t - logp_t) -
            (ref_t - logp_t) - 1 (the default; with kl_coef = 0 the same bits as ppo-clip)
  dr_grpo   grpo's terms over a constant normaliser: the sum / (sequences x max_new_tokens) instead of /
            tokens (Dr. GRPO; configs/algorithm/dr_grpo.yaml also drops the std normalisation)
  gspo      one ratio per sequence, s_i = exp(mean over its tokens of (logp_t - old_t)), clipped per
            sequence; the mean over sequences (GSPO; configs/algorithm/gspo.yaml: its clip range)
Episodes (multi-turn samples, rlalign.sequences.Sample.turns): a loss sees the policy tokens only. The
trainer selects them before the loss (policy_batch), so every per-token tensor of LossBatch, `lengths`
and `minibatch_tokens` count the tokens the policy sampled, and `turns` gives each one's assistant turn;
an observation token (the environment's text, no generator logprob, maybe -inf under top-k / top-p) is
in no loss, metric or gradient. Sequence means (gspo) are over a sequence's policy tokens.

old_t is the generator's logprob (algorithm.old_logprobs=generator, the default) or the trainer's
own pre-update logprob (=trainer). In deterministic mode the two are the same bits, so r_t == 1
exactly in the first epoch.

Corrections for setups that are not bitwise (kernels.mode=default, another engine), on the
mismatch weight w = exp(trainer_old - generator) (no gradient; gspo: one per sequence, from the mean):
    TIS     pg *= min(w, tis.cap)                        (truncated importance sampling)
    IcePop  pg *= [icepop.low <= w <= icepop.high]       (mask tokens that drifted too far)

Diagnostics of every built-in loss (drift_metrics; no gradient), per token, with old_t as above and
logp_t the policy at this forward (the first minibatch of the first epoch: the pre-update policy;
later ones: after the updates so far), so a single on-policy update logs 0:
    kl/old_new_k1   old_t - logp_t               (unbiased estimate of KL(old || current), samples from old)
    kl/old_new_k3   r_t - 1 - log r_t            (>= 0, lower variance; Schulman's k3)
    clip_high_frac  A > 0 and r > 1 + clip_high  (the clip removes the gradient; gspo: per sequence,
    clip_low_frac   A < 0 and r < 1 - clip_low    counted per token)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rlalign.config import did_you_mean
from rlalign.sequences import policy_mask
from rlalign.tasks.reward_fn import defined_at, import_user_module


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


@dataclass
class LossBatch:
    """One micro-batch's inputs to a loss, per response token [T] (fp32, on the trainer's device)."""

    logprobs: torch.Tensor  # the trainer's, with grad
    generator_logprobs: torch.Tensor
    trainer_old_logprobs: torch.Tensor  # the trainer's pre-update logprobs (no grad)
    advantages: torch.Tensor  # each token its sample's
    lengths: list[int]  # the samples' response lengths, in order (sum = T)
    ref_logprobs: torch.Tensor | None = None  # the reference model's (algorithm.kl_coef > 0)
    minibatch_tokens: int = 0  # response tokens of the whole minibatch (what the trainer divides by)
    minibatch_sequences: int = 0
    max_new_tokens: int = 0  # the sampling limit
    # an episode's micro-batch (rlalign.sequences.Sample.turns): the assistant turn of each token; None: one turn
    turns: torch.Tensor | None = None

    def old_logprobs(self, alg) -> torch.Tensor:
        """The ratio's denominator (algorithm.old_logprobs)."""
        return self.generator_logprobs if alg.old_logprobs == "generator" else self.trainer_old_logprobs


def policy_selection(turns: list[list[int] | None], lengths: list[int],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Which of a micro-batch's tokens (samples' `turns` as Sample.turns, `lengths` their responses')
    the policy sampled: (their positions [P] and assistant turns [P], long, on `device`, one asynchronous
    copy; the policy tokens per sample). A sample without turns is all policy tokens (turn 0)."""
    keep = [policy_mask(ts, n) for ts, n in zip(turns, lengths)]
    mask = torch.cat(keep) if keep else torch.zeros(0, dtype=torch.bool)
    every = [t for ts, n in zip(turns, lengths) for t in ([0] * n if ts is None else ts)]
    index = torch.nonzero(mask).flatten().tolist()
    turn = torch.tensor(every, dtype=torch.long)[mask].tolist()
    counts = [int(k.sum()) for k in keep]
    host = torch.tensor(index + turn, dtype=torch.long)
    host = host.pin_memory() if device.type == "cuda" else host
    index_t, turn_t = host.to(device, non_blocking=True).split([len(index), len(turn)])
    return index_t, turn_t, counts


def policy_batch(batch: LossBatch, index: torch.Tensor, turns: torch.Tensor, lengths: list[int]) -> LossBatch:
    """`batch` with only its tokens at `index` (policy_selection: an episode's policy tokens, `turns` theirs,
    `lengths` per sample), by selection, never by a 0 weight (a -inf logprob times 0 is NaN; no host sync):
    the gradient of a token left out is exactly 0."""
    sel = lambda x: x.index_select(0, index) if x is not None else None  # noqa: E731
    return replace(batch, logprobs=sel(batch.logprobs), generator_logprobs=sel(batch.generator_logprobs),
                   trainer_old_logprobs=sel(batch.trainer_old_logprobs), advantages=sel(batch.advantages),
                   lengths=lengths, ref_logprobs=sel(batch.ref_logprobs), turns=turns)


Metrics = dict[str, torch.Tensor | float]
LossFunction = Callable[[LossBatch, object], tuple[torch.Tensor, Metrics]]
# what the trainer runs per micro-batch (Trainer.ppo_loss builds it from a LossFunction):
# loss_fn(logprobs per sample, indices of those samples) -> (sum of token losses, metrics)
LossFn = Callable[[list[torch.Tensor], list[int]], tuple[torch.Tensor, Metrics]]


def _extremes(name: str, x: torch.Tensor) -> Metrics:
    return {f"{name}_max": x.max() if x.numel() else torch.tensor(-math.inf),
            f"{name}_min": x.min() if x.numel() else torch.tensor(math.inf)}


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, alg) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped objective, as a loss: (max(-A r, -A clip(r)), where the clip won)."""
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - alg.clip_low, 1.0 + alg.clip_high)
    return torch.maximum(pg1, pg2), pg2 > pg1


def corrected(pg: torch.Tensor, w: torch.Tensor, alg, metrics: Metrics, weight: torch.Tensor | None = None):
    """pg with TIS and IcePop applied on the mismatch weight w (same shape); their metrics counted
    per token (`weight`: the tokens each entry stands for, None: one each)."""
    count = (lambda x: x.sum()) if weight is None else (lambda x: (x * weight).sum())
    if alg.tis.enabled:
        pg = pg * w.clamp(max=alg.tis.cap)
        metrics["tis/weight_mean_sum"] = count(w)
        metrics.update(_extremes("tis/weight", w))
        metrics["tis/clipped_frac_sum"] = count((w > alg.tis.cap).float())
    if alg.icepop.enabled:
        keep = (w >= alg.icepop.low) & (w <= alg.icepop.high)
        pg = pg * keep.float()
        metrics["icepop/masked_frac_sum"] = count((~keep).float())
    return pg


def drift_metrics(batch: LossBatch, alg, ratio: torch.Tensor, adv: torch.Tensor,
                  weight: torch.Tensor | None = None) -> Metrics:
    """KL(old || current) per token (k1, k3) and the clip by side of `ratio` against `adv` (same
    shape; `weight`: the tokens each entry stands for, None: one each). Module docstring."""
    count = (lambda x: x.float().sum()) if weight is None else (lambda x: (x.float() * weight).sum())
    log_ratio = (batch.logprobs - batch.old_logprobs(alg)).detach()
    r = ratio.detach()
    return {"kl/old_new_k1_sum": (-log_ratio).sum(), "kl/old_new_k3_sum": (torch.expm1(log_ratio) - log_ratio).sum(),
            "clip_high_frac_sum": count((adv > 0) & (r > 1.0 + alg.clip_high)),
            "clip_low_frac_sum": count((adv < 0) & (r < 1.0 - alg.clip_low))}


def ppo_clip_loss(batch: LossBatch, alg) -> tuple[torch.Tensor, Metrics]:
    logp = batch.logprobs
    ratio = torch.exp(logp - batch.old_logprobs(alg))
    pg, clipped = clipped_surrogate(ratio, batch.advantages, alg)
    w = torch.exp(batch.trainer_old_logprobs - batch.generator_logprobs)  # no gradient (both detached)
    metrics: Metrics = {"clip_frac_sum": clipped.float().sum(), "ratio_mean_sum": ratio.detach().sum(),
                        **_extremes("ratio", ratio.detach()), **drift_metrics(batch, alg, ratio, batch.advantages)}
    pg = corrected(pg, w, alg, metrics)
    metrics["pg_loss_sum"] = pg.detach().sum()
    return pg.sum(), metrics


def grpo_loss(batch: LossBatch, alg) -> tuple[torch.Tensor, Metrics]:
    loss, metrics = ppo_clip_loss(batch, alg)
    if batch.ref_logprobs is not None and alg.kl_coef > 0:
        d = batch.ref_logprobs - batch.logprobs
        k3 = torch.exp(d) - d - 1.0
        loss = loss + alg.kl_coef * k3.sum()
        metrics["kl/ref_k3_sum"] = k3.detach().sum()
    return loss, metrics


def dr_grpo_loss(batch: LossBatch, alg) -> tuple[torch.Tensor, Metrics]:
    """grpo's sum over the constant sequences x max_new_tokens: the trainer divides by the minibatch's
    tokens, so the sum is scaled by tokens / (sequences x max_new_tokens); actor/pg_loss is that objective."""
    if batch.max_new_tokens < 1 or batch.minibatch_sequences < 1:
        raise ValueError(f"dr_grpo: needs max_new_tokens and minibatch_sequences >= 1 (got {batch.max_new_tokens}, "
                         f"{batch.minibatch_sequences})")
    loss, metrics = grpo_loss(batch, alg)
    scale = batch.minibatch_tokens / (batch.minibatch_sequences * batch.max_new_tokens)
    metrics["pg_loss_sum"] = metrics["pg_loss_sum"] * scale
    return loss * scale, metrics


def sequence_means(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[S] the mean of each sequence's tokens (x [T], split by lengths; no atomics)."""
    return torch.stack([part.mean() for part in x.split(lengths)]) if lengths else x.new_zeros(0)


def gspo_loss(batch: LossBatch, alg) -> tuple[torch.Tensor, Metrics]:
    """The clipped objective on sequence ratios s_i = exp(mean_t(logp_t - old_t)), averaged over the
    minibatch's sequences (the sum scaled by tokens / sequences); metrics weight each sequence by
    its tokens."""
    lengths = torch.tensor(batch.lengths, dtype=torch.float32, device=batch.logprobs.device)
    ratio = torch.exp(sequence_means(batch.logprobs - batch.old_logprobs(alg), batch.lengths))  # [S]
    adv = torch.stack([a[0] for a in batch.advantages.split(batch.lengths)]) if batch.lengths else ratio.detach()
    pg, clipped = clipped_surrogate(ratio, adv, alg)
    w = torch.exp(sequence_means(batch.trainer_old_logprobs - batch.generator_logprobs, batch.lengths))
    metrics: Metrics = {"clip_frac_sum": (clipped.float() * lengths).sum(),
                        "ratio_mean_sum": (ratio.detach() * lengths).sum(), **_extremes("ratio", ratio.detach()),
                        **drift_metrics(batch, alg, ratio, adv, lengths)}
    pg = corrected(pg, w, alg, metrics, lengths)
    scale = batch.minibatch_tokens / max(1, batch.minibatch_sequences)
    metrics["pg_loss_sum"] = pg.detach().sum() * scale
    return pg.sum() * scale, metrics


LOSSES: dict[str, LossFunction] = {"grpo": grpo_loss, "ppo-clip": ppo_clip_loss, "dr_grpo": dr_grpo_loss,
                                   "gspo": gspo_loss}


def resolve_loss(alg) -> LossFunction:
    """The step's loss: algorithm.loss's function when set, else the built-in algorithm.name names."""
    path = alg.get("loss")
    if path:
        return checked_loss(load_loss(path), path)
    if alg.name not in LOSSES:
        raise ValueError(f"algorithm.name={alg.name!r}: no such loss{did_you_mean(alg.name, LOSSES)}; built in: "
                         f"{', '.join(LOSSES)} (or algorithm.loss='pkg.module:function' for your own)")
    return LOSSES[alg.name]


def load_loss(path: str) -> LossFunction:
    """'pkg.module:function' or '/path/to/file.py:function' -> the function."""
    mod_name, sep, fn_name = path.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise ValueError(f"algorithm.loss={path!r}: expected 'pkg.module:function' or '/path/to/file.py:function'")
    mod = import_user_module(f"algorithm.loss={path!r}", mod_name)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"algorithm.loss={path!r}: {mod_name!r} has no function {fn_name!r}")
    return fn


def checked_loss(fn: LossFunction, path: str) -> LossFunction:
    """A user's loss whose output is checked on every call: a wrong one is a ValueError naming
    algorithm.loss, its file and line, and what came back (not a TypeError deep in the trainer)."""
    at = defined_at(fn)
    where = f"algorithm.loss={path!r}" + (f" ({at})" if at else "")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its calls tell
        sig = None
    if sig is not None:
        try:
            sig.bind(None, None)
        except TypeError:
            raise ValueError(f"{where}: a loss takes (batch, alg); this one takes {sig}") from None

    def call(batch: LossBatch, alg) -> tuple[torch.Tensor, Metrics]:
        out = fn(batch, alg)
        problem = loss_output_problem(out)
        if problem:
            raise ValueError(f"{where} {problem}; a loss returns (loss, metrics): loss the micro-batch's sum of token "
                             f"losses as a 0-d tensor with grad, metrics a dict {{name: number or 0-d tensor}}")
        return out

    return call


def loss_output_problem(out) -> str | None:
    """What is wrong with a loss function's return value, or None."""
    if not (isinstance(out, tuple | list) and len(out) == 2):
        return f"returned {_shown(out)}"
    loss, metrics = out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return f"returned a loss of {_shown(loss)}"
    if not loss.requires_grad:
        return "returned a loss without grad (computed from batch.logprobs detached?)"
    if not isinstance(metrics, dict):
        return f"returned metrics of {_shown(metrics)}"
    for key, v in metrics.items():
        number = isinstance(v, int | float) or (isinstance(v, torch.Tensor) and v.numel() == 1)
        if not isinstance(key, str) or not number:
            return f"returned the metric {key!r}: {_shown(v)}"
    return None


def _shown(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    text = repr(x)
    return f"{text[:60] + '...' if len(text) > 60 else text} ({type(x).__name__})"


# --- metrics --------------------------------------------------------------------------------------------
def merge_stat(key: str, a: float | None, b: float) -> float:
    """Two values of one metric merged by its name's suffix (module docstring); the driver merges in
    (epoch, minibatch, micro-batch) order, so the result does not depend on the number of ranks."""
    if a is None or key.endswith("_last"):
        return b
    return max(a, b) if key.endswith("_max") else min(a, b) if key.endswith("_min") else a + b


def logged_stats(stats: dict[str, float], updated_tokens: int) -> dict[str, float]:
    """The merged metrics as the step logs them (module docstring): X_sum per updated token as X,
    X_last as X, the rest as merged; under actor/ when the name has no section."""
    out = {}
    for key, v in stats.items():
        name = key if "/" in key else f"actor/{key}"
        if key.endswith("_sum"):
            out[name[: -len("_sum")]] = v / max(1, updated_tokens)
        elif key.endswith("_last"):
            out[name[: -len("_last")]] = v
        else:
            out[name] = v
    return out
