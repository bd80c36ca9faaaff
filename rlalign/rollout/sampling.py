"""The one sampling step of both engines: the native engine's (eager and inside its CUDA graphs)
and vLLM's logits processor (rollout/vllm/sampler.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlalign import kernels
from rlalign.sampling_params import SamplingParams

_M64 = (1 << 64) - 1
GRAPH_SEED = 0  # the seed the decode graphs are captured with; a call's own seed enters through rekeyed sample ids


def sample_next(logits: torch.Tensor, params: SamplingParams, sample_ids: torch.Tensor, positions: torch.Tensor,
                tap_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens at absolute `positions` [B] drawn from logits [B, V], and their fp32 logprobs
    under the distribution they were drawn from."""
    z = kernels.tempered(logits, **params.logprob_kwargs())  # once: the tokens' distribution
    if tap_fn is None:
        return kernels.sample_tempered_logprobs(z, params.seed, sample_ids, positions, greedy=params.greedy)
    tok = tap_fn(kernels.sample_tempered(z, params.seed, sample_ids, positions, greedy=params.greedy))
    return tok, kernels.tempered_logprobs(z, tok)


def rekey_sample_ids(sample_ids: torch.Tensor, seed: int, base: int = GRAPH_SEED) -> torch.Tensor:
    """Sample ids that draw, under seed `base`, exactly the noise `sample_ids` draw under `seed`. The noise
    hash starts h = mix64(mix64(seed) ^ sample_id) (kernels.sampling.uniform, the Triton gumbel_argmax):
    with id' = id ^ mix64(seed) ^ mix64(base), mix64(base) ^ id' = mix64(seed) ^ id bit for bit. So a graph
    captured once with `base` as a kernel argument samples any seed from ids copied in each step
    (tests/test_engine.py checks the identity on the hash and on the sampled tokens)."""
    s64 = [(c & _M64) - (1 << 64) if c & _M64 >= 1 << 63 else c & _M64 for c in (seed, base)]  # the kernels' int64 seed
    mix = kernels.sampling.mix64(torch.tensor(s64, dtype=torch.long))
    return sample_ids.long() ^ (mix[0] ^ mix[1]).to(sample_ids.device)
