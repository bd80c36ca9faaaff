"""Calling a task's reward function: off the driver's main thread, with a time limit per call.

    caller = RewardCaller(task, timeout_s=60, fallback=None, workers=4)
    values, timed_out = caller.score([RewardCall(completion, example, "sample 12 (step 3, ...)"), ...], "step 3")

A reward function may call a sandbox, a verifier or a remote service, and hang. Each call runs in
a daemon thread (at most `workers` at a time; results in call order, so the values never depend
on `workers`); a call still running after task.reward_timeout_s is left behind (a thread cannot be
killed; a daemon thread does not hold up the process's exit) and is either an error naming the
sample (RewardError, which ends the run) or, with task.reward_timeout_fallback set, that value
(reported on stderr and counted in reward/timeouts). A call that raises is a RewardError naming the
sample and the file and line of the user's code where it raised (reward_fn.user_frame). A scoring
phase that takes longer than `progress_s` reports its progress on stderr every `progress_s` seconds.

Values: a finite real number. A bool, a 0-d tensor or array (torch, numpy) is converted with
float() / .item(), which is said once per run; NaN/inf are refused, not skipped: they would reach
the advantages and then the weights.
"""

from __future__ import annotations

import numbers
import queue
import sys
import threading
import time
from dataclasses import dataclass

from rlalign.tasks import Example
from rlalign.tasks.reward_fn import user_frame
from rlalign.values import is_finite


class RewardError(RuntimeError):
    pass


@dataclass
class RewardCall:
    completion: str
    example: Example
    where: str  # names the sample in errors: "sample 12 (step 3, prompt 'a:', completion 'aaa')"


class RewardCaller:
    def __init__(self, task, timeout_s: float | None = None, fallback: float | None = None, workers: int = 1,
                 progress_s: float = 10.0, what: str = "rlalign train"):
        self.task, self.timeout_s, self.fallback = task, timeout_s, fallback
        self.workers, self.progress_s, self.what = max(1, workers), progress_s, what
        self._noted: set[str] = set()

    def score(self, calls: list[RewardCall], phase: str) -> tuple[list[float], int]:
        """The reward of every call, in call order, and how many timed out (fallback used)."""
        results: list[float | None] = [None] * len(calls)
        done: queue.Queue = queue.Queue()
        running: dict[int, float] = {}  # call index -> start (monotonic)
        todo, finished, timed_out = list(range(len(calls)))[::-1], 0, 0
        t0 = next_report = time.monotonic()
        next_report += self.progress_s
        while finished < len(calls):
            while todo and len(running) < self.workers:
                i = todo.pop()
                running[i] = time.monotonic()
                threading.Thread(target=self._call, args=(i, calls[i], done), daemon=True,
                                 name=f"rlalign-reward-{i}").start()
            deadline = next_report
            if self.timeout_s:
                deadline = min([deadline, *(start + self.timeout_s for start in running.values())])
            try:
                i, ok, value = done.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                now = time.monotonic()
                for i, started in sorted(running.items()):
                    if self.timeout_s and now - started >= self.timeout_s:
                        del running[i]  # left behind: its result, if it ever comes, is ignored
                        results[i] = self._timed_out(calls[i], now - started)
                        finished, timed_out = finished + 1, timed_out + 1
                if now >= next_report:
                    slow = min(running.items(), key=lambda kv: kv[1], default=None)
                    what = f"; the slowest running call for {now - slow[1]:.0f} s" if slow else ""
                    print(f"{self.what}: {phase} rewards: {finished} of {len(calls)} done after {now - t0:.0f} s"
                          f"{what}", file=sys.stderr, flush=True)
                    next_report = now + self.progress_s
                continue
            if i not in running:
                continue
            del running[i]
            if not ok:
                at = user_frame(value)
                raise RewardError(f"reward function raised on {calls[i].where}: {type(value).__name__}: {value}"
                                  f"{f' (at {at})' if at else ''}") from value
            results[i] = self._check(value, calls[i].where)
            finished += 1
        return results, timed_out

    def _call(self, i: int, call: RewardCall, done: queue.Queue) -> None:
        try:
            done.put((i, True, self.task.reward(call.completion, call.example)))
        except BaseException as e:  # reported by the driver's thread, naming the sample
            done.put((i, False, e))

    def _timed_out(self, call: RewardCall, seconds: float) -> float:
        if self.fallback is None:
            raise RewardError(f"reward function did not return within task.reward_timeout_s={self.timeout_s:g} s on "
                              f"{call.where} (still running after {round(seconds, 3):g} s; set "
                              f"task.reward_timeout_fallback=VALUE to score such a sample VALUE instead)")
        print(f"{self.what}: reward function did not return within task.reward_timeout_s={self.timeout_s:g} s on "
              f"{call.where}; scored task.reward_timeout_fallback={self.fallback:g}", file=sys.stderr, flush=True)
        return float(self.fallback)

    def _check(self, value, where: str) -> float:
        kind = type(value).__name__
        if isinstance(value, bool):
            self._note(kind, f"the reward function returns {kind}; rlalign uses it as 1.0 / 0.0")
            value = float(value)
        elif not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            self._note(kind, f"the reward function returns a 0-d {type(value).__module__}.{kind}; rlalign uses its "
                             f".item() as the reward")
            value = value.item()
            value = float(value) if isinstance(value, bool) else value
        if not isinstance(value, numbers.Real):
            shape = f" of shape {list(value.shape)}" if hasattr(value, "shape") else ""
            raise RewardError(f"reward function returned {value!r} ({kind}{shape}) on {where}; a reward must be a real "
                              f"number (or a bool, or a 0-d tensor/array)")
        if not is_finite(value):
            shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}...{repr(value)[-8:]}"
            raise RewardError(f"reward function returned {shown} on {where}; a reward must be finite (as a float: "
                              "within +-1.8e308)")
        return float(value)

    def _note(self, kind: str, text: str) -> None:
        if kind not in self._noted:
            self._noted.add(kind)
            print(f"{self.what}: note: {text} (said once)", file=sys.stderr, flush=True)
