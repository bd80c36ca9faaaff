"""The types every side of a rollout shares, importable without pulling in an engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlalign.config import EngineConfig, SamplingConfig
from rlalign.model.args import ModelArgs

__all__ = ["EngineConfig", "Rollout", "SamplingParams", "check_prompts"]


@dataclass
class SamplingParams(SamplingConfig):
    """One call's sampling: the generator.* distribution (defaults: the config schema's) plus what
    is the call's own, not a generator.* key: the length, the stop token and the seed."""

    max_new_tokens: int = 48  # the workload's (task.max_new_tokens, agree.max_new_tokens)
    eos_token_id: int | None = None  # None: no stop token, every sequence runs to max_new_tokens
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        self.validate_sampling()

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

    def logprob_kwargs(self) -> dict:
        """What kernels.token_logprobs needs to score tokens under the distribution they were
        sampled from: the generator uses it while sampling, the trainer while rescoring."""
        return {"temperature": self.logprob_temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass
class Rollout:
    sample_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: torch.Tensor | None = None  # [len(tokens)] fp32, the generator's
    finish_reason: str = ""  # "eos" | "length"


def check_prompts(args: ModelArgs, prompts: list[list[int]], sample_ids: list[int], max_new: int) -> None:
    """Every engine's input check: one unique sample id per prompt (it seeds the sample's noise),
    no empty prompt, token ids in the vocabulary, prompt + max_new within the model's context."""
    if len(prompts) != len(sample_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(sample_ids)} sample ids")
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("sample ids must be unique: they seed each sample's noise")
    for p, sid in zip(prompts, sample_ids):
        if not p:
            raise ValueError(f"prompt of sample {sid} is empty")
        if len(p) + max_new > args.max_position_embeddings:
            raise ValueError(
                f"prompt of sample {sid} has {len(p)} tokens; with max_new_tokens={max_new} it exceeds "
                f"the model's context of {args.max_position_embeddings} positions"
            )
        bad = [t for t in p if not 0 <= t < args.vocab_size]
        if bad:
            raise ValueError(f"prompt of sample {sid} has token id {bad[0]} outside [0, {args.vocab_size})")
