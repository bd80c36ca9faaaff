"""A step's episode numbers from its rollouts' Rollout.episode (metrics.jsonl's episode/* keys; the
token counts per side and the per-turn comparison are the monitor's)."""

from __future__ import annotations

import math

from rlalign.sequences import Rollout

FINISH_REASONS = ("done", "turns", "context", "env_error")  # rlalign.agent.driver's


def episode_reward(episode: dict, task_reward: float) -> float:
    """An episode's reward: its environment's rewards plus the task's reward of its last turn, or the
    fallback alone after an environment failure (task.env_fallback_reward)."""
    return episode["reward"] if episode["fallback"] else episode["reward"] + task_reward


def episode_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    eps = [r.episode for r in rollouts]
    n = max(1, len(eps))
    turns = [e["turns"] for e in eps]
    out = {"episode/turns_mean": sum(turns) / n, "episode/turns_max": max(turns, default=0),
           "episode/env_reward_mean": math.fsum(e["reward"] for e in eps if not e["fallback"]) / n,
           "time/env_s": math.fsum(e["env_s"] for e in eps)}
    for key in ("tool_calls", "tool_errors", "env_errors", "env_timeouts"):
        out[f"episode/{key}"] = sum(e[key] for e in eps)
    for reason in FINISH_REASONS:
        out[f"episode/finish_{reason}_frac"] = sum(r.finish_reason == reason for r in rollouts) / n
    ends = [end for e in eps for end in e["turn_ends"]]
    out["episode/turn_stop_frac"] = ends.count("stop") / max(1, len(ends))  # turns ended at a task.stop string
    return out
