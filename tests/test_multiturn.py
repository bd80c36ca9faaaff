"""Multi-turn episodes on the tiny model: every policy token's generator logprob equals the trainer's
rescoring of the whole episode bit for bit (trainer EP 2 / generator EP 1), the default kernels'
twin does not; stop strings that never appear leave the per-turn limit to end the turn."""

from __future__ import annotations

import pytest
import torch
from multiturn_loop import turn_by_turn
from omegaconf import OmegaConf

from rlalign import kernels
from rlalign.agent import make_driver
from rlalign.agree import score_batch
from rlalign.config import load_config
from rlalign.model.build import model_from_config
from rlalign.sequences import policy_mask
from rlalign.step import make_batch
from rlalign.tasks import make_task
from rlalign.tasks.tokenizer import make_tokenizer

GUESS = ["task=guess", "task.num_prompts=3", "task.samples_per_prompt=2", "task.max_new_tokens=2"]


def episodes(cfg, step: int = 0):
    """One step's batch of episodes (make_batch's prompts, sample ids and sampling), generated turn by turn."""
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    t = cfg.task
    task = make_task(t.name, cfg.seed, reward=t.reward, path=t.path, **OmegaConf.to_container(t.kwargs))
    tok = make_tokenizer(t.tokenizer)
    batch = make_batch(cfg, task, tok, step)
    driver = make_driver(cfg, tok, batch.examples, batch.prompts, batch.sample_ids, f"step {step}")
    return driver.finish(turn_by_turn(model_from_config(cfg), batch.prompts, batch.sample_ids, batch.params, driver))


def mismatched_policy_tokens(cfg, rollouts) -> tuple[int, int]:
    """(policy tokens whose trainer logprob differs from the generator's in any bit, policy tokens)."""
    lps = score_batch(cfg, [r.prompt for r in rollouts], [r.tokens for r in rollouts], rollouts[0].params,
                      [r.sample_id for r in rollouts])
    bad = total = 0
    for r, lp in zip(rollouts, lps):
        m = policy_mask(r.turns, len(r.tokens))
        bad += int((lp[m].view(torch.int32) != r.logprobs[m].view(torch.int32)).sum())
        total += int(m.sum())
    return bad, total


@pytest.mark.parametrize("mode", ["deterministic", "default"])
def test_episodes_of_three_turns_agree_bitwise_at_trainer_ep2_and_the_default_twin_does_not(mode):
    cfg = load_config([*GUESS, f"kernels.mode={mode}", "trainer.ep_size=2", "trainer.micro_batch_size=2",
                       "model.dtype=float32"])
    rs = episodes(cfg)
    assert min(r.episode["turns"] for r in rs) >= 3 and all(-1 in r.turns for r in rs)
    for r in rs:  # observation tokens carry no logprob
        assert torch.equal(r.logprobs[~policy_mask(r.turns, len(r.tokens))], torch.zeros(r.turns.count(-1)))
    bad, total = mismatched_policy_tokens(cfg, rs)
    assert total >= 3 * len(rs)
    assert (bad == 0) if mode == "deterministic" else (bad > 0)


def test_a_stop_string_that_never_appears_leaves_the_turn_to_the_per_turn_limit():
    cfg = load_config([*GUESS, "task.stop=['#@#']", "task.max_new_tokens=3"])
    rs = episodes(cfg)
    ends = [e for r in rs for e in r.episode["turn_ends"]]
    assert "length" in ends and set(ends) <= {"eos", "length"}
    for r in rs:
        sizes = [r.turns.count(k) for k in range(r.episode["turns"])]
        assert max(sizes) <= 3 and [s == 3 for s in sizes] == [e == "length" for e in r.episode["turn_ends"]]
