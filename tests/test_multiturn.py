"""Multi-turn episodes on the tiny model through GeneratorWorker.generate (the engine continues each
episode; the episode driver runs the environments): every policy token's generator logprob equals
the trainer's rescoring of the whole episode bit for bit at trainer EP 2 / generator EP 1 and at
generator EP 2, the default kernels' twin does not; a stop string that never appears leaves the
per-turn limit to end the turn; a run resumed mid-way equals the uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from multiturn_loop import turn_by_turn
from omegaconf import OmegaConf

from rlalign import kernels
from rlalign.agent import make_driver
from rlalign.agree import score_batch
from rlalign.config import load_config
from rlalign.model.build import model_from_config
from rlalign.parallel.launch import run_workers, shard_range
from rlalign.sequences import policy_mask
from rlalign.step import make_batch
from rlalign.tasks import make_task
from rlalign.tasks.tokenizer import CHARS, make_tokenizer
from rlalign.workers import GeneratorWorker

GUESS = ["task=guess", "task.num_prompts=3", "task.samples_per_prompt=2", "task.max_new_tokens=2"]


def step_batch(cfg, step: int = 0):
    """make_batch's step of the task (prompts, sample ids, sampling), and the tokenizer."""
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    t = cfg.task
    task = make_task(t.name, cfg.seed, reward=t.reward, path=t.path, **OmegaConf.to_container(t.kwargs))
    tok = make_tokenizer(t.tokenizer)
    return make_batch(cfg, task, tok, step), tok


def episodes(cfg, step: int = 0):
    """One step's episodes generated turn by turn (tests/multiturn_loop.py: fresh prefills of each history)."""
    batch, tok = step_batch(cfg, step)
    driver = make_driver(cfg, tok, batch.examples, batch.prompts, batch.sample_ids, f"step {step}")
    return driver.finish(turn_by_turn(model_from_config(cfg), batch.prompts, batch.sample_ids, batch.params, driver))


def _generate_rank(rank, world, group, cfg_dict, batch):
    """A generator rank's share of the step's episodes, by GeneratorWorker.generate (`rlalign train`'s path)."""
    w = GeneratorWorker(cfg_dict, rank, world, group=group)
    part = list(shard_range(len(batch.prompts), world, rank))
    return w.generate([batch.prompts[i] for i in part], [batch.sample_ids[i] for i in part], batch.params, 0,
                      examples=[batch.examples[i] for i in part]).rollouts


def worker_episodes(cfg):
    """One step's episodes from the generator group (generator.ep_size ranks; spawned at EP > 1)."""
    batch, _ = step_batch(cfg)
    cfg_dict, world = OmegaConf.to_container(cfg, resolve=True), cfg.generator.ep_size
    parts = [_generate_rank(0, 1, None, cfg_dict, batch)] if world == 1 else run_workers(
        world, _generate_rank, (cfg_dict, batch), cfg.device, cfg.dist.timeout_s)
    return [r for part in parts for r in part]


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


def same(a, b) -> bool:
    """The same episodes: tokens, turns, finish reasons, episode numbers (but times) and logprob bits."""
    def key(r):
        return (r.sample_id, r.tokens, r.turns, r.finish_reason, {k: v for k, v in r.episode.items() if k != "env_s"})
    return [key(r) for r in a] == [key(r) for r in b] and all(
        torch.equal(x.logprobs.view(torch.int32), y.logprobs.view(torch.int32)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ep1():
    """The deterministic step-0 episodes from GeneratorWorker at generator EP 1 (config, rollouts)."""
    cfg = load_config([*GUESS, "trainer.ep_size=2", "trainer.micro_batch_size=2", "model.dtype=float32"])
    return cfg, worker_episodes(cfg)


@pytest.mark.slow  # spawned EP ranks
def test_episodes_of_three_turns_agree_bitwise_at_trainer_ep2_generator_ep1(ep1):
    cfg, rs = ep1
    assert min(r.episode["turns"] for r in rs) >= 3 and all(-1 in r.turns for r in rs)
    for r in rs:  # observation tokens carry no logprob
        assert torch.equal(r.logprobs[~policy_mask(r.turns, len(r.tokens))], torch.zeros(r.turns.count(-1)))
    assert same(rs, episodes(cfg))  # the engine's continued episodes == fresh prefills of each history
    bad, total = mismatched_policy_tokens(cfg, rs)
    assert bad == 0 and total >= 3 * len(rs)


@pytest.mark.slow  # spawned EP ranks
def test_negative_twin_the_default_kernels_mismatch_on_episodes():
    cfg = load_config([*GUESS, "kernels.mode=default", "trainer.ep_size=2", "trainer.micro_batch_size=2",
                       "model.dtype=float32"])
    bad, total = mismatched_policy_tokens(cfg, worker_episodes(cfg))
    assert bad > 0 and total > 0


@pytest.mark.slow  # spawned EP ranks
def test_episodes_at_generator_ep2_equal_generator_ep1_and_agree_with_the_trainer(ep1):
    cfg, rs = ep1
    cfg2 = OmegaConf.merge(cfg, {"generator": {"ep_size": 2}, "trainer": {"ep_size": 1}})
    rs2 = worker_episodes(cfg2)
    assert same(rs2, rs)
    assert mismatched_policy_tokens(cfg2, rs2)[0] == 0


def test_stop_strings_end_turns_and_one_that_never_appears_leaves_the_per_turn_limit():
    cfg = load_config([*GUESS, "task.stop=['#@#']", "task.max_new_tokens=3"])
    rs = worker_episodes(cfg)
    ends = [e for r in rs for e in r.episode["turn_ends"]]
    assert "length" in ends and set(ends) <= {"eos", "length"}
    for r in rs:
        sizes = [r.turns.count(k) for k in range(r.episode["turns"])]
        assert max(sizes) <= 3 and [s == 3 for s in sizes] == [e == "length" for e in r.episode["turn_ends"]]
    stops = [c for c in CHARS if c not in "<>?"]  # twin: every character but the observations' is a stop string
    rs = worker_episodes(OmegaConf.merge(cfg, {"task": {"stop": stops}}))
    tok = make_tokenizer(None)
    turns = [(tok.decode([t for t, k in zip(r.tokens, r.turns) if k == j]), end)
             for r in rs for j, end in enumerate(r.episode["turn_ends"])]
    assert sum(end == "stop" for _, end in turns) > len(turns) // 2
    for text, end in turns:  # a turn ends at its first stop character, else at EOS or the limit
        assert (end == "stop") == (text[-1:] in stops) and not any(c in stops for c in text[:-1])


@pytest.mark.slow
def test_a_multiturn_run_resumed_after_step_0_equals_the_uninterrupted_run(tmp_path):
    """The replay gate (rlalign.gates): `rlalign train task=guess` for 2 steps at trainer EP 2 / generator
    EP 1, and the same run resumed from its step-0 checkpoint: step 1's metrics (rewards, episode
    numbers, mismatches) and every trace record are equal. The environments are reset with seeds of
    (seed, sample id), so the resumed run replays step 1's episodes."""
    from rlalign.gates import run_gate

    over = [*GUESS, "run.steps=2", f"run.dir={tmp_path}", "trainer.ep_size=2", "trainer.micro_batch_size=2"]
    ok, text = run_gate("replay", over, load_config(over))
    assert ok, text
    rows = [json.loads(ln) for ln in (tmp_path / "gate-replay" / "b" / "metrics.jsonl").open()]
    assert [r["consistency/mismatched_tokens"] for r in rows] == [0, 0] and rows[1]["episode/turns_mean"] >= 3
