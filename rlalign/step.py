"""One RL step on the driver: the batch, the generator's rollouts, rewards, GRPO advantages, the
trainer's update, the token-by-token comparison of both sides and the weight sync — composed from
the values each phase returns (rlalign.job) into the step's metrics.

    batch = make_batch(cfg, task, tok, step)
    result = run_step(job, cfg, task, tok, rewards, step, weights_fp)   # StepResult
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlalign.agent.metrics import episode_metrics, episode_reward
from rlalign.config import model_args
from rlalign.job import Job
from rlalign.logger import json_line
from rlalign.model import save_hf
from rlalign.model.build import model_from_config
from rlalign.monitor.consistency import logprob_consistency
from rlalign.monitor.divergence import locate_mismatches, tap_order
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout, Sample, policy_mask, render_episode
from rlalign.tasks import Example
from rlalign.tasks.reward_calls import RewardCall, RewardCaller
from rlalign.training.losses import grpo_advantages, logged_stats


class MismatchError(RuntimeError):
    pass


def step_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


@dataclass
class StepBatch:
    """One step's work: the examples (each prompt repeated samples_per_prompt times), their
    token ids, their sample ids (a pure function of the step) and the sampling parameters."""

    examples: list[Example]
    prompts: list[list[int]]
    sample_ids: list[int]
    params: SamplingParams


def make_batch(cfg: DictConfig, task, tok, step: int) -> StepBatch:
    P, G = cfg.task.num_prompts, cfg.task.samples_per_prompt
    examples = [ex for ex in task.examples(step, P) for _ in range(G)]
    prompts = [tok.encode(ex.prompt, where=f"step {step} prompt") for ex in examples]
    params = SamplingParams.from_config(cfg, tok.eos_token_id, step_seed(cfg.seed, step), cfg.task.max_new_tokens)
    return StepBatch(examples, prompts, [step * P * G + i for i in range(P * G)], params)


def score_rewards(rewards: RewardCaller, tok, batch: StepBatch, rollouts: list[Rollout],
                  step: int) -> tuple[list[float], list[str], int]:
    """The rewards in sample order, the completions, and how many calls timed out (fallback used). An
    episode's completion is its last assistant turn (the samples table renders the whole episode); its
    reward adds its environment's (rlalign.agent.metrics.episode_reward)."""
    calls, texts = [], []
    for ex, r in zip(batch.examples, rollouts):
        if r.episode is not None:
            completion, what = r.episode["last_turn"], "last turn"
        else:
            completion, what = tok.decode(r.tokens[:-1] if r.finish_reason == "eos" else r.tokens), "completion"
        texts.append(completion)
        calls.append(RewardCall(completion, ex, f"sample {r.sample_id} (step {step}, prompt {ex.prompt!r}, "
                                                f"{what} {completion!r})"))
    values, timed_out = rewards.score(calls, f"step {step}")
    values = [v if r.episode is None else episode_reward(r.episode, v) for r, v in zip(rollouts, values)]
    return values, texts, timed_out


def _mean_std(xs: list[float]) -> tuple[float, float]:
    """Population mean and std in Python floats, a fixed order."""
    mean = math.fsum(xs) / max(1, len(xs))
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / max(1, len(xs)))


def signal_metrics(rewards: list[float], advantages: list[float], group_size: int) -> dict[str, float]:
    """Reward and advantage spread, and reward/zero_std_group_frac: the fraction of GRPO groups
    (group_size consecutive samples of one prompt) whose rewards are all equal, so every advantage
    of the group is 0 and the group teaches nothing (GRPO's dead-signal rate)."""
    groups = [rewards[g : g + group_size] for g in range(0, len(rewards), group_size)]
    dead = sum(all(r == rs[0] for r in rs) for rs in groups)
    r_mean, r_std = _mean_std(rewards)
    a_mean, a_std = _mean_std(advantages)
    return {"reward/std": r_std, "reward/zero_std_group_frac": dead / max(1, len(groups)),
            "advantage/mean": a_mean, "advantage/std": a_std,
            "advantage/max": max(advantages, default=0.0), "advantage/min": min(advantages, default=0.0)}


