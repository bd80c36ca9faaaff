"""Bad input to multi-turn episodes: a Step whose reward, done or tool counts are not what the
interface says (an error naming the episode and turn, or the counted fallback), non-finite fallback
rewards (refused in the config), and stop strings that decoding does not show whole: characters a
byte-level tokenizer splits over several tokens, a special token (the turn still ends at them). The
engine here is scripted (tests/test_agent.py)."""

from __future__ import annotations

import json
import math
import re
import time

import numpy
import pytest
from test_agent import _driver, scripted

from rlalign.agent import EnvError, EpisodeDriver, EpisodeLimits, Step
from rlalign.agent.env import load_env
from rlalign.agent.envs import ENVS, GuessEnv
from rlalign.agent.metrics import episode_metrics
from rlalign.config import ConfigError, load_config
from rlalign.tasks import Example
from rlalign.tasks.reward_fn import load_reward
from rlalign.tasks.tokenizer import CharTokenizer


def answering(**step) -> type:
    """An environment whose first answer is Step('<', **step), then done."""

    class Answers(GuessEnv):
        def step(self, action):
            self.turn += 1
            return Step("<", **step) if self.turn == 1 else Step(done=True)

    return Answers


@pytest.mark.parametrize("step, what", [
    ({"reward": "1.0"}, r"returned the reward '1.0'; a reward must be a finite real number"),
    ({"reward": math.nan}, r"returned the reward nan; a reward must be a finite real number"),
    ({"reward": 10**400}, r"returned the reward 10{400}; a reward must be a finite real number"),
    ({"done": "no"}, r"returned done='no'; done must be a bool"),
    ({"done": None}, r"returned done=None; done must be a bool"),
    ({"tool_calls": "1"}, r"returned tool_calls='1'; a count must be an int >= 0"),
    ({"tool_errors": -1}, r"returned tool_errors=-1; a count must be an int >= 0"),
])
def test_a_step_of_the_wrong_types_is_an_error_naming_the_episode_and_turn_or_the_fallback(step, what):
    with pytest.raises(EnvError, match=what + r" in the episode of sample 1[01] \(step 7, prompt 'g0-7:'\), turn 1 "
                                              r"\(set task.env_fallback_reward=VALUE"):
        scripted(_driver(answering(**step)), ["5"])
    rs = scripted(_driver(answering(**step), fallback=-1.0), ["5"])
    assert [(r.finish_reason, r.episode["env_errors"], r.episode["reward"]) for r in rs] == [("env_error", 1, -1.0)] * 2


class Huge(GuessEnv):
    """Each answer's reward is finite; their sum is not."""

    def step(self, action):
        self.turn += 1
        return Step("<", reward=1e308, done=self.turn == 2)


def test_rewards_whose_sum_is_not_finite_are_an_error_naming_the_episode_or_the_fallback():
    """Two answers of 1e308: the episode's total overflows; the error names the environment, the episode and
    turn (it was NaN advantages, then a gradient-norm error blaming the loss). The twin: one such answer ends
    the episode with that reward."""
    with pytest.raises(EnvError, match=r"returned the reward 1e\+308, which brings the episode's total from 1e\+308 "
                                       r"to inf in the episode of sample 1[01] \(step 7, prompt 'g0-7:'\), turn 2"):
        scripted(_driver(Huge), ["5", "6"])
    rs = scripted(_driver(Huge, fallback=-1.0), ["5", "6"])
    assert [(r.finish_reason, r.episode["reward"]) for r in rs] == [("env_error", -1.0)] * 2
    once = answering(reward=1e308, done=True)
    assert [r.episode["reward"] for r in scripted(_driver(once), ["5"])] == [1e308] * 2


class Unprintable(Exception):
    def __str__(self):
        raise TypeError("no str")


class RaisesUnprintable(GuessEnv):
    def step(self, action):
        raise Unprintable()


