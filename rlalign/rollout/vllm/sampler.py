"""rlalign's sampler and logprob inside vLLM, as a v1 logits processor.

For each request that carries `extra_args["rlalign"]` (its SamplingParams as a dict, its sample id),
the row's token and its logprob are `rlalign.rollout.sampling.sample_next` (kernels.sample
with noise from (seed, sample id, position), position = prompt length + tokens so far, and
kernels.token_logprobs): the native engine's own sampling step. The processor leaves that token
finite with its logprob as the value and every other entry -inf. The engine asks vLLM for temperature 0, logprobs=0 and
logprobs_mode="processed_logits": vLLM's greedy pick is then our token and the logprob it returns
is our fp32 value, untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from rlalign.rollout.sampling import sample_next
from rlalign.rollout.vllm.registry import KEY
from rlalign.sampling_params import SamplingParams


@dataclass
class _Request:
    params: SamplingParams  # requests with equal params.key() are sampled together
    sample_id: int
    prompt_len: int
    output: list[int]  # vLLM's live list of the request's generated tokens


def _request(params, prompt: list[int] | None, output: list[int]) -> _Request | None:
    spec = (params.extra_args or {}).get(KEY)
    if spec is None:
        return None
    return _Request(SamplingParams.from_dict(spec["params"]), int(spec["sample_id"]), len(prompt or []), output)


_LIVE: dict[int, _Request] = {}  # this worker's persistent-batch index -> request (the model names its rows by it)


def sample_ids(num_reqs: int) -> list[int]:
    """The sample id of each of the step's requests (-1: not rlalign's)."""
    return [_LIVE[i].sample_id if i in _LIVE else -1 for i in range(num_reqs)]


class RlalignSampler(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows = _LIVE  # persistent-batch index -> request; one processor per worker process
        self.rows.clear()

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token: vLLM must apply it before its greedy pick

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _request)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        groups: dict[tuple, list[int]] = {}
        for i, r in self.rows.items():
            groups.setdefault(r.params.key(), []).append(i)
        for idx in groups.values():
            reqs = [self.rows[i] for i in idx]
            rows = torch.tensor(idx, dtype=torch.long, device=logits.device)
            ids = torch.tensor([r.sample_id for r in reqs], dtype=torch.long, device=logits.device)
            pos = torch.tensor([r.prompt_len + len(r.output) for r in reqs], dtype=torch.long, device=logits.device)
            z = logits.index_select(0, rows)
            tok, lp = sample_next(z, reqs[0].params, ids, pos)
            out = torch.full_like(z, float("-inf"))
            out.scatter_(1, tok[:, None], lp[:, None].to(out.dtype))
            logits.index_copy_(0, rows, out)
        return logits
