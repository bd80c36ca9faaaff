"""Episodes generated one turn at a time by the single-turn engine (tests' reference for the
episode driver): each turn is a fresh generate over the whole history (prompt, turns and
observations), cut at the driver's stop strings. A token's noise is a function of (seed, sample id,
position) and a row's bits of its own history only, so this equals an engine that continues each
episode on its KV pages, bit for bit."""

from __future__ import annotations

import dataclasses

import torch

from rlalign.rollout.native.engine import NativeEngine
from rlalign.sequences import Rollout


def _cut(driver, b: int, tokens: list[int], eos: int | None) -> tuple[int, str]:
    """Where the engine would have ended the turn, and why (EOS first, then a stop string)."""
    for j, t in enumerate(tokens):
        if t == eos:
            return j + 1, "eos"
        if driver.stopped(b, tokens[: j + 1]):
            return j + 1, "stop"
    return len(tokens), "length"


def turn_by_turn(model, prompts, sample_ids, params, driver) -> list[Rollout]:
    hist = [list(p) for p in prompts]
    toks: list[list[int]] = [[] for _ in prompts]
    lps: list[list[torch.Tensor]] = [[] for _ in prompts]
    engine, ready = NativeEngine(model), list(range(len(prompts)))
    while ready:
        groups: dict[int, list[int]] = {}
        for b in ready:
            groups.setdefault(min(params.max_new_tokens, driver.max_len(b) - len(hist[b])), []).append(b)
        ready = []
        for limit, bs in sorted(groups.items()):
            outs = engine.generate([hist[b] for b in bs], [sample_ids[b] for b in bs],
                                   dataclasses.replace(params, max_new_tokens=limit))
            for b, o in zip(bs, outs):
                n, reason = _cut(driver, b, o.tokens, params.eos_token_id)
                hist[b] += o.tokens[:n]
                toks[b] += o.tokens[:n]
                lps[b].append(o.logprobs[:n])
                driver.ended(b, o.tokens[:n], reason)
        while driver.pending():
            for b, obs in driver.poll(wait=True):
                if obs is not None:
                    hist[b] += obs
                    toks[b] += obs
                    lps[b].append(torch.zeros(len(obs)))
                    ready.append(b)
    return [Rollout(sid, list(p), t, torch.cat(lp), params=params)
            for sid, p, t, lp in zip(sample_ids, prompts, toks, lps)]