class RaisesLines(GuessEnv):
    def step(self, action):
        raise ValueError("first line\nsecond line")


def test_an_environment_error_whose_text_cannot_be_made_is_still_one_line():
    """An exception whose str() raises, and one of several lines: the error says what it is, on one line (the
    first was a TypeError from the error's own f-string). The twin: with the fallback the episode ends."""
    with pytest.raises(EnvError, match=r"raised Unprintable: <a Unprintable whose str\(\) raised TypeError> in the "
                                       r"episode of sample"):
        scripted(_driver(RaisesUnprintable), ["5"])
    with pytest.raises(EnvError, match=r"raised ValueError: first line \| second line in the episode") as e:
        scripted(_driver(RaisesLines), ["5"])
    assert "\n" not in str(e.value).split(" (set task.env_fallback_reward")[0]
    rs = scripted(_driver(RaisesUnprintable, fallback=0.0), ["5"])
    assert [r.finish_reason for r in rs] == ["env_error"] * 2


def test_numpy_scalars_are_a_steps_numbers_and_its_counts_reach_the_metrics_as_ints():
    """The twin: numpy's bool, int and float are a bool, counts and a reward; the metrics stay JSON."""
    env = answering(reward=numpy.float32(0.5), done=numpy.bool_(False), tool_calls=numpy.int64(2),
                    tool_errors=numpy.int64(1))
    rs = scripted(_driver(env), ["5", "6"])
    assert [(r.finish_reason, r.episode["turns"], r.episode["reward"]) for r in rs] == [("done", 2, 0.5)] * 2
    m = episode_metrics(rs)
    assert (m["episode/tool_calls"], m["episode/tool_errors"]) == (4, 2) and type(m["episode/tool_calls"]) is int
    json.dumps(m)


@pytest.mark.parametrize("key", ["task.env_fallback_reward", "task.reward_timeout_fallback"])
def test_a_non_finite_fallback_reward_is_refused_naming_the_key(key):
    for bad in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match=rf"invalid config: {key}=-?(nan|inf): must be finite \(or null"):
            load_config(["task=guess", f"{key}={bad}"])
    assert load_config(["task=guess", f"{key}=-1.5"]).task[key.split(".")[1]] == -1.5  # twin: finite is kept


class ByteTokenizer:
    """UTF-8 bytes as token ids: a character outside ASCII is two to four tokens."""

    chat = False

    def encode(self, text: str, where: str = "", template: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


@pytest.mark.parametrize("stop", ["结束了", "→→→→", "</tool>"])
def test_a_stop_string_split_over_byte_tokens_ends_the_turn(stop):
    tok = ByteTokenizer()
    d = EpisodeDriver(GuessEnv, tok, [Example("p", "3")], [tok.encode("p")], [0], 0,
                      EpisodeLimits(max_turns=2, max_context_len=64, stop=(stop,)))
    turn = tok.encode("ab 1+2" + stop)
    assert d.stopped(0, turn)
    # twins: the stop string one byte short, or broken by another character, does not end the turn
    assert not d.stopped(0, turn[:-1])
    assert not d.stopped(0, tok.encode("ab 1+2" + stop[:-1] + " " + stop[-1]))


def test_a_stop_string_that_is_one_special_token_ends_the_turn(tmp_path):
    """Decoding drops a special token (GLM's '<|observation|>' ends a tool call), so the turn ends at its id;
    the twin: the same tokenizer without that stop string runs on past it."""
    from test_tasks_user import write_tokenizer

    from rlalign.tasks.tokenizer import HFTokenizer

    specials = ["<pad>", "<unk>", "<eos>", "<|observation|>"]
    tok = HFTokenizer(write_tokenizer(tmp_path, None, specials, "ab()1 ", "<eos>"))
    turn = tok.encode("ab(1)<|observation|>", template=False)
    assert tok.decode(turn) == "ab(1)"  # no text left to match

    def driver(stop: tuple[str, ...]) -> EpisodeDriver:
        return EpisodeDriver(GuessEnv, tok, [Example("a", "1")], [tok.encode("a")], [0], 0,
                             EpisodeLimits(max_turns=2, max_context_len=64, stop=stop))

    assert driver(("<|observation|>",)).stopped(0, turn) and not driver(("<|observation|>",)).stopped(0, turn[:-1])
    assert not driver((")1",)).stopped(0, turn)
    assert driver((")",)).stopped(0, turn[:-1])  # a text stop string as before


@pytest.mark.parametrize("setting, shown", [("task.stop=[')']", "task.stop=[')']"),
                                            ("task.max_context_len=64", "task.max_context_len=64"),
                                            ("task.env_fallback_reward=0", "task.env_fallback_reward=0.0")])
def test_an_episode_setting_without_task_env_is_refused_naming_the_key(setting, shown):
    key = shown.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(shown)}: a multi-turn setting, which does nothing while "
                                          rf"task.env is null: set task.env, or {key}=(\[\]|null)"):
        load_config(["task=add", setting])
    assert load_config(["task=guess", setting]).task.env == "guess"  # twin: with an environment it is kept


