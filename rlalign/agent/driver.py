"""The episode driver: the other half of a multi-turn generate (rlalign.rollout.types.Continuations).

    driver = EpisodeDriver(EnvClass, tok, examples, prompts, sample_ids, seed, limits, "step 3", pool)
    try:
        rollouts = engine.generate(prompts, sample_ids, params, episodes=driver)
        driver.finish(rollouts)      # Rollout.turns, .episode and .finish_reason
    finally:
        driver.close()               # its calls still running abandoned (an error's path)

The engine decodes every episode's assistant turn until EOS, a stop string (stopped(): the decoded
text of the turn's last tokens holds one of task.stop, or its last token is one of them) or the
per-turn limit (task.max_new_tokens, or the context's end), then hands the turn over (ended()). The
turn's text goes to its episode's environment in a worker thread (task.env_workers at a time: an
rlalign.agent.pool.EnvPool, the caller's, which lives across generate calls, or the driver's own, closed
with it), while the engine decodes the other episodes; poll() gives the engine each answer: the observation's tokens
to prefill (its text as it is, or with task.chat=true the chat template's message of
task.observation_role after the turn and the generation prompt: rlalign.tasks.tokenizer.ChatObservations),
or None: the episode is over. An episode ends with the finish reason
    done       the environment said done
    turns      task.max_turns assistant turns taken
    context    the next observation and one more token would not fit in task.max_context_len
    env_error  the environment failed and task.env_fallback_reward is its reward (counted)
An environment that raises, runs past task.env_timeout_s or answers no Step/string ends the run with
an EnvError naming the episode (sample id) and the turn, unless task.env_fallback_reward is set; an
observation the tokenizer cannot encode always does. The episode's reward is the sum of its
environment's rewards (the fallback's alone after a failure).
"""

from __future__ import annotations

import copy
import math
import queue
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rlalign.agent.env import EnvContractError, check_step, shown
from rlalign.agent.pool import Call, EnvPool
from rlalign.sequences import Rollout
from rlalign.tasks import Example
from rlalign.tasks.reward_fn import user_frame
from rlalign.tasks.tokenizer import observation_encoder

POLL_WAIT_S = 0.05  # poll(wait=True) blocks at most this long without an answer
STOP_WINDOW_SLACK = 4  # tokens decoded beyond the longest stop string's UTF-8 bytes (tokens of no text)


class EnvError(RuntimeError):
    pass


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_context_len: int  # prompt + turns + observations, tokens
    stop: tuple[str, ...] = ()
    timeout_s: float | None = None
    fallback: float | None = None
    workers: int = 1
    observation_role: str = "tool"  # with a chat template: the observation's message role


@dataclass
class Episode:
    sample_id: int
    example: Example  # the row, this episode's own copy
    env: Any
    prompt_len: int
    tokens: list[int] = field(default_factory=list)  # the turns and observations so far
    turns: list[int] = field(default_factory=list)  # per token: its assistant turn, -1: an observation's
    turn: int = 0  # assistant turns ended
    turn_ends: list[str] = field(default_factory=list)  # per turn: eos | stop | length
    last_text: str = ""  # the last assistant turn's text
    reward: float = 0.0
    finish: str = ""
    fallback: bool = False
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("tool_calls", "tool_errors", "env_errors", "env_timeouts", "observation_tokens"), 0))
    env_s: float = 0.0  # seconds in the environment's calls

    def summary(self) -> dict:
        """Rollout.episode: the episode's own numbers."""
        return {"turns": self.turn, "reward": self.reward, "fallback": self.fallback, **self.counts,
                "env_s": self.env_s, "turn_ends": list(self.turn_ends), "last_turn": self.last_text}


def episode_seed(seed: int, sample_id: int) -> int:
    """The seed an episode's environment is reset with: a function of the run's seed and the sample id
    (which names the step), so that a resumed run replays it."""
    return random.Random(f"env:{seed}:{sample_id}").getrandbits(63)