def warn_dead_signal(rewards: list[float], step: int, group_size: int) -> None:
    """One stderr line when every GRPO group's rewards are equal (all the step's, or each prompt's
    samples alike): every advantage is 0, no gradient."""
    groups = [rewards[g : g + group_size] for g in range(0, len(rewards), group_size)]
    if not rewards or not all(r == rs[0] for rs in groups for r in rs):
        return
    if all(r == rewards[0] for r in rewards):
        what = f"all {len(rewards)} rewards are {rewards[0]:g}"
    else:
        what = (f"the samples of each of the {len(groups)} prompts got equal rewards ({min(rewards):g} to "
                f"{max(rewards):g} across prompts)")
    print(f"rlalign: warning: step {step}: {what}; every advantage is 0 and the policy gets no signal (task too hard "
          f"or too easy, or a broken reward?)", file=sys.stderr, flush=True)


def step_metrics(cfg: DictConfig, rewards: list[float], rollouts: list[Rollout], cons: dict,
                 stats: dict[str, float]) -> dict:
    N = len(rollouts)
    lengths = [len(r.tokens) for r in rollouts]
    ends = [e for r in rollouts for e in (r.episode["turn_ends"] if r.episode else [r.finish_reason])]
    sampled = torch.cat([_sampled_logprobs(r).double() for r in rollouts]) if rollouts else torch.zeros(
        0, dtype=torch.float64)
    metrics = {
        "reward/mean": sum(rewards) / N,
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "prompt/tokens": sum(len(r.prompt) for r in rollouts),
        "prompt/length_mean": sum(len(r.prompt) for r in rollouts) / N,
        "response/tokens": sum(lengths),
        "response/length_mean": sum(lengths) / N,
        "response/length_min": min(lengths),
        "response/length_max": max(lengths),
        # of the responses, or of an episode's assistant turns (an episode ends for its own reasons)
        "response/clip_frac": ends.count("length") / max(1, len(ends)),  # stopped by max_new_tokens
        "response/eos_frac": ends.count("eos") / max(1, len(ends)),
        # mean -log p of the sampled tokens under the generator: the Monte-Carlo estimate of the
        # per-token entropy of the sampling distribution
        "response/entropy": float(-sampled.mean()) if sampled.numel() else 0.0,
        **{f"consistency/{k}": v for k, v in cons.items()},
        # whatever the loss returned, and actor/entropy: the exact per-token entropy of softmax(logits / T)
        # over the whole vocabulary, from the trainer's logits at each PPO forward (Trainer.forward_backward)
        **logged_stats(stats, cons["tokens"] * cfg.algorithm.ppo_epochs),
        "actor/lr": cfg.trainer.lr,
        **episode_tokens(rollouts),
    }
    return metrics


def _sampled_logprobs(r: Rollout) -> torch.Tensor:
    """The generator's logprobs of the tokens the policy sampled (an episode's observation tokens have none)."""
    return r.logprobs if r.turns is None else r.logprobs[policy_mask(r.turns, len(r.tokens))]


def episode_tokens(rollouts: list[Rollout]) -> dict[str, int]:
    """episode/policy_tokens and episode/observation_tokens when any rollout is an episode (else nothing)."""
    if all(r.turns is None for r in rollouts):
        return {}
    policy = sum(int(policy_mask(r.turns, len(r.tokens)).sum()) for r in rollouts)
    total = sum(len(r.tokens) for r in rollouts)
    return {"episode/policy_tokens": policy, "episode/observation_tokens": total - policy}


@dataclass
class StepResult:
    metrics: dict  # the step's line of metrics.jsonl (without the loop's own times)
    samples: list[dict]  # one row per sample: prompt, completion, answer, reward
    detail: dict | None  # when tokens differ: worst tokens and where each mismatch began
    weights_fp: str  # the generator's weights after the step's sync


