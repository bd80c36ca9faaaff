"""What every engine shares, importable without pulling in one: the schedule's config and the prompt
checks. (The request's SamplingParams and the finished Rollout sit below rollout/ and training/:
rlalign.sampling_params, rlalign.sequences.)"""

from __future__ import annotations

from typing import Protocol

from rlalign.config import EngineConfig
from rlalign.model.args import ModelArgs
from rlalign.values import is_int

__all__ = ["Continuations", "EngineConfig", "check_prompts"]


def check_prompts(args: ModelArgs, prompts: list[list[int]], sample_ids: list[int], max_new: int) -> None:
    """Every engine's input check: one unique sample id per prompt (it seeds the sample's noise),
    no empty prompt, token ids in the vocabulary, prompt + max_new within the model's context."""
    if len(prompts) != len(sample_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(sample_ids)} sample ids")
    odd = [s for s in sample_ids if not is_int(s) or not -(1 << 63) <= s < 1 << 63]
    if odd:
        raise ValueError(f"sample id {odd[0]!r} ({type(odd[0]).__name__}): sample ids are signed 64-bit integers "
                         "(they seed each sample's noise)")
    if len(set(map(int, sample_ids))) != len(sample_ids):
        raise ValueError("sample ids must be unique: they seed each sample's noise")
    for p, sid in zip(prompts, sample_ids):
        if len(p) == 0:
            raise ValueError(f"prompt of sample {sid} is empty")
        overflow = args.context_overflow(len(p), max_new)
        if overflow:
            raise ValueError(f"prompt of sample {sid} {overflow}")
        bad = [t for t in p if not is_int(t) or not 0 <= t < args.vocab_size]
        if bad:
            if not is_int(bad[0]):
                raise ValueError(f"prompt of sample {sid} has {bad[0]!r} ({type(bad[0]).__name__}), not an integer "
                                 f"token id in [0, {args.vocab_size})")
            raise ValueError(f"prompt of sample {sid} has token id {bad[0]} outside [0, {args.vocab_size})")


class Continuations(Protocol):
    """The other half of a multi-turn generate (rlalign.agent's episode driver implements it): the
    engine tells it when a request's assistant turn ends and asks it how each episode goes on. An
    episode keeps its KV pages while the environment works; its next turn prefills only the new
    tokens onto the same sequence (positions go on counting: a token's noise and bits are those of
    a fresh prefill of the whole history, by batch invariance)."""

    def max_len(self, b: int) -> int:
        """Request b's longest total length (prompt + every turn and observation): its pages (asked
        once, when generate starts; above the prompt's length, within the model's context)."""

    def stopped(self, b: int, turn: list[int]) -> bool:
        """Whether the tokens sampled so far in request b's current turn end it (a stop string); asked
        after each sampled token but EOS. `turn` is the engine's live list: read it, keep no reference."""

    def ended(self, b: int, turn: list[int], reason: str) -> None:
        """Request b's turn ended ("eos" | "stop" | "length": the per-turn limit params.max_new_tokens,
        or max_len(b) reached): hand it to the environment (not blocking; `turn` is the caller's to
        keep); the engine keeps the sequence's pages until poll answers for it."""

    def poll(self, wait: bool) -> list[tuple[int, list[int] | None]]:
        """Answers ready now: (b, observation tokens: prefill them and decode the next turn) or (b,
        None: the episode is over, free its pages). Observation tokens are ids of the vocabulary and
        must leave room to sample: the episode's length after them below max_len(b), else generate
        raises ValueError naming the sample (the driver ends such an episode with None instead).
        `wait`: the engine (every rank of its expert-parallel group) has nothing else to run, block
        until at least one answer is ready (or a short timeout: then [])."""

    def pending(self) -> int:
        """Turns handed out (ended) and not answered by poll yet."""