def test_a_calc_call_nested_too_deeply_is_the_tools_error_not_an_environment_failure():
    from rlalign.agent.envs import CalcEnv

    for expr in ("-" * 2000 + "1", "1" + "*1" * 20000):
        assert CalcEnv().step(f"calc({expr})") == Step("err", tool_calls=1, tool_errors=1)
    assert CalcEnv().step(f"calc({'-' * 100}7)") == Step("7", tool_calls=1)  # twin: nested within the limits


@pytest.mark.parametrize("guess, hint", [("²", "?"), ("٣", "?"), ("5", "<")])
def test_guess_answers_a_digit_outside_0_to_9_with_a_question_mark(guess, hint):
    """A tokenizer beyond the char one can write a character str.isdigit takes that int() refuses or reads;
    the twin: an ASCII digit gets its hint."""
    env = GuessEnv()
    env.reset(Example("g0-7:", "3"), 0)
    assert env.step(guess).observation == hint


class SlowReset(GuessEnv):
    def reset(self, example, seed):
        time.sleep(0.05)
        super().reset(example, seed)


@pytest.mark.parametrize("timeout_s", [math.inf, 1e12, 5.0])
def test_a_timeout_beyond_what_a_thread_wait_takes_is_no_limit(timeout_s):
    """Resets that take a while under task.env_timeout_s=inf or 1e12 (past threading.TIMEOUT_MAX) run as
    under any other limit."""
    rs = scripted(_driver(SlowReset, timeout_s=timeout_s), ["3"])
    assert [r.finish_reason for r in rs] == ["done"] * 2


class ResetAnswers(GuessEnv):
    def reset(self, example, seed):
        super().reset(example, seed)
        return "g?", {}  # gymnasium's (observation, info)


def test_a_reset_that_returns_a_value_is_an_error_naming_the_episode():
    """An initial observation from reset would reach no episode: refused, not dropped; the twin: the same
    reset returning None (GuessEnv's) runs."""
    with pytest.raises(EnvError, match=r"Answers returned \('g\?', \{\}\) from reset; reset returns None \(the "
                                       r"episode's first text is the row's prompt, .*\) in the episode of sample 1[01] "
                                       r"\(step 7, prompt 'g0-7:'\)$"):
        _driver(ResetAnswers)
    assert [r.finish_reason for r in scripted(_driver(GuessEnv), ["3"])] == ["done"] * 2


