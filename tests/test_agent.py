"""rlalign.agent: the environment interface, the built-in environments, the episode driver's limits,
stop strings, finish reasons, failures (an error naming the episode and turn, or the counted
fallback) and the user's environment hook. The engine here is scripted (each turn a fixed text);
tests/test_multiturn.py runs the model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rlalign.agent import EnvError, EpisodeDriver, EpisodeLimits, Step, env_class, make_driver
from rlalign.agent.env import load_env
from rlalign.agent.envs import ENVS, CalcEnv, GuessEnv, evaluate
from rlalign.agent.metrics import episode_metrics, episode_reward
from rlalign.config import ConfigError, load_config
from rlalign.rollout.generator import check_generator
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout
from rlalign.tasks import Example, make_task
from rlalign.tasks.tokenizer import EOS_ID, CharTokenizer

TOK = CharTokenizer()
ROW = Example("g0-7:", "3")


def _driver(env_cls, n=2, **limits) -> EpisodeDriver:
    lim = {"max_turns": 4, "max_context_len": 64, "timeout_s": 5.0, "workers": 2, **limits}
    return EpisodeDriver(env_cls, TOK, [ROW] * n, [TOK.encode(ROW.prompt)] * n, list(range(10, 10 + n)), 0,
                         EpisodeLimits(**lim), "step 7")


def scripted(driver: EpisodeDriver, turns: list[str]) -> list[Rollout]:
    """Every episode's k-th turn is turns[k] (the last one repeated) and EOS."""
    n = len(driver.episodes)
    tokens: list[list[int]] = [[] for _ in range(n)]
    ready, k = list(range(n)), [0] * n
    while ready:
        for b in ready:
            turn = TOK.encode(turns[min(k[b], len(turns) - 1)]) + [EOS_ID]
            tokens[b] += turn
            k[b] += 1
            driver.ended(b, turn, "eos")
        ready = []
        while driver.pending():
            for b, obs in driver.poll(wait=True):
                if obs is not None:
                    tokens[b] += obs
                    ready.append(b)
    return driver.finish([Rollout(ep.sample_id, [2], t, torch.zeros(len(t)), params=SamplingParams())
                          for ep, t in zip(driver.episodes, tokens)])


def test_guess_episodes_turns_observations_rewards_and_finish_reasons():
    rs = scripted(_driver(GuessEnv), ["5", "x", "3"])  # '<' (lower), '?' (not a digit), found at turn 3
    r = rs[0]
    assert TOK.decode(r.tokens) == "5<x?3" and r.turns == [0, 0, -1, 1, 1, -1, 2, 2]
    assert r.finish_reason == "done" and r.episode["turns"] == 3 and r.episode["reward"] == pytest.approx(0.1 + 0.6)
    hints = scripted(_driver(GuessEnv, 1), ["5", "6", "1", "4"])[0]  # 6 ignores the '<' after 5; 1 and 4 keep both
    assert TOK.decode(hints.tokens) == "5<6<1>4" and hints.episode["reward"] == pytest.approx(0.1 + 0.1 + 0.1)
    assert r.episode["turn_ends"] == ["eos"] * 3 and r.episode["last_turn"] == "3"
    never = scripted(_driver(GuessEnv), ["9"])[0]  # twin: never found, max_turns ends it
    assert never.finish_reason == "turns" and never.episode["turns"] == 4
    assert never.episode["reward"] == pytest.approx(0.1)  # the first 9 the hints allowed, its repeats not
    m = episode_metrics(rs + [never])
    assert m["episode/turns_mean"] == pytest.approx(10 / 3) and m["episode/turns_max"] == 4
    assert m["episode/finish_done_frac"] == pytest.approx(2 / 3)
    assert m["episode/finish_turns_frac"] == pytest.approx(1 / 3)


def test_calc_tool_calls_stop_strings_and_the_final_answer():
    assert evaluate("13*7+5") == 96 and evaluate("-(2-5)*3") == 9
    for bad in ("2**3", "x", "1/2", "9" * 13):
        with pytest.raises(ValueError):
            evaluate(bad)
    d = _driver(CalcEnv, 1, stop=(")",))
    assert d.stopped(0, TOK.encode("ab calc(3*7)")) and not d.stopped(0, TOK.encode("calc(3*7"))
    r = scripted(d, ["calc(3*7)", "calc(3:7)", "21"])[0]
    assert TOK.decode(r.tokens) == "calc(3*7)21calc(3:7)err21"
    assert r.finish_reason == "done" and r.episode["tool_calls"] == 2 and r.episode["tool_errors"] == 1
    assert episode_reward(r.episode, 1.0) == 1.0  # the task's exact_match of the last turn, added to 0


