"""Built-in verifiable rewards, all in [0, 1]. A reward function takes (completion, answer, prompt)
and returns a float; a custom one is given by import path, e.g. task.reward=mypkg.rewards:score."""

from __future__ import annotations


def exact_match(completion: str, answer: str, prompt: str = "") -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0


def char_match(completion: str, answer: str, prompt: str = "") -> float:
    """Position-wise character matches over the longer of the two strings: 1 only for the exact
    answer (stopped in time), partial credit for each right character in place."""
    n = max(len(completion), len(answer))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(completion, answer)) / n