def run_step(job: Job, cfg: DictConfig, task, tok, reward_caller: RewardCaller, step: int,
             weights_fp: str) -> StepResult:
    """generate -> rewards -> GRPO advantages -> train -> compare the two sides -> weight sync.
    `weights_fp`: what the generator holds going in (a mismatch dump names it)."""
    t0 = time.perf_counter()
    batch = make_batch(cfg, task, tok, step)
    gen = job.generate(batch.prompts, batch.sample_ids, batch.params, step, batch.examples if cfg.task.env else None)
    rollouts = gen.rollouts
    t1 = time.perf_counter()
    rewards, texts, timed_out = score_rewards(reward_caller, tok, batch, rollouts, step)
    adv = grpo_advantages(rewards, cfg.task.samples_per_prompt, cfg.algorithm.norm_adv_by_std)
    warn_dead_signal(rewards, step, cfg.task.samples_per_prompt)
    t2 = time.perf_counter()
    samples = [Sample(p, r.tokens, r.logprobs, a, r.sample_id, params=r.params, turns=r.turns)
               for p, r, a in zip(batch.prompts, rollouts, adv)]
    trained = job.train(samples, step, gen.need_bytes)
    t3 = time.perf_counter()
    cons = logprob_consistency([r.logprobs for r in rollouts], trained.logprobs, [r.turns for r in rollouts])
    detail = None
    if cons["mismatched_tokens"]:
        detail = mismatch_detail(cfg, batch.prompts, rollouts, trained.logprobs, gen.rows, trained.rows, tok)
        with (Path(cfg.run.dir) / "divergence.jsonl").open("a") as f:  # also of a step that raises below
            f.write(json_line({"step": step, **detail}) + "\n")
        if cfg.kernels.mode == "deterministic" and cfg.monitor.on_mismatch == "raise":
            dump = dump_mismatch(job, cfg, step, cons, detail, batch, rollouts, weights_fp)
            raise MismatchError(f"step {step}: {cons['mismatched_tokens']} of {cons['tokens']} tokens differ between "
                                f"generator and trainer in deterministic mode (max |d| "
                                f"{cons['logprob_abs_diff_max']:.3g}, first divergence: "
                                f"{detail['first_divergent_op'] or 'unknown (monitor.fingerprints=layers names it)'}); "
                                f"batch, weights and config dumped to {dump} (replay: rlalign agree "
                                f"agree.replay={dump})")
    t4 = time.perf_counter()
    synced = job.sync_weights(step, trained.direct_sync)
    t5 = time.perf_counter()

    metrics = step_metrics(cfg, rewards, rollouts, cons, trained.stats)
    metrics.update(signal_metrics(rewards, adv, cfg.task.samples_per_prompt))
    metrics["reward/timeouts"] = timed_out
    if cfg.task.env:
        metrics.update(episode_metrics(rollouts))
    metrics.update({"sync/weights_fp": synced.weights_fp, **synced.metrics, "time/generate_s": t1 - t0,
                    "time/reward_s": t2 - t1, "time/train_s": t3 - t2, "time/compare_s": t4 - t3,
                    "time/sync_s": t5 - t4, **gen.metrics, **trained.metrics})
    seq_tokens = metrics["prompt/tokens"] + metrics["response/tokens"]
    metrics.update({"time/generate_tok_per_s": metrics["response/tokens"] / max(t1 - t0, 1e-9),
                    "time/reward_tok_per_s": metrics["response/tokens"] / max(t2 - t1, 1e-9),
                    "time/train_tok_per_s": seq_tokens * cfg.algorithm.ppo_epochs / max(t3 - t2, 1e-9),
                    "time/compare_tok_per_s": cons["tokens"] / max(t4 - t3, 1e-9),
                    "time/sync_mb_per_s": metrics.get("sync/bytes", 0) / 1e6 / max(t5 - t4, 1e-9)})
    rows = sample_rows(tok, batch.examples, rollouts, texts, rewards)
    if detail is not None:
        if detail["first_divergent_op"]:
            metrics["consistency/first_divergent_op"] = detail["first_divergent_op"]
        if cfg.kernels.mode == "deterministic":
            metrics["consistency/alert"] = (f"step {step}: {cons['mismatched_tokens']} of {cons['tokens']} tokens "
                                            f"differ (first divergence: {detail['first_divergent_op']})")
    return StepResult(metrics, rows, detail, synced.weights_fp)


