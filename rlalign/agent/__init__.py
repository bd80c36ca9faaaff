"""Multi-turn episodes: an environment answers each assistant turn (rlalign.agent.env), the episode
driver runs the environments beside the engine's decoding (rlalign.agent.driver), and the engine
continues each episode on its own KV pages (rlalign.rollout.native). Built in: guess and calc
(rlalign.agent.envs); task.env='pkg.module:Class' (or '/path/to/file.py:Class') for a user's own."""

from __future__ import annotations

from omegaconf import DictConfig

from rlalign.agent.driver import EnvError, EpisodeDriver, EpisodeLimits, stop_token_ids
from rlalign.agent.env import Env, Step, load_env
from rlalign.agent.envs import ENVS
from rlalign.agent.pool import EnvPool
from rlalign.config import model_args

__all__ = ["Env", "EnvError", "EnvPool", "EpisodeDriver", "EpisodeLimits", "Step", "env_class", "episode_limits",
           "make_driver", "stop_token_ids"]


def env_class(cfg: DictConfig) -> type | None:
    """task.env's class (None: single-turn), imported now: a bad name fails before any actor starts."""
    return load_env(cfg.task.env, ENVS) if cfg.task.env else None


def episode_limits(cfg: DictConfig) -> EpisodeLimits:
    t = cfg.task
    context = model_args(cfg).max_position_embeddings
    if t.max_context_len is not None and t.max_context_len > context:
        raise ValueError(f"task.max_context_len={t.max_context_len} exceeds the model's context of {context} tokens")
    return EpisodeLimits(t.max_turns, t.max_context_len or context, tuple(t.stop), t.env_timeout_s,
                         t.env_fallback_reward, t.env_workers, t.observation_role)


def make_driver(cfg: DictConfig, tok, examples, prompts: list[list[int]], sample_ids: list[int],
                phase: str = "", pool: EnvPool | None = None) -> EpisodeDriver:
    """The driver of one generate call's episodes (task.env's environments, task.* limits), its
    environment calls in `pool` (task.env_workers threads kept across calls) or its own."""
    return EpisodeDriver(env_class(cfg), tok, examples, prompts, sample_ids, cfg.seed, episode_limits(cfg), phase,
                         pool)