def test_a_stop_string_the_tokenizer_cannot_encode_is_refused_before_any_actor(tmp_path):
    """The char tokenizer has no '/': '</tool>' could never end a turn; the twin: '<tool>' does."""
    from rlalign.rl import train

    what = r"task.stop '</tool>' could never end a turn: characters \['/'\] are not in the char tokenizer's alphabet"
    with pytest.raises(ValueError, match=what):
        train(load_config(["task=guess", "task.stop=['</tool>']", f"run.dir={tmp_path}"]))
    with pytest.raises(ValueError, match=what):
        _driver(GuessEnv, stop=("</tool>",))
    tok = CharTokenizer()
    assert _driver(GuessEnv, stop=("<tool>",)).stopped(0, tok.encode("ab<tool>"))


def test_an_environment_and_a_reward_load_from_a_file_as_a_loss_does(tmp_path, monkeypatch):
    """task.env and task.reward take '/path/to/file.py:NAME' (as algorithm.loss does), the module registered
    while it runs (a dataclass with postponed annotations needs that); the twins: a missing file or class."""
    path = tmp_path / "file_envs.py"
    path.write_text("from __future__ import annotations\n"
                    "from dataclasses import dataclass\n"
                    "from rlalign.agent import Step\n\n"
                    "@dataclass\n"
                    "class Echo:\n"
                    "    answer: str = ''\n\n"
                    "    def reset(self, example, seed):\n"
                    "        self.answer = example.answer\n\n"
                    "    def step(self, action):\n"
                    "        return Step(reward=float(action == self.answer), done=True)\n\n"
                    "def score(completion, answer, prompt):\n"
                    "    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    for spec in (f"{path}:Echo", "file_envs.py:Echo"):
        d = EpisodeDriver(load_env(spec, ENVS), CharTokenizer(), [Example("g0-7:", "3")], [[2]], [0], 0,
                          EpisodeLimits(max_turns=2, max_context_len=64))
        assert d.name == f"{path}:Echo"
        assert [(r.finish_reason, r.episode["reward"]) for r in scripted(d, ["3"])] == [("done", 1.0)]
    assert load_reward(f"{path}:score")("3", Example("p", "3")) == 0.5
    with pytest.raises(ValueError, match=rf"task.env='{tmp_path}/nope.py:Echo': cannot import module "
                                         rf"'{tmp_path}/nope.py': FileNotFoundError: no such file: {tmp_path}/nope.py"):
        load_env(f"{tmp_path}/nope.py:Echo", ENVS)
    with pytest.raises(ValueError, match=r"has no class 'Nope' with reset\(example, seed\) and step\(action\)"):
        load_env(f"{path}:Nope", ENVS)


class Inventory(GuessEnv):
    """A stateful tool: each episode takes an item from the inventory its row was reset with."""

    def reset(self, example, seed):
        self.items = example.fields["items"]

    def step(self, action):
        return Step(reward=float(bool(self.items) and self.items.pop() is not None), done=True)


class SharedInventory(Inventory):
    """The twin: an inventory every episode shares (a class attribute, outside the row)."""

    SHARED: list[str] = []

    def reset(self, example, seed):
        self.items = self.SHARED


def test_each_episode_resets_on_its_own_copy_of_its_row():
    """Four episodes of one row each take the row's one item (whatever order their threads run in) and the
    row stays whole; the twin: an inventory they share gives the item to one episode only."""
    row = Example("g0-7:", "3", fields={"items": ["key"]})
    for env, rewards in ((Inventory, [1.0] * 4), (SharedInventory, [0.0, 0.0, 0.0, 1.0])):
        SharedInventory.SHARED[:] = ["key"]
        d = EpisodeDriver(env, CharTokenizer(), [row] * 4, [[2]] * 4, [0, 1, 2, 3], 0,
                          EpisodeLimits(max_turns=2, max_context_len=64, workers=4))
        assert sorted(r.episode["reward"] for r in scripted(d, ["5"])) == rewards
    assert row.fields == {"items": ["key"]}


def test_an_environment_whose_init_needs_arguments_is_refused_before_any_actor(tmp_path):
    """Each episode's environment is made as Class(): one that needs arguments is refused as task.env loads;
    the twin: the same class with a default loads."""
    from rlalign.rl import train

    path = tmp_path / "needs_args.py"
    path.write_text("from rlalign.agent import Env, Step\n\n"
                    "class Remote(Env):\n"
                    "    def __init__(self, url):\n"
                    "        self.url = url\n\n"
                    "    def step(self, action):\n"
                    "        return Step(done=True)\n\n"
                    "class WithDefault(Remote):\n"
                    "    def __init__(self, url='http://sandbox'):\n"
                    "        self.url = url\n")
    with pytest.raises(ValueError, match=re.escape(f"task.env='{path}:Remote': Remote(url) needs arguments, but each "
                                                   "episode's environment is made with none (Remote()); give them "
                                                   "defaults, or read them from the task row in reset(example, seed)")):
        train(load_config(["task=guess", f"task.env={path}:Remote", f"run.dir={tmp_path}/run"]))
    assert load_env(f"{path}:WithDefault", ENVS).__name__ == "WithDefault"


def test_an_environment_without_its_own_step_or_with_other_parameters_is_refused_as_it_loads(tmp_path):
    """A subclass of Env that never defines step (a typo: stepp), and a step() or reset() that cannot take
    (action) / (example, seed), are refused naming the class, method, file and line, before any actor (they
    failed at the first episode: a blank NotImplementedError, a bare TypeError). The twin: defaults, *args and
    a staticmethod that take the arguments load."""
    path = tmp_path / "shapes.py"
    path.write_text("from rlalign.agent import Env, Step\n\n"
                    "class NoStep(Env):\n    def stepp(self, action):\n        return Step(done=True)\n\n"
                    "class StepNoArg(Env):\n    def step(self):\n        return Step(done=True)\n\n"
                    "class ResetNoArg(Env):\n    def reset(self):\n        pass\n\n"
                    "    def step(self, action):\n        return Step(done=True)\n\n"
                    "class Loose(Env):\n    def reset(self, example, seed=0, *more):\n        pass\n\n"
                    "    @staticmethod\n    def step(*args):\n        return Step(done=True)\n")
    with pytest.raises(ValueError, match=r"NoStep has no step\(action\) of its own"):
        load_env(f"{path}:NoStep", ENVS)
    with pytest.raises(ValueError, match=rf"StepNoArg.step\(self\) \({path}:8\) cannot be called as step\(action\)"):
        load_env(f"{path}:StepNoArg", ENVS)
    with pytest.raises(ValueError, match=rf"ResetNoArg.reset\(self\) \({path}:12\) cannot be called as "
                                         r"reset\(example, seed\)"):
        load_env(f"{path}:ResetNoArg", ENVS)
    assert load_env(f"{path}:Loose", ENVS).__name__ == "Loose"


@pytest.mark.parametrize("method", ["reset", "step"])
def test_an_async_environment_is_refused_as_it_loads_naming_the_method(tmp_path, method):
    """reset and step run as plain calls in worker threads: an `async def` one (a coroutine no one awaits) is
    refused naming it; the twin: the same class with plain methods loads."""
    body = {"reset": "    {}def reset(self, example, seed):\n        pass\n\n",
            "step": "    {}def step(self, action):\n        return Step(done=True)\n\n"}
    other = "step" if method == "reset" else "reset"
    for prefix in ("async ", ""):
        path = tmp_path / f"envs_{prefix.strip() or 'plain'}_{method}.py"
        path.write_text("from rlalign.agent import Step\n\nclass Remote:\n" + body[method].format(prefix)
                        + body[other].format(""))
        if prefix:
            with pytest.raises(ValueError, match=rf"task.env='.*:Remote': Remote.{method} is a coroutine function "
                                                 rf"\(async def\); reset and step are called as plain functions"):
                load_env(f"{path}:Remote", ENVS)
        else:
            assert load_env(f"{path}:Remote", ENVS).__name__ == "Remote"
