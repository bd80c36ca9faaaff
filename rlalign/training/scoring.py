"""Trainer-side scoring: teacher-forced forward of finished sequences in micro-batches.

Each micro-batch is packed (sequences back to back, cu_seqlens) or padded (every sequence
extended with pad tokens to the micro-batch's longest; pads come after the real tokens, so
causality keeps them out of every real row). The response logprobs go through
`kernels.token_logprobs`, the generator's function, under the distribution the responses were drawn
with (their SamplingParams' logprob_kwargs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlalign import kernels
from rlalign.faults import maybe_fail
from rlalign.model import Transformer
from rlalign.monitor.taps import set_rows
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Sample, policy_mask

LAYOUTS = ("packed", "padded")


def micro_batches(n: int, micro_batch_size: int) -> list[range]:
    """Index ranges of micro-batches; micro_batch_size <= 0 means all at once."""
    size = n if micro_batch_size <= 0 else micro_batch_size
    return [range(i, min(n, i + size)) for i in range(0, n, max(1, size))]


def drawn_with(samples: Sequence[Sample]) -> SamplingParams:
    """The distribution a micro-batch's responses were drawn with (a step's samples share the step's):
    what score_micro_batch scores them under. No sample: the default (nothing is scored under it)."""
    if not samples:
        return SamplingParams()
    first = samples[0].params.logprob_kwargs()
    other = [s.sample_id for s in samples if s.params.logprob_kwargs() != first]
    if other:
        raise ValueError(f"samples {other} were drawn from another distribution than sample {samples[0].sample_id} "
                         f"({first}): one micro-batch is scored under one")
    return samples[0].params


def score_micro_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    params: SamplingParams,
    layout: str = "packed",
    pad_token_id: int = 0,
    sample_ids: Sequence[int] | None = None,
    entropy: list[torch.Tensor] | None = None,
    turns: Sequence[list[int] | None] | None = None,
) -> list[torch.Tensor]:
    """Logprobs [len(response)] fp32 of each response token given its prefix (grad if enabled), under
    `params`, the distribution the responses were drawn with. sample_ids name the rows for the
    monitor's per-token fingerprints. A list `entropy` receives the sum over response tokens of the
    full-vocabulary entropy of softmax(logits / params.temperature), fp32, no gradient (a diagnostic
    read from the logits the logprobs use; they are not changed); with `turns` (an episode's, per
    sequence: rlalign.sequences.Sample.turns) over its policy tokens only."""
    if layout not in LAYOUTS:
        raise ValueError(f"trainer.layout={layout!r}: expected one of {LAYOUTS}")
    maybe_fail("scoring.score_micro_batch", dist.get_rank() if dist.is_initialized() else 0)
    dev = model.lm_head.weight.device
    if not prompts:  # an empty micro-batch still runs the model: EP ranks step in lockstep
        model(torch.zeros(0, dtype=torch.long, device=dev), [0])
        return []
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    if layout == "padded":
        seqs = [s + [pad_token_id] * (width - len(s)) for s in seqs]
    lens = [len(s) for s in seqs]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    # logits at position j predict token j + 1: response rows start at the prompt's last token
    rows = [i for b, (p, r) in enumerate(zip(prompts, responses)) for i in range(cu[b] + len(p) - 1,
                                                                                cu[b] + len(p) - 1 + len(r))]
    policy = [] if turns is None else [i for i, keep in zip(rows, torch.cat(
        [policy_mask(t, len(r)) for t, r in zip(turns, responses)]).tolist()) if keep]  # an episode's entropy rows
    flat = [t for s in seqs for t in s] + rows + [t for r in responses for t in r] + policy
    host = torch.tensor(flat, dtype=torch.long)  # one host-to-device copy (pinned: no wait) for all of them
    host = host.pin_memory() if dev.type == "cuda" else host
    tokens, rows_t, targets, policy_t = host.to(dev, non_blocking=True).split(
        [len(flat) - 2 * len(rows) - len(policy), len(rows), len(rows), len(policy)])
    if sample_ids is not None:
        set_rows(model, "train.", [(sid, i) for sid, n in zip(sample_ids, lens) for i in range(n)])
    logits = model(tokens, cu)
    lp = kernels.token_logprobs_rows(logits, rows_t, targets, **params.logprob_kwargs())
    if entropy is not None:
        entropy.append(entropy_sum(logits, rows_t if turns is None else policy_t, params.temperature))
    return list(torch.split(lp, [len(r) for r in responses]))


@torch.no_grad()
def entropy_sum(logits: torch.Tensor, rows: torch.Tensor, temperature: float, chunk: int = 1024) -> torch.Tensor:
    """sum over `rows` of H(softmax(logits[row] / temperature)), fp32, in chunks of rows ([chunk, V]
    fp32 at a time)."""
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for part in rows.split(chunk):
        x = logits.index_select(0, part).float() / temperature  # [R, V]
        logp = torch.log_softmax(x, dim=-1)
        total += -(logp.exp() * logp).sum()
    return total


def score(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    params: SamplingParams,
    micro_batch_size: int = 0,
    **kw,
) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for mb in micro_batches(len(prompts), micro_batch_size):
        out += score_micro_batch(model, [prompts[i] for i in mb], [responses[i] for i in mb], params, **kw)
    return out
