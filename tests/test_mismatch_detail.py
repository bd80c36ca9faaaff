"""rlalign.step.mismatch_detail's worst-token table, picked on the tensors, equals the table of every
mismatched token sorted in Python (largest |generator - trainer| in float64, ties in sample then position
order), on steps where every token differs and where few do, with ties; its twin (ties taken in another
order) differs, so the comparison can fail."""

from __future__ import annotations

import torch

from rlalign.config import load_config
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout
from rlalign.step import mismatch_detail


def _step(frac: float, seed: int):
    """12 rollouts of 40 tokens; a fraction `frac` of the trainer's logprobs moved by one of 3 steps (ties)."""
    g = torch.Generator().manual_seed(seed)
    prompts, rollouts, train = [], [], []
    for i in range(12):
        gen = -torch.rand(40, generator=g) * 4
        moved = torch.rand(40, generator=g) < frac
        step = torch.tensor([0.5, 0.25, 0.125])[torch.randint(0, 3, (40,), generator=g)]
        prompts.append(list(range(3 + i % 4)))
        rollouts.append(Rollout(100 + i, prompts[-1], list(range(40)), gen, "eos", params=SamplingParams()))
        train.append(torch.where(moved, gen - step, gen))
    return prompts, rollouts, train


def _every_token_sorted(prompts, rollouts, train, n: int, tie_order: int = 1) -> list[dict]:
    rows = []
    for p, r, t in zip(prompts, rollouts, train):
        for j in range(len(r.tokens))[::tie_order]:
            if float(r.logprobs[j]) != float(t[j]):
                rows.append({"sample_id": r.sample_id, "position": len(p) + j, "token": r.tokens[j],
                             "generator": float(r.logprobs[j]), "trainer": float(t[j]),
                             "abs_diff": abs(float(r.logprobs[j]) - float(t[j]))})
    return sorted(rows, key=lambda w: -w["abs_diff"])[:n]


def test_the_worst_tokens_picked_on_tensors_equal_every_token_sorted_and_a_tie_order_twin_differs():
    cfg = load_config(["monitor.worst_tokens=25"])
    for frac, seed in ((1.0, 0), (0.1, 1), (0.02, 2)):
        prompts, rollouts, train = _step(frac, seed)
        got = mismatch_detail(cfg, prompts, rollouts, train, None, None)["worst_tokens"]
        assert got == _every_token_sorted(prompts, rollouts, train, 25) and got
    prompts, rollouts, train = _step(1.0, 0)  # twin: ties taken from the last position first
    got = mismatch_detail(cfg, prompts, rollouts, train, None, None)["worst_tokens"]
    assert got != _every_token_sorted(prompts, rollouts, train, 25, tie_order=-1)
