"""What every engine shares, importable without pulling in one: the schedule's config and the prompt
checks. (The request's SamplingParams and the finished Rollout sit below rollout/ and training/:
rlalign.sampling_params, rlalign.sequences.)"""

from __future__ import annotations

from rlalign.config import EngineConfig
from rlalign.model.args import ModelArgs

__all__ = ["EngineConfig", "check_prompts"]


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
        overflow = args.context_overflow(len(p), max_new)
        if overflow:
            raise ValueError(f"prompt of sample {sid} {overflow}")
        bad = [t for t in p if not 0 <= t < args.vocab_size]
        if bad:
            raise ValueError(f"prompt of sample {sid} has token id {bad[0]} outside [0, {args.vocab_size})")
