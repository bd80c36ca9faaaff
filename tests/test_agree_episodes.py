"""`rlalign agree agree.replay=DUMP` on a multi-turn run's dump: the replay answers each turn with the
observation the dump recorded and cuts each turn where the run's did (rlalign.agent.recorded), so it
samples the run's tokens with the run's logprob bits, policy tokens compared. Negative twins: a dump
whose observation, policy token, turns or generator logprob was altered reports the difference; a
fault in the generator that the run had is reproduced by the replay."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from rlalign.agent.recorded import RecordedEpisodes, split_episode
from rlalign.agree import batch_params, recorded_episodes, replay_checks, run_agree
from rlalign.config import load_config
from rlalign.logger import json_line
from rlalign.model.build import model_from_config
from rlalign.model.hf import save_hf
from rlalign.workers import GeneratorWorker

EP1 = ["trainer.ep_size=1", "generator.ep_size=1"]
N_TURNS = [3, 4, 1]  # per episode
FAULT = "default:generator:layers.0.attn"


class Script:
    """The run's environment: episode b answers its turn k with (b + k) % 3 tokens (an empty observation
    among them) until it has taken N_TURNS[b] turns; a turn also stops at a token divisible by 7 (a stop
    string)."""

    def __init__(self):
        self.taken = [0] * len(N_TURNS)
        self.ready: list = []

    def max_len(self, b):
        return 200

    def stopped(self, b, turn):
        return turn[-1] % 7 == 0

    def ended(self, b, turn, reason):
        self.taken[b] += 1
        k = self.taken[b]
        obs = [(13 * b + 5 * k + j) % 60 + 2 for j in range((b + k) % 3)]
        self.ready.append((b, None if k >= N_TURNS[b] else obs))

    def poll(self, wait):
        out, self.ready = self.ready, []
        return out

    def pending(self):
        return len(self.ready)


def _record(dump, monkeypatch, fault=None):
    """A dump as rlalign.step.dump_mismatch writes it, of episodes the generator ran (with `fault`)."""
    cfg = load_config([*EP1, "agree.max_new_tokens=5"])
    save_hf(model_from_config(cfg), dump / "weights")
    cfg = OmegaConf.merge(cfg, {"model": {"path": str(dump / "weights")}})
    if fault:
        monkeypatch.setenv("RLALIGN_FAULT", fault)
    worker = GeneratorWorker(OmegaConf.to_container(cfg, resolve=True), 0, 1)
    prompts, ids, params = [[5, 9, 11], [3, 4], [20, 30, 40, 50]], [7, 8, 9], batch_params(cfg, 3)
    rollouts = worker.generate(prompts, ids, params, episodes=Script()).rollouts
    if fault:
        monkeypatch.delenv("RLALIGN_FAULT")
    record = {"step": 0, "sampling": dataclasses.asdict(params), "prompts": prompts, "sample_ids": ids,
              "responses": [r.tokens for r in rollouts], "generator_logprobs": [r.logprobs.tolist() for r in rollouts],
              "turns": [r.turns for r in rollouts]}
    (dump / "batch.json").write_text(json_line(record) + "\n")
    return record


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("episode-dump")
    return d, _record(d, pytest.MonkeyPatch())


def _replay(d, record=None):
    if record is not None:
        (d / "batch.json").write_text(json_line(record) + "\n")
    return run_agree(load_config([f"agree.replay={d}", *EP1]))


def _flip(xs: list[float], j: int) -> list[float]:
    t = torch.tensor(xs, dtype=torch.float32)
    t.view(torch.int32)[j] ^= 1
    return t.tolist()


def test_replay_of_an_episode_dump_samples_the_recorded_tokens_and_bits(dump):
    d, rec = dump
    assert [max(t) + 1 for t in rec["turns"]] == N_TURNS and any(-1 in t for t in rec["turns"])
    res, rollouts = _replay(d)
    assert res["replay_same_tokens"] and res["replay_generator_logprobs_equal"]
    assert [r.turns for r in rollouts] == rec["turns"]
    assert res["mismatched_tokens"] == 0 and res["tokens"] == sum(t >= 0 for ts in rec["turns"] for t in ts)
    # negative twins, on the replay's rollouts: a policy token, a turn boundary or a generator logprob altered
    j = rec["turns"][1].index(2)  # episode 1's turn 2: after two observations
    bad = copy.deepcopy(rec)
    bad["generator_logprobs"][1] = _flip(rec["generator_logprobs"][1], j)
    assert replay_checks(rollouts, bad) == {"replay_same_tokens": True, "replay_generator_logprobs_equal": False}
    bad = copy.deepcopy(rec)
    bad["responses"][1][j] = (rec["responses"][1][j] + 1) % 64
    assert replay_checks(rollouts, bad)["replay_same_tokens"] is False
    bad = copy.deepcopy(rec)
    bad["turns"][0] = [0] * len(rec["turns"][0])
    assert replay_checks(rollouts, bad)["replay_same_tokens"] is False
    bad = copy.deepcopy(rec)  # an observation token's slot carries no generator logprob: not compared
    o = rec["turns"][1].index(-1)
    bad["generator_logprobs"][1][o] = -3.5
    assert replay_checks(rollouts, bad) == {"replay_same_tokens": True, "replay_generator_logprobs_equal": True}


def test_replay_of_an_altered_observation_reports_the_difference(dump, tmp_path):
    d, rec = dump
    (tmp_path / "weights").symlink_to(d / "weights")
    bad = copy.deepcopy(rec)
    o = rec["turns"][1].index(-1)
    bad["responses"][1][o] = (rec["responses"][1][o] + 1) % 60 + 2
    res, rollouts = _replay(tmp_path, bad)
    assert rollouts[1].tokens[o] == bad["responses"][1][o]  # the replay answered with the recorded observation
    assert not res["replay_generator_logprobs_equal"] and res["mismatched_tokens"] == 0


def test_replay_reproduces_a_generator_fault_of_an_episode_run(tmp_path, monkeypatch):
    rec = _record(tmp_path, monkeypatch, FAULT)
    monkeypatch.setenv("RLALIGN_FAULT", FAULT)
    res, _ = _replay(tmp_path)
    assert res["replay_same_tokens"] and res["replay_generator_logprobs_equal"] and res["mismatched_tokens"] > 0
    monkeypatch.delenv("RLALIGN_FAULT")
    res, _ = _replay(tmp_path)  # without the fault: the trainer agrees, the run's bits are not sampled
    assert res["mismatched_tokens"] == 0 and not res["replay_generator_logprobs_equal"]
    assert [max(t) + 1 for t in rec["turns"]] == N_TURNS


def test_recorded_episodes_follow_the_record_and_refuse_a_malformed_one():
    ep = split_episode([10, 11, 50, 12, 13, 51, 52, 14], [0, 0, -1, 1, 1, -1, -1, 2], "s")
    assert ep.lengths == [2, 2, 1] and ep.observations == [[50], [51, 52]]
    assert split_episode([10, 11], [0, 1], "s").observations == [[]]  # an empty observation
    assert split_episode([10, 11], None, "s").lengths == [2]
    eps = RecordedEpisodes([ep], [3])
    assert eps.max_len(0) == 3 + 8
    assert [eps.stopped(0, [10] * n) for n in (1, 2)] == [False, True]
    eps.ended(0, [10, 11], "stop")
    assert eps.pending() == 1 and eps.poll(False) == [(0, [50])] and eps.pending() == 0
    assert eps.stopped(0, [12, 13]) and not eps.stopped(0, [12])
    eps.ended(0, [12, 13], "eos")
    eps.ended(0, [14], "stop")
    assert eps.poll(True) == [(0, [51, 52]), (0, None)]
    for turns, msg in [([0, -1], "ends with 1 observation"), ([-1, 0], "starts with an observation"),
                       ([0, 2], r"turns\[1\]=2 after assistant turn 0"), ([0, 1, 0], r"turns\[2\]=0"),
                       ([0, -2], r"turns\[1\]=-2 is neither"), ([0], "1 turns for 2 response tokens")]:
        with pytest.raises(ValueError, match=msg):
            split_episode([10, 11, 12][: max(2, len(turns))], turns, "s")
    batch = {"responses": [[10, 11]], "sample_ids": [7], "turns": [[0, -1]]}
    with pytest.raises(ValueError, match=r"^agree.replay='d' \(batch.json\), sample 7: ends with 1 observation"):
        recorded_episodes(batch, "agree.replay='d' (batch.json)")
    assert recorded_episodes({**batch, "turns": None}, "x") is None
    with pytest.raises(ValueError, match="2 turns, 1 responses, 1 sample ids"):
        recorded_episodes({**batch, "turns": [[0, 0], [0]]}, "x")