def sample_rows(tok, examples: list[Example], rollouts: list[Rollout], texts: list[str],
                rewards: list[float]) -> list[dict]:
    """The samples table's rows (W&B): an episode's completion is the whole episode, its turns and
    observations on lines of their own (rlalign.sequences.render_episode)."""
    return [{"sample_id": r.sample_id, "prompt": ex.prompt,
             "completion": text if r.turns is None else render_episode(tok, r.tokens, r.turns),
             "answer": ex.answer_text(), "reward": rew} for r, ex, text, rew in zip(rollouts, examples, texts, rewards)]


def mismatch_detail(cfg, prompts, rollouts: list[Rollout], train_lps, gen_table, train_table, tok=None) -> dict:
    """Worst tokens by |d| (with their text when a tokenizer `tok` is given; an episode's: with their
    turn) and, with per-layer fingerprints, the op where each mismatch began. An episode's observation
    tokens (no generator logprob) are skipped; positions count the whole history, observations included.
    The worst tokens: the largest |generator - trainer| (in float64), ties in sample then position order;
    each sequence's candidates picked on the tensors, so that a step where every token differs (default
    kernels) builds monitor.worst_tokens rows, not one per token."""
    bad, worst, n = [], [], cfg.monitor.worst_tokens
    located = bool(gen_table and train_table)  # per-layer row fingerprints: each mismatched token's first op
    for p, r, t in zip(prompts, rollouts, train_lps):
        g = r.logprobs
        idx = torch.nonzero((g.view(torch.int32) != t.view(torch.int32)) & policy_mask(r.turns, len(r.tokens)))[:, 0]
        if not idx.numel():
            continue
        if located:
            bad += [(r.sample_id, len(p) + j - 1) for j in idx.tolist()]  # the logits row that predicted token j
        diff = (g[idx].double() - t[idx].double()).abs()
        for k in torch.sort(diff, descending=True, stable=True).indices[:n].tolist():
            j = int(idx[k])
            worst.append({"sample_id": r.sample_id, "position": len(p) + j, "token": r.tokens[j],
                          "generator": float(g[j]), "trainer": float(t[j]), "abs_diff": float(diff[k]),
                          **({"turn": r.turns[j]} if r.turns is not None else {})})
    worst.sort(key=lambda w: -w["abs_diff"])
    worst = worst[:n]
    if tok is not None:
        worst = [{**w, "text": tok.decode([w["token"]])} for w in worst]
    args = model_args(cfg)
    rep = locate_mismatches(gen_table, train_table, bad, tap_order(args)) if located else {
        "first_divergent_op": None, "tokens": [], "by_op": {}}
    return {**rep, "worst_tokens": worst}


DUMP_CONSISTENCY = ("tokens", "mismatched_tokens", "logprob_abs_diff_max")  # a dump's "consistency" (report reads it)


def dump_mismatch(job: Job, cfg, step, cons: dict, detail, batch: StepBatch, rollouts: list[Rollout],
                  weights_fp: str) -> Path:
    """The offending batch, the generator's weights (a HF directory) and the config, for replay; with the
    step's counts (`cons`: logprob_consistency's) and where the mismatch began (`detail`)."""
    out = Path(cfg.run.dir) / f"mismatch-step{step:06d}"
    out.mkdir(parents=True, exist_ok=True)
    state = job.generator_state()
    model = model_from_config(OmegaConf.merge(cfg, {"device": "cpu"}))
    model.load_state_dict(state)
    save_hf(model, out / "weights")
    record = {"step": step, "sampling": dataclasses.asdict(batch.params), "prompts": batch.prompts,
              "sample_ids": [r.sample_id for r in rollouts], "responses": [r.tokens for r in rollouts],
              "generator_logprobs": [r.logprobs.tolist() for r in rollouts],
              "weights_fp": weights_fp, "consistency": {k: cons[k] for k in DUMP_CONSISTENCY}, **detail}
    if any(r.turns is not None for r in rollouts):  # an episode's observation tokens: -1 (no generator logprob)
        record["turns"] = [r.turns for r in rollouts]
    (out / "batch.json").write_text(json_line(record) + "\n")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return out
