"""Built-in verifiable rewards, all in [0, 1]. A reward function takes (completion, answer, prompt)
and the dataset row's other fields by name, and returns a float; a custom one is given by import
path, e.g. task.reward=mypkg.rewards:score (rlalign.tasks.reward_fn)."""

from __future__ import annotations

import json


def answer_text(answer) -> str:
    """An answer as a completion would spell it: a string as is, any other JSON value as JSON (19, [1, 2])."""
    return answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)


def exact_match(completion: str, answer, prompt: str = "") -> float:
    return 1.0 if completion.strip() == answer_text(answer).strip() else 0.0


def char_match(completion: str, answer, prompt: str = "") -> float:
    """Position-wise character matches over the longer of the two strings: 1 only for the exact
    answer (stopped in time), partial credit for each right character in place."""
    answer = answer_text(answer)
    n = max(len(completion), len(answer))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(completion, answer)) / n


def zero(completion: str, answer, prompt: str = "") -> float:
    """No reward of its own: a multi-turn task whose environment gives every reward (task=guess)."""
    return 0.0
