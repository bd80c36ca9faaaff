"""Stopping a run on a scheduler's signal or Ctrl-C: keep the newest state, checkpointed, exit 128 + N.

Slurm (scancel, preemption, `--signal=USR1@T`) and Kubernetes (pod deletion, node drain) send
SIGTERM, then SIGKILL once a grace period ends (Slurm's KillWait and Kubernetes'
terminationGracePeriodSeconds are 30 s by default). While `rlalign train` runs, the first of
run.stop_signals or SIGINT (Ctrl-C) is a request, and the run's `plan` says at once how to meet it
(rlalign.rl): when a checkpoint (written or being written) covers every step done, or the step in
flight has not yet changed the trainer, the step is cut at once (`cut`; the checkpoint being
written is waited for, or the trainer's unchanged state written); otherwise the RL loop finishes
the step in flight and writes its checkpoint. Then Stopped: the CLI names the checkpoint and the
resume command and exits 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1, 130 for
SIGINT), the status a shell reports for a process that signal ended. When that is not done
within run.stop_grace_s seconds, or a second signal comes, the run is abandoned at once: the
newest complete checkpoint stays the newest (a half-written one is a .tmp that resume ignores).

ray.init() installs a SIGTERM handler of its own (sys.exit(15)); rlalign.cluster.connect() keeps it out
and holds a SIGTERM that comes while Ray starts for the handler the process had; StopSignals replaces
whatever is installed for the run and restores it after.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

# signals run.stop_signals may name (SIGINT stays Ctrl-C; SIGALRM times the grace period)
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


class Stopped(KeyboardInterrupt):
    """The run stopped on a stop signal; `what` says where ("after step 5 and its checkpoint",
    "during step 6 (abandoned: ...)"). A KeyboardInterrupt, so `except Exception` never swallows it."""

    def __init__(self, signum: int, what: str):
        self.signum, self.what = signum, what
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name} {what}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Abandon(KeyboardInterrupt):
    """Raised by the handlers to interrupt the driver wherever it waits (Ray re-raises it as a
    plain KeyboardInterrupt; StopSignals.abandoned says which one it was)."""


class StopSignals:
    """The run's stop-signal handlers, installed for the life of a `with` block (main thread only:
    Python delivers signals there). `requested` once a stop signal came; `cut` when the run's
    plan() stopped the step in flight at once; `abandoned` once the grace period ended or a second
    signal came. plan() runs in the handler: what stopping at once does (a line's text), or None
    to finish the step in flight first."""

    def __init__(self, names: list[str], grace_s: float, what: str = "rlalign train"):
        self.signums = [signal.Signals[n] for n in dict.fromkeys(names)]
        self.grace_s, self.what = grace_s, what
        self.signum: int | None = None
        self.abandoned = self.cut = False
        self.plan: Callable[[], str | None] | None = None
        self._old: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stopped(self, what: str) -> Stopped:
        assert self.signum is not None
        return Stopped(self.signum, what)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.signums:
                self._old[s] = signal.signal(s, self._on_signal)
            if self.signums:
                self._old[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def __exit__(self, *exc) -> None:
        self.disarm()
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def disarm(self) -> None:
        """Stop the grace timer (before the handlers go: an alarm without one ends the process)."""
        if signal.SIGALRM in self._old:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None and self.grace_s > 0:
            self.signum = signum
            now = self.plan() if self.plan is not None else None
            doing = f"stopping at once: {now}" if now else "finishing the step in flight and its checkpoint"
            print(f"{self.what}: {name} received: {doing} (up to run.stop_grace_s={self.grace_s:g} s; another "
                  f"{name} stops without waiting)", file=sys.stderr, flush=True)
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)
            if now:
                self.cut = True
                raise _Abandon(name)
            return
        if self.signum is None:
            self.signum = signum
        self.abandoned = True
        raise _Abandon(name)

    def _on_alarm(self, signum, frame) -> None:
        self.abandoned = True
        raise _Abandon("grace period over")