class Raises(GuessEnv):
    def step(self, action):
        if self.turn == 1:
            raise KeyError("no such tool")
        return super().step(action)


class NotAString(GuessEnv):
    def step(self, action):
        return Step(observation=7) if self.turn else super().step(action)


class OutsideTheTokenizer(GuessEnv):
    def step(self, action):
        return Step("HIGHER")


HANG = threading.Event()


class Hangs(GuessEnv):
    def step(self, action):
        HANG.wait(30)
        return Step("<")


@pytest.mark.parametrize("env, what", [
    (Raises, r"raised KeyError: 'no such tool' in the episode of sample 1[01] \(step 7, prompt 'g0-7:'\), turn 2 "
             r"\(at .*test_agent.py:\d+ in step\)"),
    (NotAString, r"returned the observation 7 \(int\); an observation must be a string in the episode of sample "
                 r"1[01] \(step 7, prompt 'g0-7:'\), turn 2"),
    (Hangs, r"did not answer within task.env_timeout_s=0.2 s in the episode of sample 1[01] .*, turn 1"),
])
def test_a_failing_environment_is_an_error_naming_the_episode_and_turn_or_the_counted_fallback(env, what):
    HANG.clear()
    try:
        with pytest.raises(EnvError, match=what + r" \(set task.env_fallback_reward=VALUE"):
            scripted(_driver(env, timeout_s=0.2), ["5"])
        rs = scripted(_driver(env, timeout_s=0.2, fallback=-1.0), ["5"])
    finally:
        HANG.set()
    key = "env_timeouts" if env is Hangs else "env_errors"
    assert [(r.finish_reason, r.episode[key], r.episode["fallback"]) for r in rs] == [("env_error", 1, True)] * 2
    assert [episode_reward(r.episode, 5.0) for r in rs] == [-1.0, -1.0]  # the fallback alone
    assert episode_metrics(rs)[f"episode/{key}"] == 2


def test_text_outside_the_tokenizer_is_an_error_naming_the_turn_even_with_a_fallback():
    with pytest.raises(EnvError, match=r"answered text outside the tokenizer in the episode of sample 1[01] .*turn 1: "
                                       r"the observation 'HIGHER': characters \['E', 'G', 'H', 'I', 'R'\]"):
        scripted(_driver(OutsideTheTokenizer, fallback=0.0), ["5"])


def test_an_observation_overflowing_the_context_ends_the_episode_with_finish_reason_context():
    class Long(GuessEnv):
        def step(self, action):
            return Step("<" * 20)

    r = scripted(_driver(Long, 1, max_context_len=40), ["5"])[0]  # prompt 5 + (2 + 20) + 2 = 29; + 20 + 1 > 40
    assert r.finish_reason == "context" and r.episode["turns"] == 2 and r.episode["observation_tokens"] == 20
    assert TOK.decode(r.tokens) == "5" + "<" * 20 + "5"
    fits = scripted(_driver(Long, 1, max_context_len=200), ["5"])[0]  # twin: room for every turn
    assert fits.finish_reason == "turns" and fits.episode["turns"] == 4


def test_the_users_environment_loads_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from rlalign.agent import Env, Step\n\n"
        "class Echo(Env):\n"
        "    def reset(self, example, seed):\n"
        "        self.answer = example.answer\n\n"
        "    def step(self, action):\n"
        "        return action, float(action == self.answer), True\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["task=guess", "task.env=my_envs:Echo"])
    assert env_class(cfg).__name__ == "Echo"
    prompts = [TOK.encode(ROW.prompt)] * 2
    d = make_driver(cfg, TOK, [ROW, ROW], prompts, [0, 1], "step 0")
    rs = scripted(d, ["3"])
    assert [(r.finish_reason, r.episode["reward"]) for r in rs] == [("done", 1.0)] * 2
    with pytest.raises(ValueError, match=r"task.env='my_envs:Nope': module 'my_envs' \(.*my_envs.py\) has no class "
                                         r"'Nope' with reset\(example, seed\) and step\(action\) methods"):
        load_env("my_envs:Nope", ENVS)
    with pytest.raises(ValueError, match=r"task.env='gues': no such built-in environment; built in: calc, guess"):
        load_env("gues", ENVS)


