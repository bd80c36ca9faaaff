"""Generator-vs-trainer per-token logprob comparison.

Metric names (all under consistency/ in metrics.jsonl):
  tokens                  response tokens compared
  mismatched_tokens       tokens whose two fp32 logprobs differ in any bit
  mismatch_token_frac     mismatched_tokens / tokens
  mismatch_seq_frac       fraction of sequences with at least one mismatched token
  logprob_abs_diff_max    max |train - gen| over tokens
  logprob_abs_diff_mean   mean |train - gen|
  k3_kl                   mean of (r - 1) - log r, r = exp(train - gen): the k3 estimator of
                          KL(gen || train) on the generator's samples (0 when identical)
  ppl_ratio               exp(mean(gen - train)): trainer perplexity / generator perplexity
  abs_diff_hist           counts of |diff| in decades: 0, (0,1e-7], (1e-7,1e-6], ..., (1e-1, inf)

Episodes (multi-turn, `turns` per sequence as rlalign.sequences.Rollout.turns): every metric is over
the policy tokens only (an observation token has no generator logprob), and per assistant turn k:
  turn_{k}/tokens              policy tokens of turn k compared
  turn_{k}/mismatched_tokens   those whose two logprobs differ in any bit
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlalign.sequences import policy_mask

HIST_EDGES = [0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1]


def logprob_consistency(gen: Sequence[torch.Tensor], train: Sequence[torch.Tensor],
                        turns: Sequence[list[int] | None] | None = None) -> dict:
    """The consistency/ metrics (module docstring) of the generator's and the trainer's per-token logprobs,
    sequence by sequence; with `turns` (episodes), over the policy tokens, and per turn."""
    if len(gen) != len(train):
        raise ValueError(f"logprob_consistency: {len(gen)} generator sequences vs {len(train)} trainer sequences")
    for i, (g, t) in enumerate(zip(gen, train)):
        if g.shape != t.shape:
            raise ValueError(f"logprob_consistency: sequence {i} has {g.numel()} generator vs {t.numel()} trainer "
                             "logprobs")
    if turns is not None and any(t is not None for t in turns):
        keep = [policy_mask(t, g.numel()) for t, g in zip(turns, gen)]
        by_turn = mismatch_by_turn(gen, train, turns)
        pick = lambda xs: [x.detach().float().cpu()[k] for x, k in zip(xs, keep)]  # noqa: E731
        return {**logprob_consistency(pick(gen), pick(train)), **by_turn}
    if not gen:
        return {"tokens": 0, "mismatched_tokens": 0}
    g = torch.cat([x.detach().float().cpu() for x in gen])
    t = torch.cat([x.detach().float().cpu() for x in train])
    diff = t.double() - g.double()
    ad = diff.abs()
    same = g.view(torch.int32) == t.view(torch.int32)
    seq_bad = [bool((a.detach().float().cpu().view(torch.int32) != b.detach().float().cpu().view(torch.int32)).any())
               for a, b in zip(gen, train)]
    r = torch.exp(diff)
    hist = [int((ad == 0).sum())]
    for lo, hi in zip(HIST_EDGES, HIST_EDGES[1:] + [float("inf")]):
        hist.append(int(((ad > lo) & (ad <= hi)).sum()))
    n = g.numel()
    return {
        "tokens": n,
        "mismatched_tokens": int((~same).sum()),
        "mismatch_token_frac": float((~same).sum()) / max(1, n),
        "mismatch_seq_frac": sum(seq_bad) / len(seq_bad),
        "logprob_abs_diff_max": float(ad.max()) if n else 0.0,
        "logprob_abs_diff_mean": float(ad.mean()) if n else 0.0,
        "k3_kl": float(((r - 1) - diff).mean()) if n else 0.0,
        "ppl_ratio": float(torch.exp(-diff.mean())) if n else 1.0,
        "abs_diff_hist": hist,
    }


def mismatch_by_turn(gen: Sequence[torch.Tensor], train: Sequence[torch.Tensor],
                     turns: Sequence[list[int] | None]) -> dict:
    """{turn_{k}/tokens, turn_{k}/mismatched_tokens} over the sequences' policy tokens, k ascending (a
    sequence without turns counts as turn 0)."""
    counts: dict[int, list[int]] = {}
    for g, t, ts in zip(gen, train, turns):
        differ = (g.detach().float().cpu().view(torch.int32) != t.detach().float().cpu().view(torch.int32)).tolist()
        for k, d in zip(ts if ts is not None else [0] * len(differ), differ):
            if k >= 0:
                c = counts.setdefault(k, [0, 0])
                c[0], c[1] = c[0] + 1, c[1] + d
    out = {}
    for k in sorted(counts):
        out[f"turn_{k}/tokens"], out[f"turn_{k}/mismatched_tokens"] = counts[k]
    return out
