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
    logprobs: torch.Tensor | None = None  # [len(tokens)] fp32, the generator's
    finish_reason: str = ""  # "eos" | "length"
    params: SamplingParams = field(kw_only=True)  # what the tokens were drawn with


@dataclass
class Sample:
    """One finished sequence as the trainer sees it."""

    prompt: list[int]
    response: list[int]
    generator_logprobs: torch.Tensor  # [len(response)] fp32
    advantage: float = 0.0
    sample_id: int | None = None
    params: SamplingParams = field(kw_only=True)  # what the response was drawn with: the trainer scores under it
