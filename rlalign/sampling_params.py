"""SamplingParams: the distribution a request's tokens are drawn from, importable by both sides
without an engine or a trainer (nano-vllm's sampling_params.py). It travels with each request and
with each finished sequence (rlalign.sequences: Rollout, Sample): the engines, their graph cache,
vLLM's sampler, `rlalign agree` and the trainer's rescoring read it from there. Every list of its
fields is derived here from dataclasses.fields, so a field added to the class reaches each of them
(tests/test_sampling_params.py; tests/test_layers.py finds a hand-written list anywhere else)."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from rlalign.config import SamplingConfig, keys_of
from rlalign.values import is_int

# the fields a captured decode step does not bake in: the seed enters through rekeyed sample ids
# (rlalign.rollout.sampling.rekey_sample_ids), the stop token and the length are the scheduler's
NOT_IN_GRAPHS = ("seed", "eos_token_id", "max_new_tokens")


@dataclass
class SamplingParams(SamplingConfig):
    """One call's sampling: the generator.* distribution (defaults: the config schema's) plus what
    is the call's own, not a generator.* key: the length (the workload's: task.max_new_tokens in
    train, agree.max_new_tokens in agree), the stop token and the seed."""

    max_new_tokens: int = 48
    eos_token_id: int | None = None  # None: no stop token, every sequence runs to max_new_tokens
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: DictConfig, eos_token_id: int | None = None, seed: int = 0,
                    max_new_tokens: int | None = None) -> SamplingParams:
        """The generator's sampling (generator.* keys) for completions of up to `max_new_tokens` (the
        workload's key; None only where no sequence is drawn, e.g. the trainer's logprob_kwargs()), validated."""
        length = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        p = cls(**vars(keys_of(SamplingConfig, cfg.generator)), **length, eos_token_id=eos_token_id, seed=seed)
        p.validate()
        return p

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """The inverse of to_dict (a request's vLLM extra_args, a mismatch dump's "sampling"); a field
        the dict lacks keeps its default (a dump written before the field existed)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"sampling parameters {unknown}: not fields of {cls.__name__} ({sorted(names)})")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name: plain values (JSON, msgpack)."""
        return dataclasses.asdict(self)

    def __post_init__(self):
        for f in dataclasses.fields(self):  # a numpy or 0-d tensor int as the int it is (a bool stays a bool)
            v = getattr(self, f.name)
            if is_int(v) and not isinstance(v, int):
                setattr(self, f.name, operator.index(v))

    def validate(self, vocab_size: int | None = None, where: str = "generator.") -> None:
        """Refuses a value no sampler draws with, naming it as `where` + the field (the config's
        generator.* keys by default; a mismatch dump's or another request's own)."""
        self.validate_sampling(vocab_size, where)
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"{where}max_new_tokens={self.max_new_tokens!r}: must be >= 1, an integer")
        if not is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 63:
            raise ValueError(f"{where}seed={self.seed!r}: must be a signed 64-bit integer (the sampling noise's seed)")
        eos = self.eos_token_id
        if eos is not None and (not is_int(eos) or eos < 0 or vocab_size is not None and eos >= vocab_size):
            room = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{where}eos_token_id={eos!r}: must be a token id, an integer {room}, or None (no stop "
                             "token)")

    def key(self) -> tuple:
        """Every field, hashable: requests with equal keys are sampled together."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))

    def graph_key(self) -> tuple:
        """The fields a captured decode step bakes in (all but NOT_IN_GRAPHS): calls with equal keys
        replay the same CUDA graphs. A new field is in it unless listed there: it costs a capture,
        never a graph of another distribution."""
        return tuple(kv for kv in self.key() if kv[0] not in NOT_IN_GRAPHS)

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

    def logprob_kwargs(self) -> dict:
        """What kernels.token_logprobs needs to score tokens under the distribution they were
        sampled from: the generator uses it while sampling, the trainer while rescoring."""
        return {"temperature": self.logprob_temperature, "top_k": self.top_k, "top_p": self.top_p}

    def vllm_stock_kwargs(self) -> dict:
        """This distribution in vllm.SamplingParams' own names, for vLLM's stock sampler (the negative
        twin generator.vllm.stock=true: its tokens are not drawn by kernels.sample)."""
        return {"temperature": 0.0 if self.greedy else self.temperature, "top_k": self.top_k if self.top_k > 0 else -1,
                "top_p": self.top_p}
