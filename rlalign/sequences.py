"""The finished sequences both sides share: a Rollout (what the generator returns for one request)
and a Sample (what the trainer trains on). Each carries the SamplingParams its tokens were drawn
with, so the trainer scores them under that distribution, not one rebuilt from the config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlalign.sampling_params import SamplingParams


@dataclass
class Rollout:
    sample_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: torch.Tensor | None = None  # [len(tokens)] fp32, the generator's (0.0 at observation tokens)
    finish_reason: str = ""  # "eos" | "length"; an episode's: why it ended (rlalign.agent)
    params: SamplingParams = field(kw_only=True)  # what the tokens were drawn with
    # an episode (multi-turn): per token of `tokens`, the assistant turn that sampled it, or -1 for an
    # observation token (the environment's text: not sampled, no logprob, no loss); None: one turn
    turns: list[int] | None = None
    episode: dict | None = None  # an episode's own numbers (turns, tool calls, environment time, reward)


@dataclass
class Sample:
    """One finished sequence as the trainer sees it."""

    prompt: list[int]
    response: list[int]
    generator_logprobs: torch.Tensor  # [len(response)] fp32
    advantage: float = 0.0
    sample_id: int | None = None
    params: SamplingParams = field(kw_only=True)  # what the response was drawn with: the trainer scores under it
    turns: list[int] | None = None  # as Rollout.turns: -1 marks an observation token (no loss, not compared)


def policy_mask(turns: list[int] | None, n: int) -> torch.Tensor:
    """[n] bool: which of a sequence's n response tokens the policy sampled (all when `turns` is None)."""
    if turns is None:
        return torch.ones(n, dtype=torch.bool)
    if len(turns) != n:
        raise ValueError(f"turns has {len(turns)} entries for {n} response tokens")
    return torch.tensor(turns, dtype=torch.long) >= 0


def policy_tokens(sample: Sample) -> int:
    """How many of a sample's response tokens the policy sampled (what a loss is normalised by)."""
    return len(sample.response) if sample.turns is None else int(policy_mask(sample.turns, len(sample.response)).sum())


def render_episode(tok, tokens: list[int], turns: list[int] | None) -> str:
    """A response as text for people (the W&B samples table): an episode's runs of one turn each on a line
    of their own, headed `[assistant k]` or `[observation]`; a single-turn response (turns None) as its
    plain text. `tok`: anything with decode(list[int]) -> str."""
    if turns is None:
        return tok.decode(tokens)
    if len(turns) != len(tokens):
        raise ValueError(f"render_episode: {len(turns)} turns for {len(tokens)} tokens")
    parts, start = [], 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or turns[i] != turns[start]:
            head = "[observation]" if turns[start] < 0 else f"[assistant {turns[start]}]"
            parts.append(f"{head} {tok.decode(tokens[start:i])}")
            start = i
    return "\n".join(parts)
