"""The workload's part of the config schema: task.* (what is generated and how it is rewarded,
multi-turn episodes included) and algorithm.* (the loss), with their checks. rlalign.config
composes them into Config and re-exports every name here."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from omegaconf import DictConfig

OldLogprobs = Literal["generator", "trainer"]  # the PPO ratio's denominator
LossName = Literal["grpo", "ppo-clip", "dr_grpo", "gspo"]  # the built-in losses (rlalign.training.losses.LOSSES)


def choice(default: str | None, allowed: Any) -> Any:
    """A str field whose value must be one of the Literal `allowed` (None too when default is None)."""
    assert default is None or default in get_args(allowed), (default, allowed)
    return field(default=default, metadata={"allowed": allowed})


def did_you_mean(value: Any, allowed: Any) -> str:
    """' (did you mean 'x'?)' for the allowed string closest to value, else the one value begins (a
    name's first part: 'ppo' for 'ppo-clip'), or ''."""
    names = [a for a in allowed if isinstance(a, str)]
    close = difflib.get_close_matches(str(value), names, n=1)
    if not close and len(str(value)) >= 2:
        close = [a for a in names if a.startswith(str(value))][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass
class TaskConfig:
    name: str = "repeat"  # repeat | reverse | add | jsonl | guess | calc
    path: str | None = None  # JSONL dataset for name=jsonl
    # 'pkg.module:function'; None = the task's default. With `env`: it scores the episode's last assistant
    # turn, added to the environment's rewards ('zero': the environment's alone, guess's default)
    reward: str | None = None
    # a local HF tokenizer directory; 'char': the char tokenizer; None: model.path's when it holds one, else 'char'
    tokenizer: str | None = None
    chat: bool = False  # each prompt as the user turn of the tokenizer's chat template + the generation prompt
    num_prompts: int = 16  # prompts per step
    samples_per_prompt: int = 8  # GRPO group size (with `env`: episodes per task row)
    # the completion length of `rlalign train` (a task option sets its own: repeat 5); with `env`: per turn
    max_new_tokens: int = 48
    kwargs: dict[str, Any] = field(default_factory=dict)  # task parameters (e.g. letters, length)
    # rlalign/tasks/reward_calls.py: each call's time limit (null: none); a call past it ends the
    # run naming the sample, or scores reward_timeout_fallback when that is set
    reward_timeout_s: float | None = 600.0
    reward_timeout_fallback: float | None = None
    reward_workers: int = 1  # reward calls running at once (threads; for I/O-bound verifiers)
    # Multi-turn episodes (rlalign/agent): an environment answers each assistant turn with observation
    # text until it is done. A built-in one (guess | calc) or 'pkg.module:Class'; null: one turn
    env: str | None = None
    max_turns: int = 4  # assistant turns per episode
    max_context_len: int | None = None  # an episode's tokens (prompt, turns, observations); null: the model's
    stop: list[str] = field(default_factory=list)  # strings that end an assistant turn (e.g. a tool call's ')')
    # each environment call's time limit (null: none); past it, or when the environment raises or returns
    # no string, the run ends naming the episode and turn, or the episode ends scoring env_fallback_reward
    env_timeout_s: float | None = 60.0
    env_fallback_reward: float | None = None
    env_workers: int = 64  # environment calls running at once per generator rank (threads; an episode waits
    # for a free one, so with slow environments about the episodes in flight)
    # with task.chat: each observation is a message of this role in the chat template (some templates know
    # only user/assistant: 'user'), after the assistant's end of turn and before the generation prompt
    observation_role: str = "tool"


def task_problems(t: DictConfig) -> list[str]:
    """task.* values outside their meaning's range."""
    checks = [
        ("task.max_new_tokens", t.max_new_tokens, t.max_new_tokens >= 1, ">= 1"),
        ("task.reward_timeout_s", t.reward_timeout_s, t.reward_timeout_s is None or t.reward_timeout_s > 0,
         "> 0 (or null: no limit)"),
        ("task.reward_workers", t.reward_workers, t.reward_workers >= 1, ">= 1"),
        ("task.max_turns", t.max_turns, t.max_turns >= 1, ">= 1"),
        ("task.max_context_len", t.max_context_len, t.max_context_len is None or t.max_context_len >= 2,
         ">= 2 (or null: the model's)"),
        ("task.env_timeout_s", t.env_timeout_s, t.env_timeout_s is None or t.env_timeout_s > 0,
         "> 0 (or null: no limit)"),
        ("task.env_workers", t.env_workers, t.env_workers >= 1, ">= 1"),
        ("task.env_fallback_reward", t.env_fallback_reward,
         t.env_fallback_reward is None or math.isfinite(t.env_fallback_reward), "finite (or null: an error)"),
        ("task.reward_timeout_fallback", t.reward_timeout_fallback,
         t.reward_timeout_fallback is None or math.isfinite(t.reward_timeout_fallback), "finite (or null: an error)"),
        ("task.stop", list(t.stop), all(isinstance(s, str) and s for s in t.stop), "non-empty strings"),
    ]
    problems = [f"{key}={value}: must be {want}" for key, value, ok, want in checks if not ok]
    if t.env is not None and not re.fullmatch(r"\w+|[^:]+:[A-Za-z_]\w*", t.env):
        problems.append(f"task.env={t.env!r}: expected a built-in environment's name or 'pkg.module:Class'")
    if t.env is None:  # the episode settings whose default says "not set"
        episode = {"stop": list(t.stop) or None, "max_context_len": t.max_context_len,
                   "env_fallback_reward": t.env_fallback_reward}
        problems += [f"task.{key}={value}: a multi-turn setting, which does nothing while task.env is null: set "
                     f"task.env, or task.{key}={'[]' if key == 'stop' else 'null'}"
                     for key, value in episode.items() if value is not None]
    return problems


@dataclass
class TISConfig:
    enabled: bool = False
    cap: float = 2.0


@dataclass
class IcePopConfig:
    enabled: bool = False
    low: float = 0.5
    high: float = 2.0


@dataclass
class AlgorithmConfig:
    # the loss (rlalign/training/losses.py): grpo | ppo-clip | dr_grpo | gspo; with `loss` set, that loss's label
    name: str = "grpo"
    loss: str | None = None  # a user's loss: 'pkg.module:function' or '/path/to/file.py:function'
    clip_low: float = 0.2
    clip_high: float = 0.2
    ppo_epochs: int = 1
    num_minibatches: int = 1
    norm_adv_by_std: bool = True
    old_logprobs: str = choice("generator", OldLogprobs)
    kl_coef: float = 0.0  # reference-model k3 penalty (0 = off)
    tis: TISConfig = field(default_factory=TISConfig)
    icepop: IcePopConfig = field(default_factory=IcePopConfig)


def algorithm_problems(a: DictConfig) -> list[str]:
    problems = [f"algorithm.{key}={a[key]}: must be >= 1" for key in ("ppo_epochs", "num_minibatches") if a[key] < 1]
    names = get_args(LossName)
    if a.loss is None and a.name not in names:
        problems.append(f"algorithm.name={a.name!r}: no such loss{did_you_mean(a.name, names)}; built in: "
                        f"{', '.join(names)} (or algorithm.loss='pkg.module:function' for your own)")
    if a.loss is not None and not re.fullmatch(r"[^:]+:[A-Za-z_]\w*", a.loss):
        problems.append(f"algorithm.loss={a.loss!r}: expected 'pkg.module:function' or '/path/to/file.py:function'")
    if a.loss is None and a.name == "ppo-clip" and a.kl_coef > 0:
        problems.append(f"algorithm.kl_coef={a.kl_coef} with algorithm.name=ppo-clip: ppo-clip has no reference-KL "
                        "term; use algorithm.name=grpo (ppo-clip plus the KL) or algorithm.kl_coef=0")
    return problems
