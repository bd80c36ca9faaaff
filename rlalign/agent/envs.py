"""The built-in environments (task.env=NAME; their rows: rlalign.tasks' guess and calc tasks).

  guess  a secret digit; each turn the model guesses one, the environment answers '<' (the secret
         is lower), '>' (higher) or '?' (not a digit). Rewards: 1 - 0.2 (t - 1) (at least 0.2) for
         finding it at turn t, and 0.1 for each wrong guess that the hints so far allowed (the game's
         skill: using the replies). Learnable by the tiny char-level model (configs/task/guess.yaml).
  calc   arithmetic with a calculator tool: a turn holding calc(EXPR) (or <calc>EXPR</calc>) gets the
         value of EXPR (+, -, * on integers) as the observation, or 'err'; a turn without a call is
         the final answer, scored by the task's reward (exact_match).
"""

from __future__ import annotations

import ast
import operator
import re

from rlalign.agent.env import Env, Step

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_CALL = re.compile(r"calc\(([^()]*)\)|<calc>(.*?)</calc>", re.S)
MAX_VALUE = 10**12  # a calculator's numbers stay this small (no runaway products)


class GuessEnv(Env):
    def reset(self, example, seed):
        self.secret, self.turn, self.lo, self.hi = int(example.answer), 0, 0, 9

    def step(self, action: str) -> Step:
        self.turn += 1
        guess = action.strip()
        if len(guess) != 1 or guess not in "0123456789":  # str.isdigit also takes '²' and '٣
            return Step("?")
        g = int(guess)
        if g == self.secret:
            return Step(reward=max(0.2, 1.0 - 0.2 * (self.turn - 1)), done=True)
        kept = self.lo <= g <= self.hi  # a guess the hints so far allow
        if self.secret < g:
            self.hi = min(self.hi, g - 1)
        else:
            self.lo = max(self.lo, g + 1)
        return Step("<" if self.secret < g else ">", reward=0.1 if kept else 0.0)


def evaluate(expr: str) -> int:
    """An integer expression of +, -, * and parentheses (ValueError for anything else)."""
    def ev(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            value = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            value = -ev(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.left), ev(node.right))
        else:
            raise ValueError(f"not an integer expression of +, -, *: {expr!r}")
        if abs(value) > MAX_VALUE:
            raise ValueError(f"{expr!r}: a value beyond {MAX_VALUE}")
        return value

    try:
        return ev(ast.parse(expr.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"not an integer expression: {expr!r}") from None
    except RecursionError:  # a model's tool call nested beyond Python's parser or this evaluator
        raise ValueError(f"an expression nested too deeply: {expr[:40]!r}...") from None


class CalcEnv(Env):
    def reset(self, example, seed):
        pass

    def step(self, action: str) -> Step:
        call = _CALL.search(action)
        if call is None:
            return Step(done=True)  # the final answer: the task's reward scores it
        try:
            return Step(str(evaluate(call[1] if call[1] is not None else call[2])), tool_calls=1)
        except ValueError:
            return Step("err", tool_calls=1, tool_errors=1)


ENVS: dict[str, type] = {"guess": GuessEnv, "calc": CalcEnv}