class EpisodeDriver:
    """Implements rlalign.rollout.types.Continuations for one generate call's episodes (request b:
    prompts[b])."""

    def __init__(self, env_cls: type, tok, examples: list[Example], prompts: list[list[int]],
                 sample_ids: list[int], seed: int, limits: EpisodeLimits, phase: str = "",
                 pool: EnvPool | None = None):
        self.tok, self.limits, self.phase = tok, limits, phase
        self.name = f"{env_cls.__module__}:{env_cls.__qualname__}"  # as task.env names it
        self.observe = observation_encoder(tok, limits.observation_role)
        # each episode's own copy of its row: an environment that changes the row it was reset with (a
        # stateful tool's inventory) leaves the other episodes of that row as they were
        self.episodes = [Episode(sid, copy.deepcopy(ex), None, len(p)) for sid, ex, p in zip(sample_ids, examples,
                                                                                            prompts)]
        self.own_pool = pool is None
        self.pool = EnvPool(limits.workers) if pool is None else pool
        self.calls: dict[int, Call] = {}  # episode -> its call in the pool (a reset, then each step)
        self.todo: deque[int] = deque()  # episodes whose turn waits for a worker thread
        self.running: dict[int, float] = {}  # episode -> its call's start (monotonic), in launch order
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.wait_s = 0.0  # the engine's time blocked in poll: environment time not overlapped with decoding
        try:
            self.pool.grow(min(len(self.episodes), limits.workers))  # no thread starts while the engine runs
            self._reset_all(env_cls, seed)
        except BaseException:
            self.close()
            raise
        # a token holds at least one byte of text (byte-level tokenizers split a character over several)
        self.window = max((len(s.encode()) for s in limits.stop), default=0) + STOP_WINDOW_SLACK
        self.stop_ids = stop_token_ids(tok, limits.stop)

    def _reset_all(self, env_cls: type, seed: int) -> None:
        """Every episode's environment made and reset, task.env_workers at a time in the pool's threads (as
        its steps run), each within task.env_timeout_s: one that raises or runs past it ends the run,
        naming the episode (an episode without its reset cannot begin: no fallback)."""
        done: queue.SimpleQueue = queue.SimpleQueue()

        def reset(b: int, ep: Episode) -> None:
            try:
                ep.env = env_cls()
                value = ep.env.reset(ep.example, episode_seed(seed, ep.sample_id))
                if value is not None:  # gymnasium's (observation, info): no text reaches the episode this way
                    raise EnvContractError(f"returned {value!r} from reset; reset returns None (the episode's "
                                           f"first text is the row's prompt, and observations come from step)")
                done.put((b, None))
            except BaseException as e:  # reported by the calling thread, naming the episode
                done.put((b, e))

        todo, started = deque(range(len(self.episodes))), {}
        while todo or started:
            while todo and len(started) < self.limits.workers:
                b = todo.popleft()
                started[b] = time.monotonic()
                self.calls[b] = self.pool.submit(reset, b, self.episodes[b])
            timeout = self.limits.timeout_s
            wait = None if not timeout else max(0.0, min(started.values()) + timeout - time.monotonic())
            wait = wait if wait is None else min(wait, threading.TIMEOUT_MAX)  # a limit of inf or 1e12 s waits
            try:
                b, e = done.get(timeout=wait)
            except queue.Empty:
                b = min(started, key=started.get)
                raise EnvError(f"environment {self.name} did not finish its reset within task.env_timeout_s="
                               f"{timeout:g} s in {self._where(b)}") from None
            del started[b], self.calls[b]
            if isinstance(e, EnvContractError):
                raise EnvError(f"environment {self.name} {e} in {self._where(b)}") from None
            if e is not None:
                raise EnvError(f"environment {self.name} raised {type(e).__name__}: {shown(e, str)} at its reset in "
                               f"{self._where(b)}{_at(e)}") from e

    def max_len(self, b: int) -> int:
        return self.limits.max_context_len

    def stopped(self, b: int, turn: list[int]) -> bool:
        if not self.limits.stop:
            return False
        if turn[-1] in self.stop_ids:
            return True
        text = self.tok.decode(turn[-self.window:])
        return any(s in text for s in self.limits.stop)

    def ended(self, b: int, turn: list[int], reason: str) -> None:
        ep = self.episodes[b]
        ep.tokens += turn
        ep.turns += [ep.turn] * len(turn)
        ep.turn += 1
        ep.turn_ends.append(reason)
        ep.last_text = self.tok.decode(turn)
        self.todo.append(b)
        self._launch()

    def pending(self) -> int:
        return len(self.todo) + len(self.running)

    def poll(self, wait: bool) -> list[tuple[int, list[int] | None]]:
        t0 = time.monotonic()
        out: list[tuple[int, list[int] | None]] = []
        while True:
            self._launch()
            while True:
                try:
                    self._answer(*self.results.get_nowait(), out)
                except queue.Empty:
                    break
            self._expire(out)
            now = time.monotonic()
            if out or not wait or not self.running or now - t0 >= POLL_WAIT_S:
                break
            limit = t0 + POLL_WAIT_S
            if self.limits.timeout_s:  # the oldest call's end: running holds its calls in launch order
                limit = min(limit, next(iter(self.running.values())) + self.limits.timeout_s)
            try:
                self._answer(*self.results.get(timeout=max(0.0, limit - now)), out)
            except queue.Empty:
                pass
        if wait:
            self.wait_s += time.monotonic() - t0
        return out

    def finish(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Each rollout's turns, episode numbers and finish reason (its tokens checked against the turns
        and observations the driver saw)."""
        for ep, r in zip(self.episodes, rollouts):
            if r.tokens != ep.tokens or not ep.finish:
                raise RuntimeError(f"the engine's tokens of sample {ep.sample_id} ({len(r.tokens)}) are not the "
                                   f"episode's turns and observations ({len(ep.tokens)}; finished: "
                                   f"{ep.finish or 'no'})")
            r.turns, r.episode, r.finish_reason = list(ep.turns), ep.summary(), ep.finish
        self.close()
        return rollouts

    def close(self) -> None:
        """The calls still running or queued abandoned (left to end in their threads; their answers
        ignored), and the driver's own pool closed. After finish, or when generate raises."""
        if self.own_pool:
            self.pool.close()  # first: the calls abandoned below get no replacement threads
        for b in sorted(self.calls):
            self.pool.abandon(self.calls.pop(b))

    def _launch(self) -> None:
        while self.todo and len(self.running) < self.limits.workers:
            b = self.todo.popleft()
            self.running[b] = time.monotonic()
            ep = self.episodes[b]
            self.calls[b] = self.pool.submit(self._call, b, ep.env, ep.last_text)

    def _call(self, b: int, env, action: str) -> None:
        t0 = time.monotonic()
        try:
            value, ok = env.step(action), True
        except BaseException as e:  # reported by the engine's thread, naming the episode
            value, ok = e, False
        self.results.put((b, ok, value, time.monotonic() - t0))

    def _expire(self, out: list) -> None:
        """Calls past task.env_timeout_s: left behind (a thread cannot be killed; a daemon thread does
        not hold up the process's exit), an error or the fallback."""
        timeout = self.limits.timeout_s
        if not timeout:
            return
        now, late = time.monotonic(), []
        for b, started in self.running.items():  # in launch order: the oldest first
            if now - started < timeout:
                break
            late.append(b)
        for b in sorted(late):
            self.pool.abandon(self.calls.pop(b))
            self.episodes[b].env_s += now - self.running.pop(b)
            self._failed(b, "env_timeouts", f"did not answer within task.env_timeout_s={timeout:g} s", None, out)

    def _answer(self, b: int, ok: bool, value, seconds: float, out: list) -> None:
        if b not in self.running:  # timed out already: its late answer is ignored
            return
        del self.running[b], self.calls[b]
        ep = self.episodes[b]
        ep.env_s += seconds
        if not ok:
            return self._failed(b, "env_errors", f"raised {type(value).__name__}: {shown(value, str)}", value, out)
        try:
            step = check_step(value)
        except EnvContractError as e:
            return self._failed(b, "env_errors", str(e), None, out)
        if not math.isfinite(ep.reward + float(step.reward)):
            return self._failed(b, "env_errors", f"returned the reward {step.reward!r}, which brings the episode's "
                                                 f"total from {ep.reward!r} to {ep.reward + float(step.reward)}", None,
                                out)
        ep.reward += float(step.reward)
        ep.counts["tool_calls"] += int(step.tool_calls)
        ep.counts["tool_errors"] += int(step.tool_errors)
        if step.done:
            return self._end(b, "done", out)
        if ep.turn >= self.limits.max_turns:
            return self._end(b, "turns", out)
        try:
            obs = self.observe(step.observation, ep.turn_ends[-1] == "eos", f"the observation {step.observation!r}")
        except ValueError as e:
            raise EnvError(f"environment {self.name} answered text outside the tokenizer in {self._where(b)}: "
                           f"{e}") from None
        if ep.prompt_len + len(ep.tokens) + len(obs) + 1 > self.limits.max_context_len:
            return self._end(b, "context", out)
        ep.tokens += obs
        ep.turns += [-1] * len(obs)
        ep.counts["observation_tokens"] += len(obs)
        out.append((b, obs))

    def _failed(self, b: int, count: str, what: str, exc: BaseException | None, out: list) -> None:
        ep, fallback = self.episodes[b], self.limits.fallback
        if fallback is None:
            raise EnvError(f"environment {self.name} {what} in {self._where(b)}{_at(exc)} (set "
                           f"task.env_fallback_reward=VALUE to end such an episode with that reward instead)") from exc
        print(f"rlalign: environment {self.name} {what} in {self._where(b)}{_at(exc)}; the episode ends with "
              f"task.env_fallback_reward={fallback:g}", file=sys.stderr, flush=True)
        ep.counts[count] += 1
        ep.reward, ep.fallback = float(fallback), True
        self._end(b, "env_error", out)

    def _end(self, b: int, reason: str, out: list) -> None:
        self.episodes[b].finish = reason
        out.append((b, None))

    def _where(self, b: int) -> str:
        ep = self.episodes[b]
        phase = f"{self.phase}, " if self.phase else ""
        turn = f", turn {ep.turn}" if ep.turn else ""
        return f"the episode of sample {ep.sample_id} ({phase}prompt {ep.example.prompt!r}){turn}"


def stop_token_ids(tok, stop: tuple[str, ...]) -> frozenset[int]:
    """The ids of the stop strings that are one token: a special token (a tool call's end in some chat
    formats) is no text once decoded, so the turn ends at its id. A stop string the tokenizer cannot
    encode is refused: no turn could ever end at it."""
    ids = set()
    for s in stop:
        one = tok.encode(s, f"task.stop {s!r} could never end a turn", template=False)
        if len(one) == 1:
            ids.add(one[0])
    return frozenset(ids)


def _at(exc: BaseException | None) -> str:
    at = user_frame(exc) if exc is not None else None
    return f" (at {at})" if at else ""