def test_config_keys_tasks_and_the_vllm_refusal():
    cfg = load_config(["task=calc"])
    assert (cfg.task.env, list(cfg.task.stop), cfg.task.max_turns) == ("calc", [")"], 3)
    assert make_task("guess", 0, size=8).examples(0, 2) == make_task("guess", 0, size=8).examples(0, 2)
    with pytest.raises(ConfigError, match="task.max_turns=0: must be >= 1"):
        load_config(["task=guess", "task.max_turns=0"])
    with pytest.raises(ConfigError, match="task.env=guess with generator.backend=vllm: multi-turn episodes run on "
                                          "the native engine only"):
        check_generator(load_config(["task=guess", "generator.backend=vllm"]))


def test_the_readme_environment_runs(tmp_path, monkeypatch):
    """README's example environment (myenvs.py) as a user would load it: a tool call, then the answer."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = text.split("# myenvs.py, in the directory you run `rlalign train` from\n", 1)[1].split("```", 1)[0]
    (tmp_path / "myenvs.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    row = Example("k?", "7", fields={"table": {"a": 7}})
    d = EpisodeDriver(load_env("myenvs:Lookup", ENVS), TOK, [row], [TOK.encode(row.prompt)], [0], 0,
                      EpisodeLimits(max_turns=3, max_context_len=64))
    r = scripted(d, ["<tool>a", "7"])[0]  # (the char tokenizer has no '/' for a closing tag)
    assert TOK.decode(r.tokens) == "<tool>a77" and r.finish_reason == "done"
    assert (r.episode["tool_calls"], r.episode["tool_errors"], r.turns.count(-1)) == (1, 0, 1)


def test_bad_episode_settings_fail_before_any_actor(tmp_path):
    from rlalign.rl import train

    with pytest.raises(ValueError, match=r"task guess prompt 'g0-7:': the prompt has 5 tokens, leaving no room for a "
                                         r"turn within task.max_context_len=5"):
        train(load_config(["task=guess", "task.max_context_len=5", f"run.dir={tmp_path}"]))
    with pytest.raises(ValueError, match=r"task.max_context_len=999 exceeds the model's context of 256 tokens"):
        train(load_config(["task=guess", "task.max_context_len=999", f"run.dir={tmp_path}"]))
    with pytest.raises(ValueError, match=r"task.env='no_such_module:Env': cannot import module 'no_such_module'"):
        train(load_config(["task=guess", "task.env=no_such_module:Env", f"run.dir={tmp_path}"]))


MEET: list[threading.Barrier] = []


class Meets(GuessEnv):
    """Each call waits until 4 calls run at once (BrokenBarrierError after 1 s)."""

    def step(self, action):
        MEET[0].wait()
        return super().step(action)


@pytest.mark.parametrize("workers", [4, 2])
def test_environment_calls_run_concurrently_up_to_env_workers(workers):
    MEET[:] = [threading.Barrier(4, timeout=1.0)]
    if workers == 4:
        rs = scripted(_driver(Meets, 4, workers=4, max_turns=1), ["9"])
        assert [r.finish_reason for r in rs] == ["turns"] * 4
    else:  # twin: two at a time never meet four
        with pytest.raises(EnvError, match="raised BrokenBarrierError"):
            scripted(_driver(Meets, 4, workers=2, max_turns=1), ["9"])


RESET_GATE = threading.Event()


class ResetRaises(GuessEnv):
    def reset(self, example, seed):
        raise OSError("sandbox down")


class ResetWaits(GuessEnv):
    def reset(self, example, seed):
        RESET_GATE.wait(30)
        super().reset(example, seed)


def test_a_reset_that_raises_or_hangs_is_an_error_naming_the_episode():
    with pytest.raises(EnvError, match=r"raised OSError: sandbox down at its reset in the episode of sample 10 "
                                       r"\(step 7, prompt 'g0-7:'\) \(at .*test_agent.py:\d+ in reset\)"):
        _driver(ResetRaises)
    RESET_GATE.clear()
    try:
        with pytest.raises(EnvError, match=r"did not finish its reset within task.env_timeout_s=0.2 s in the episode "
                                           r"of sample 1[01] \(step 7, prompt 'g0-7:'\)$"):
            _driver(ResetWaits, timeout_s=0.2)
    finally:
        RESET_GATE.set()
    # twin: the same reset, answering, is within the limit
    rs = scripted(_driver(ResetWaits, timeout_s=0.2), ["3"])
    assert [r.finish_reason for r in rs] == ["done"] * 2
