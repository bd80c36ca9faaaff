"""Fault injection for testing failure handling (a crashed actor, a dead rank, a stuck write).

RLALIGN_FAULT="<site>:<rank>:<n>" makes the process running <site> as <rank> exit abruptly
(os._exit, no cleanup, no message) on its n-th call; "<site>:<rank>:<n>:hang" makes that call
block forever instead (a stuck file system, a hung collective), "...:sleep=S" S seconds (a slow
one). Sites: trainer.train_step, trainer.score, generator.generate, scoring.score_micro_batch,
checkpoint.write (a trainer rank's checkpoint write, in its writer thread) (rank = the process
group rank, 0 without one).
Unset (always, outside tests), it costs one dict lookup.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

_calls: Counter = Counter()


def maybe_fail(site: str, rank: int) -> None:
    spec = os.environ.get("RLALIGN_FAULT")
    if not spec:
        return
    want_site, want_rank, n, *action = spec.split(":")
    if want_site != site or int(want_rank) != rank:
        return
    _calls[site] += 1
    if _calls[site] == int(n):
        if action == ["hang"]:
            threading.Event().wait()
        if action and action[0].startswith("sleep="):
            threading.Event().wait(float(action[0].removeprefix("sleep=")))
            return
        os._exit(13)
