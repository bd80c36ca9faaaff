"""Tasks with verifiable rewards: built-in generators and JSONL prompt/answer datasets.

A task yields, for training step s, `num_prompts` examples that are a pure function of
(seed, s): the data position is the step, so a resumed run sees the same prompts.

Built-in:
  repeat   "c:" -> "cccc"      (a letter repeated `length` times; learnable from scratch in minutes)
  reverse  "abc>" -> "cba"
  add      "12+7=" -> "19"
  jsonl    lines {"prompt": "...", "answer": ANY, ...fields} from task.path, reward by import path
           (rlalign.tasks.reward_fn: the row's extra fields reach the reward by name)
Multi-turn (the rows of rlalign.agent's built-in environments, task.env):
  guess    "g0-7:" -> a secret digit in 0..7, found by guessing with the environment's hints
  calc     "13*7+5=" -> "96", with a calculator the model may call: calc(13*7)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlalign.tasks import rewards
from rlalign.tasks.reward_fn import Reward, load_reward
from rlalign.tasks.rewards import answer_text
from rlalign.values import is_int


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: Any  # any JSON value, passed to the reward unchanged
    source: str = field(default="", compare=False)  # "FILE:LINE" for dataset examples
    fields: dict[str, Any] = field(default_factory=dict)  # a dataset row's other fields, for the reward

    def answer_text(self) -> str:
        """The answer as a completion would spell it: a string as is, any other value as JSON."""
        return answer_text(self.answer)


def check_kwargs(**values) -> None:
    """Refuses a task option outside its range, naming its key: name=(value, ok(value), what it must be)."""
    for key, (value, ok, what) in values.items():
        if not ok(value):
            raise ValueError(f"task.kwargs.{key}={value!r}: must be {what}")


def _count(least: int):
    return lambda v: is_int(v) and v >= least


def _letters(v) -> bool:
    return isinstance(v, str) and len(v) > 0


class Task:
    name = "task"
    default_reward = "char_match"

    def __init__(self, seed: int, reward: str | None = None):
        self.seed = seed
        self.reward_fn: Reward = load_reward(reward or self.default_reward)

    def examples(self, step: int, n: int) -> list[Example]:
        rng = random.Random(f"{self.name}:{self.seed}:{step}")
        return [self.make(rng) for _ in range(n)]

    def make(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def all_examples(self) -> list[Example]:
        """Every example a dataset holds (checked before a run starts); [] for generated tasks."""
        return []

    def reward(self, completion: str, ex: Example):
        """The reward function's value as returned (the caller checks it is a finite number)."""
        return self.reward_fn(completion, ex)


class Repeat(Task):
    name = "repeat"

    def __init__(self, seed, reward=None, letters: str = "abcdefgh", length: int = 4):
        check_kwargs(letters=(letters, _letters, "a non-empty string"), length=(length, _count(1), "an integer >= 1"))
        super().__init__(seed, reward)
        self.letters, self.length = letters, length

    def make(self, rng):
        c = rng.choice(self.letters)
        return Example(f"{c}:", c * self.length)


class Reverse(Task):
    name = "reverse"

    def __init__(self, seed, reward=None, letters: str = "abcdefgh", min_len: int = 2, max_len: int = 4):
        check_kwargs(letters=(letters, _letters, "a non-empty string"), min_len=(min_len, _count(1), "an integer >= 1"),
                     max_len=(max_len, _count(min_len), f"an integer >= min_len={min_len}"))  # in this order
        super().__init__(seed, reward)
        self.letters, self.min_len, self.max_len = letters, min_len, max_len

    def make(self, rng):
        s = "".join(rng.choice(self.letters) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Example(f"{s}>", s[::-1])


class Add(Task):
    name = "add"
    default_reward = "exact_match"

    def __init__(self, seed, reward=None, max_operand: int = 20):
        check_kwargs(max_operand=(max_operand, _count(0), "an integer >= 0"))
        super().__init__(seed, reward)
        self.max_operand = max_operand

    def make(self, rng):
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Example(f"{a}+{b}=", str(a + b))


class Guess(Task):
    """A secret digit in [0, size): the rows of the guess environment (rlalign.agent.envs.GuessEnv)."""

    name = "guess"
    default_reward = "zero"  # the environment's rewards alone

    def __init__(self, seed, reward=None, size: int = 8):
        check_kwargs(size=(size, lambda v: _count(2)(v) and v <= 10, "an integer in [2, 10] (the secret is one digit)"))
        super().__init__(seed, reward)
        self.size = size

    def make(self, rng):
        return Example(f"g0-{self.size - 1}:", str(rng.randrange(self.size)))


class Calc(Add):
    """'a*b+c=' -> the value: the rows of the calc environment (rlalign.agent.envs.CalcEnv)."""

    name = "calc"

    def make(self, rng):
        a, b, c = (rng.randint(0, self.max_operand) for _ in range(3))
        return Example(f"{a}*{b}+{c}=", str(a * b + c))


class JsonlTask(Task):
    name = "jsonl"
    default_reward = "exact_match"

    def __init__(self, seed, reward=None, path: str | None = None):
        super().__init__(seed, reward)
        if not path:
            raise ValueError("task.name=jsonl needs task.path (a JSONL file of {\"prompt\", \"answer\"} lines)")
        self.path = Path(path)
        self.data = read_jsonl(self.path)
        self.reward_fn.check_rows(self.data)

    def all_examples(self):
        return self.data

    def examples(self, step, n):
        # epoch-wise seeded permutations; the data position is step * n
        out, pos = [], step * n
        size = len(self.data)
        while len(out) < n:
            epoch, i = divmod(pos, size)
            perm = list(range(size))
            random.Random(f"jsonl:{self.seed}:{epoch}").shuffle(perm)
            out.append(self.data[perm[i]])
            pos += 1
        return out


def read_jsonl(path: Path) -> list[Example]:
    if not path.is_file():
        raise FileNotFoundError(f"task.path={str(path)!r}: dataset file does not exist")
    out = []
    with path.open("rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if no == 1 else "utf-8")  # a byte-order mark is no content
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{no}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{no}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or "answer" not in obj:
                raise ValueError(f"{path}:{no}: expected an object with a string field 'prompt' and a field 'answer' "
                                 f"(any JSON value; other fields reach the reward by name)")
            if not obj["prompt"]:
                raise ValueError(f"{path}:{no}: empty prompt")
            prompt, answer = obj.pop("prompt"), obj.pop("answer")
            out.append(Example(prompt, answer, source=f"{path}:{no}", fields=obj))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


TASKS = {t.name: t for t in (Repeat, Reverse, Add, Guess, Calc, JsonlTask)}


def make_task(name: str, seed: int, reward: str | None = None, path: str | None = None, **kwargs) -> Task:
    if name not in TASKS:
        raise ValueError(f"task.name={name!r}: unknown task; built-in: {sorted(TASKS)}")
    cls = TASKS[name]
    if path and cls is not JsonlTask:
        raise ValueError(f"task.path={path!r}: only task=jsonl reads a file; this run's task is {name!r} "
                         "(choose the dataset with task=jsonl task.path=...)")
    try:
        return cls(seed, reward, path=path, **kwargs) if cls is JsonlTask else cls(seed, reward, **kwargs)
    except TypeError as e:
        raise ValueError(f"task.kwargs={kwargs} for task {name!r}: {str(e).split('__init__() ')[-1]} (a task's "
                         f"kwargs come with its option: choose it with task={name}, not task.name={name}, which "
                         "keeps the previous task's kwargs)") from None


__all__ = ["Example", "Reward", "Task", "make_task", "load_reward", "read_jsonl", "rewards"]
