"""Native generator: batched sampling with a KV cache, on the same model and ops as the trainer.

Prompts of different lengths are prefilled packed (one causal forward, keys/values written to
the cache), then every live sequence decodes one token per step until EOS or max_new_tokens.
The token at absolute position p of sample s is drawn with noise that depends only on
(seed, s, p) (kernels.sampling), and its logprob is `kernels.token_logprobs` of the logits it was
sampled from: the same function the trainer applies when it rescores the finished sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlalign import kernels
from rlalign.model import KVCache, Transformer
from rlalign.monitor.taps import set_rows, tap


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    eos_token_id: int | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"generator.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"generator.temperature={self.temperature}: sampling needs a temperature > 0 "
                "(set generator.greedy=true for argmax decoding)"
            )
        if self.top_k < 0:
            raise ValueError(f"generator.top_k={self.top_k}: must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"generator.top_p={self.top_p}: must be in (0, 1]")

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


def check_prompts(model: Transformer, prompts: list[list[int]], sample_ids: list[int], max_new: int) -> None:
    if len(prompts) != len(sample_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(sample_ids)} sample ids")
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("sample ids must be unique: they seed each sample's noise")
    a = model.args
    for p, sid in zip(prompts, sample_ids):
        if not p:
            raise ValueError(f"prompt of sample {sid} is empty")
        if len(p) + max_new > a.max_position_embeddings:
            raise ValueError(
                f"prompt of sample {sid} has {len(p)} tokens; with max_new_tokens={max_new} it exceeds "
                f"the model's context of {a.max_position_embeddings} positions"
            )
        bad = [t for t in p if not 0 <= t < a.vocab_size]
        if bad:
            raise ValueError(f"prompt of sample {sid} has token id {bad[0]} outside [0, {a.vocab_size})")


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    sample_ids: list[int],
    params: SamplingParams,
    any_live: Callable[[bool], bool] | None = None,
) -> list[Rollout]:
    """Sample continuations of `prompts`. `any_live(local_live)` (expert parallelism) returns
    whether any rank still decodes; a rank with nothing left keeps stepping with empty batches so
    that collectives inside the model stay in lockstep."""
    params.validate()
    if not prompts and any_live is None:
        raise ValueError("generate: empty prompt batch")
    check_prompts(model, prompts, sample_ids, params.max_new_tokens)
    dev = model.lm_head.weight.device
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
    cache = KVCache(model.args, B, (max(lens.tolist()) if B else 0) + params.max_new_tokens, model.dtype, dev)
    out = [Rollout(s, list(p)) for s, p in zip(sample_ids, prompts)]
    ids = torch.tensor(sample_ids, dtype=torch.long, device=dev)
    slots = torch.arange(B, device=dev)

    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
    cu = [0] + torch.cumsum(lens, 0).tolist()
    set_rows(model, "gen.prefill.", [(s, i) for s, p in zip(sample_ids, prompts) for i in range(len(p))])
    logits = model(flat, cu, cache=cache, slots=slots)[torch.tensor(cu[1:], dtype=torch.long, device=dev) - 1]
    positions = lens.clone()  # position of the token being sampled
    live, live_host = slots, list(range(B))  # rows still decoding (device, and its host copy)
    pos_host = [len(p) for p in prompts]
    step_lps: list[torch.Tensor] = []  # per step: logprobs of the rows live at that step, in live order
    step_rows: list[list[int]] = []
    lp_kw = params.logprob_kwargs()
    for step in range(params.max_new_tokens):
        tok = tap(model, "sample", kernels.sample(logits, params.seed, ids[live], positions[live],
                                                  greedy=params.greedy, **lp_kw))
        step_lps.append(kernels.token_logprobs(logits, tok, **lp_kw))
        step_rows.append(live_host)
        keep = []
        for j, (b, t) in enumerate(zip(live_host, tok.tolist())):  # the step's one host sync
            out[b].tokens.append(t)
            if params.eos_token_id is not None and t == params.eos_token_id:
                out[b].finish_reason = "eos"
            elif step + 1 == params.max_new_tokens:
                out[b].finish_reason = "length"
            else:
                keep.append(j)
        if len(keep) < len(live_host):
            keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
            live, tok = live[keep_t], tok[keep_t]
            live_host = [live_host[j] for j in keep]
        if step + 1 == params.max_new_tokens:
            break
        if any_live is not None:
            if not any_live(len(live_host) > 0):
                break
        elif not live_host:
            break
        set_rows(model, "gen.decode.", [(sample_ids[b], pos_host[b]) for b in live_host])
        logits = model.decode(tok, positions[live], cache, live)
        positions[live] += 1
        for b in live_host:
            pos_host[b] += 1
    flat_lps = torch.cat(step_lps).float().cpu() if step_lps else torch.zeros(0)  # one copy to the host
    per_row: list[list[torch.Tensor]] = [[] for _ in range(B)]
    off = 0
    for rows in step_rows:
        for j, b in enumerate(rows):
            per_row[b].append(flat_lps[off + j : off + j + 1])
        off += len(rows)
    for b in range(B):
        out[b].logprobs = torch.cat(per_row[b]) if per_row[b] else torch.zeros(0)
    return out
