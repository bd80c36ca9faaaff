"""rlalign.agent.pool.EnvPool under the episode driver: at most task.env_workers environment calls at
once on that many long-lived threads, reused from call to call and from driver to driver; a call past
its timeout leaves its thread behind and the pool starts another; no thread outlives finish() or
close(). The engine here is scripted (tests/test_agent.py)."""

from __future__ import annotations

import threading

import pytest
from test_agent import ROW, TOK, scripted

from rlalign.agent import EnvError, EnvPool, EpisodeDriver, EpisodeLimits
from rlalign.agent.envs import GuessEnv
from rlalign.tasks import Example


class Seen:
    """The threads that ran environment calls, and the most calls that ran at once."""

    def __init__(self, meet: int):
        self.lock, self.names, self.now, self.most = threading.Lock(), [], 0, 0
        self.meet = threading.Barrier(meet, timeout=2.0)

    def enter(self) -> None:
        with self.lock:
            self.names.append(threading.current_thread().name)
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


SEEN: list[Seen] = []


class Counted(GuessEnv):
    """Resets and steps recorded in SEEN[0]; each step waits until SEEN[0].meet of them run at once."""

    def reset(self, example, seed):
        SEEN[0].enter()
        super().reset(example, seed)
        SEEN[0].leave()

    def step(self, action):
        SEEN[0].enter()
        try:
            SEEN[0].meet.wait()
            return super().step(action)
        finally:
            SEEN[0].leave()


def _driver(env_cls, rows: list[Example], pool: EnvPool | None = None, **limits) -> EpisodeDriver:
    lim = {"max_turns": 3, "max_context_len": 64, "timeout_s": 5.0, "workers": 3, **limits}
    return EpisodeDriver(env_cls, TOK, rows, [TOK.encode(r.prompt) for r in rows], list(range(10, 10 + len(rows))),
                         0, EpisodeLimits(**lim), "step 7", pool)


def _alive(pool: EnvPool) -> list[str]:
    """The pool's threads still running once every idle one has had time to end."""
    threads = [t for t in threading.enumerate() if t.name.startswith(pool.name + "-")]
    for t in threads:
        t.join(timeout=5.0)
    return [t.name for t in threads if t.is_alive()]


@pytest.mark.parametrize("workers", [3, 6])
def test_at_most_env_workers_calls_run_at_once_on_that_many_threads_reused_call_after_call(workers):
    SEEN[:] = [Seen(meet=workers)]
    d = _driver(Counted, [ROW] * 6, workers=workers)
    rs = scripted(d, ["9", "8", "7"])  # 6 resets and 18 steps, each step meeting workers - 1 others
    assert [r.finish_reason for r in rs] == ["turns"] * 6
    assert SEEN[0].most == workers  # twin: 6 workers run 6 at once
    assert sorted(set(SEEN[0].names)) == sorted(f"{d.pool.name}-{i}" for i in range(workers))
    assert len(SEEN[0].names) == 24 and d.pool.started == workers
    assert _alive(d.pool) == []  # finish closes the driver's own pool


def test_a_pool_kept_across_drivers_reuses_its_threads_and_drivers_with_their_own_do_not():
    SEEN[:] = [Seen(meet=3)]
    shared = EnvPool(3)
    for _ in range(2):
        scripted(_driver(Counted, [ROW] * 3, shared), ["9"])
    assert len(set(SEEN[0].names)) == 3 and shared.started == 3
    SEEN[:] = [Seen(meet=3)]
    for _ in range(2):  # twin: each driver's own pool, its own threads
        scripted(_driver(Counted, [ROW] * 3), ["9"])
    assert len(set(SEEN[0].names)) == 6
    shared.close()
    assert _alive(shared) == []


HANG = threading.Event()


class HangsOnH(GuessEnv):
    """The episode of prompt 'h' hangs at its first step (until HANG); the others play guess."""

    def reset(self, example, seed):
        super().reset(example, seed)
        self.hangs = example.prompt == "h"

    def step(self, action):
        if self.hangs:
            HANG.wait(10)
        return super().step(action)


def test_a_hung_call_leaves_its_thread_behind_and_the_pool_replaces_it():
    rows = [Example("h", "3"), *[ROW] * 4]
    HANG.clear()
    pool = EnvPool(2)
    try:
        rs = scripted(_driver(HangsOnH, rows, pool, workers=2, timeout_s=0.2, fallback=-1.0), ["5", "3"])
        assert [r.finish_reason for r in rs] == ["env_error"] + ["done"] * 4
        assert pool.started == 3 and len(pool.threads) == 2  # one replacement; the hung thread not the pool's
        hung = [t for t in threading.enumerate() if t.name.startswith(pool.name + "-") and t not in pool.threads]
        assert len(hung) == 1 and hung[0].is_alive()
    finally:
        HANG.set()
    hung[0].join(timeout=5.0)  # its call returned: it ends rather than rejoin the pool
    assert not hung[0].is_alive() and len(pool.threads) == 2
    rs = scripted(_driver(HangsOnH, rows, pool, workers=2, timeout_s=0.2), ["5", "3"])  # twin: none hangs
    assert [r.finish_reason for r in rs] == ["done"] * 5 and pool.started == 3
    pool.close()
    assert _alive(pool) == []


class Raises(GuessEnv):
    def step(self, action):
        raise KeyError("no such tool")


def test_no_thread_outlives_a_driver_that_raised_once_closed():
    d = _driver(Raises, [ROW] * 4, workers=2)
    with pytest.raises(EnvError, match="raised KeyError"):
        scripted(d, ["5"])
    d.close()
    assert _alive(d.pool) == [] and d.pool.started == 2
    with pytest.raises(RuntimeError, match="submit after close"):
        d.pool.submit(print)
