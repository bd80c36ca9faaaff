"""The environment interface of multi-turn episodes: text in, text out (gymnasium's reset/step,
OpenEnv's StepResult, a verifiers environment's reply).

    class MyEnv(Env):
        def reset(self, example, seed):          # a task row (rlalign.tasks.Example) and the episode's seed
            self.answer = example.answer
        def step(self, action):                  # the assistant turn's text (EOS not included)
            return Step("hint", reward=0.0, done=False)

One instance per episode, made with no arguments, reset once (with the episode's own copy of the row),
then stepped once per assistant turn, each call from a worker thread (task.env_workers at a time, each
call within task.env_timeout_s). The episode's first text is the row's prompt; an observation is
appended to the episode as it is (tokenized by the run's tokenizer) and the next assistant turn follows
it. An environment is a deterministic function of (the row, the seed, the actions): a resumed run
replays it.

`task.env` names a built-in environment (rlalign.agent.envs.ENVS) or a user's class
'pkg.module:Class', imported from the installed packages, else from the current directory, or
'/path/to/file.py:Class'.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass

import numpy

from rlalign.tasks import Example
from rlalign.tasks.reward_fn import import_user_module
from rlalign.values import is_finite


@dataclass
class Step:
    """What an environment answers to one assistant turn."""

    observation: str = ""  # text appended after the turn (ignored when done)
    reward: float = 0.0  # summed over the episode's turns
    done: bool = False  # the episode is over
    tool_calls: int = 0  # tools this turn called (counted in episode/tool_calls)
    tool_errors: int = 0  # of them, failed (a tool's error is an observation, not an environment failure)


class Env:
    """The interface (module docstring); a user's class may subclass it or just have the two methods."""

    def reset(self, example: Example, seed: int) -> None:
        """Start an episode on the task row `example`; `seed` seeds any randomness of the episode."""

    def step(self, action: str) -> Step:
        """The environment's answer to one assistant turn."""
        raise NotImplementedError


class EnvContractError(ValueError):
    """An environment answered something that is not a Step (the caller names the episode and turn)."""


def check_step(value) -> Step:
    """A Step from what `step` returned: a Step, or a (observation, reward, done) tuple."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Step(*value)
    if not isinstance(value, Step):
        raise EnvContractError(f"returned {shown(value)} ({type(value).__name__}); expected rlalign.agent.Step or a "
                               f"(observation, reward, done) tuple")
    if not isinstance(value.observation, str):
        raise EnvContractError(f"returned the observation {shown(value.observation)} "
                               f"({type(value.observation).__name__}); an observation must be a string")
    if isinstance(value.reward, bool) or not isinstance(value.reward, numbers.Real) or not is_finite(value.reward):
        raise EnvContractError(f"returned the reward {shown(value.reward)}; a reward must be a finite real number")
    if not isinstance(value.done, (numbers.Integral, numpy.bool_)) or value.done not in (0, 1):
        raise EnvContractError(f"returned done={shown(value.done)}; done must be a bool")
    for key in ("tool_calls", "tool_errors"):
        n = getattr(value, key)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise EnvContractError(f"returned {key}={shown(n)}; a count must be an int >= 0")
    return value


def shown(x, fn=repr) -> str:
    """A user's object as one line of an error: fn(x) (repr, or str for an exception's message) with its lines
    joined, or what it is when fn(x) itself raises."""
    try:
        text = fn(x)
    except Exception as e:  # noqa: BLE001 - the user's __str__ / __repr__; the error must still be said
        return f"<a {type(x).__name__} whose {fn.__name__}() raised {type(e).__name__}>"
    return " | ".join(ln for ln in str(text).splitlines() if ln.strip()) if "\n" in str(text) else str(text)


def load_env(spec: str, builtin: dict[str, type]) -> type:
    """task.env: a built-in environment's name, or 'pkg.module:Class' (imported from the current
    directory when no installed package has it) or '/path/to/file.py:Class'."""
    if ":" not in spec:
        if spec not in builtin:
            raise ValueError(f"task.env={spec!r}: no such built-in environment; built in: {', '.join(sorted(builtin))} "
                             f"(or 'pkg.module:Class' for your own)")
        return builtin[spec]
    mod_name, _, cls_name = spec.rpartition(":")
    mod = import_user_module(f"task.env={spec!r}", mod_name)
    cls = getattr(mod, cls_name, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)) or not callable(getattr(cls, "reset",
                                                                                                     None)):
        raise ValueError(f"task.env={spec!r}: module {mod_name!r} ({getattr(mod, '__file__', '?')}) has no class "
                         f"{cls_name!r} with reset(example, seed) and step(action) methods")
    check_no_arguments(spec, cls)
    if cls.step is Env.step:
        raise ValueError(f"task.env={spec!r}: {cls.__qualname__} has no step(action) of its own (Env.step only "
                         "raises NotImplementedError)")
    for name, params in (("reset", "(example, seed)"), ("step", "(action)")):
        check_method(spec, cls, name, params)
        if inspect.iscoroutinefunction(getattr(cls, name)):
            raise ValueError(f"task.env={spec!r}: {cls.__qualname__}.{name} is a coroutine function (async def); "
                             f"reset and step are called as plain functions in worker threads (task.env_workers): "
                             f"define them with def (an async client can be run inside with asyncio.run)")
    return cls


def check_method(spec: str, cls: type, name: str, params: str) -> None:
    """An instance's `name` can be called with the arguments `params` names (reset(example, seed), step(action)),
    or the class is refused now, before any actor starts, rather than at the first episode."""
    try:
        signature = inspect.signature(getattr(cls, name))
    except (TypeError, ValueError):  # built in C, without a signature: its call tells
        return
    args = [None] * (params.count(",") + 2)  # self, then the arguments
    if isinstance(inspect.getattr_static(cls, name), staticmethod | classmethod):
        args = args[1:]
    try:
        signature.bind(*args)
    except TypeError:
        at = getattr(getattr(cls, name), "__code__", None)
        where = f" ({at.co_filename}:{at.co_firstlineno})" if at else ""
        raise ValueError(f"task.env={spec!r}: {cls.__qualname__}.{name}{signature}{where} cannot be called as "
                         f"{name}{params}") from None


def check_no_arguments(spec: str, cls: type) -> None:
    """Each episode's environment is made as cls(): a class whose __init__ needs arguments is refused now,
    before any actor starts, rather than at the first episode's reset."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a class built in C, without a signature: made as cls() all the same
        return
    try:
        signature.bind()
    except TypeError:
        raise ValueError(f"task.env={spec!r}: {cls.__qualname__}{signature} needs arguments, but each episode's "
                         f"environment is made with none ({cls.__qualname__}()); give them defaults, or read them "
                         f"from the task row in reset(example, seed) (example.fields)") from None
