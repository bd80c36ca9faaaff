"""The environment's worker threads: long-lived daemon threads that run the episode driver's calls
(resets and steps), at most `size` at once, started as calls arrive and reused from call to call.

    pool = EnvPool(4)
    pool.grow(n)                     # min(n, 4) threads ready before a burst of n calls
    call = pool.submit(fn, *args)    # fn(*args) in a worker thread; fn reports its own result and errors
    pool.abandon(call)               # past its timeout: its thread is no longer one of the pool's
    pool.close()                     # every thread ends once its call (if any) returns

A call that hangs cannot be stopped (a thread cannot be killed): abandon() leaves its thread behind,
to end when the call returns, and starts another in its place, so that the pool keeps `size` usable
threads.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_NAMES = itertools.count()  # pools' numbers, for their threads' names


@dataclass(eq=False)
class Call:
    fn: Callable[..., None]
    args: tuple[Any, ...]
    thread: threading.Thread | None = field(default=None, repr=False)  # the thread running it
    done: bool = False
    dropped: bool = False  # abandoned: its answer is nobody's (not run at all if no thread took it yet)


class EnvPool:
    """At most `size` daemon threads, pulling calls from one queue; a thread starts when a call finds
    every thread busy, or ahead of calls to come (grow). Thread.start waits for the new thread to run,
    which takes long while other threads hold the GIL: grow() starts them before the engine runs."""

    def __init__(self, size: int, name: str = "rlalign-env"):
        if size < 1:
            raise ValueError(f"EnvPool: size={size}; need at least one thread")
        self.size, self.name = size, f"{name}-{next(_NAMES)}"
        self.calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []  # the pool's own (not abandoned) threads
        self.idle = 0  # threads free for a call that no queued call has claimed
        self.started = 0  # threads started over the pool's life
        self.closed = False

    def submit(self, fn: Callable[..., None], *args) -> Call:
        """fn(*args) in a free thread, or a new one while fewer than `size` are the pool's, else when
        one is free."""
        call = Call(fn, args)
        with self.lock:
            if self.closed:
                raise RuntimeError(f"{self.name}: submit after close")
            if self.idle:
                self.idle -= 1
                thread = None
            else:
                thread = self._new_thread() if len(self.threads) < self.size else None
        self.calls.put(call)
        if thread is not None:
            thread.start()
        return call

    def grow(self, n: int) -> None:
        """At least min(n, size) threads: those missing started now, idle."""
        with self.lock:
            new = [self._new_thread() for _ in range(min(n, self.size) - len(self.threads))]
            self.idle += len(new)
        for thread in new:
            thread.start()

    def _new_thread(self) -> threading.Thread:
        """A thread counted as the pool's (under the lock), started by the caller."""
        thread = threading.Thread(target=self._work, daemon=True, name=f"{self.name}-{self.started}")
        self.threads.append(thread)
        self.started += 1
        return thread

    def abandon(self, call: Call) -> None:
        """The call's answer is no longer wanted: not run if it has not begun; if it runs, its thread
        stops being one of the pool's (it ends when the call returns) and a new one takes its place."""
        with self.lock:
            if call.done or call.dropped:
                return
            call.dropped = True
            if call.thread is None or call.thread not in self.threads:  # not begun, or the pool closed
                return
            self.threads.remove(call.thread)
            thread = self._new_thread()
            self.idle += 1
        thread.start()

    def close(self) -> None:
        """Each thread of the pool ends: at once if idle, else when its call returns (calls queued and
        not begun are not run)."""
        with self.lock:
            if self.closed:
                return
            self.closed, n = True, len(self.threads)
            self.threads = []
        for _ in range(n):
            self.calls.put(None)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            call = self.calls.get()
            with self.lock:
                if call is None or self.closed:
                    return
                if call.dropped:
                    self.idle += 1
                    continue
                call.thread = me
            call.fn(*call.args)
            with self.lock:
                if call.dropped:  # abandoned while it ran: no longer the pool's thread
                    return
                call.done = True
                self.idle += 1
