"""A run directory shared by the segments of one run (start, preemption, resume, scheduler retry)
and by nobody else at the same time.

    with RunLock(run_dir):          # a second job on the directory is refused, naming the holder
        record_segment(run_dir, start_step, resume, cfg)   # segments.jsonl + config.yaml

RunLock holds an exclusive flock(2) on RUN_DIR/.rlalign.lock for the job's lifetime and writes
its holder (host, pid, start time, command) into that file. The kernel drops the flock when the
process ends, however it ends (kill -9, OOM killer, a node's NFS lease running out), so a
crashed job never blocks the next one: the file still names the crashed holder, which the next
job reports as a stale lock it takes over. A clean exit empties the file. Only the file's
contents are rewritten, never the file itself, so every job locks the same inode.

segments.jsonl gets one record per start of the run: the step it starts at, the checkpoint it
resumed from, host/pid/time and the whole resolved config, so a resumed run that changed keys
(trainer.lr, trainer.ep_size) keeps the config each of its steps ran with. config.yaml is the
config of the latest segment. `rlalign compare` reads the segments to know which trace streams
each segment wrote (trace streams are per rank; the trainer EP size may change at a resume).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from rlalign.logger import json_line

LOCK = ".rlalign.lock"
SEGMENTS = "segments.jsonl"


class RunDirLocked(RuntimeError):
    """Another live job holds the run directory; the message names it."""


def _holder_text(info: dict) -> str:
    if not info:
        return "a job that has not yet written its name"
    return (f"host {info.get('host')}, pid {info.get('pid')}, started {info.get('started')}, "
            f"command {info.get('command')!r}")


class RunLock:
    """Exclusive use of a run directory for the life of this object (a context manager)."""

    def __init__(self, run_dir: Path, command: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.command = command if command is not None else " ".join(["rlalign", *sys.argv[1:]])
        self.stale: dict | None = None  # the holder a crashed job left in the file, if any
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            held = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise RunDirLocked(f"run.dir {self.run_dir} is in use by another rlalign job ({_holder_text(held)}); "
                                   f"wait for it to end or choose another run.dir") from None
            raise OSError(e.errno, f"cannot lock run.dir {self.run_dir} ({self.path}): {os.strerror(e.errno)}; "
                                   f"the file system offers no flock") from None
        self.stale = _read_holder(fd) or None
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now().isoformat(timespec="seconds"), "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # empty: released cleanly (a non-empty free file is a crashed holder's)
        finally:
            os.close(fd)  # drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {"host": "?", "pid": "?", "started": "?", "command": "(unreadable lock file)"}
    return info if isinstance(info, dict) else {}


def stale_note(lock: RunLock) -> str | None:
    """One line about a crashed job's lock that `lock` took over, or None."""
    if lock.stale is None:
        return None
    return f"run.dir {lock.run_dir}: took over the lock of a job that ended without releasing it " \
           f"({_holder_text(lock.stale)})"


def record_segment(run_dir: Path, start_step: int, resumed_from: Path | None, config: dict, config_yaml: str) -> None:
    """Append this start to segments.jsonl and write config.yaml (the latest segment's config).
    A record of a start at or after `start_step` (a segment whose steps this one redoes) is
    dropped: each step belongs to exactly one segment."""
    path = Path(run_dir) / SEGMENTS
    kept = [s for s in read_segments(run_dir) if s["start_step"] < start_step]
    rec = {"start_step": start_step, "resumed_from": str(resumed_from) if resumed_from else None,
           "host": socket.gethostname(), "pid": os.getpid(),
           "started": datetime.datetime.now().isoformat(timespec="seconds"), "config": config}
    part = path.with_name(path.name + ".part")
    part.write_text("".join(json_line(s) + "\n" for s in [*kept, rec]))
    os.replace(part, path)
    (Path(run_dir) / "config.yaml").write_text(config_yaml)


def read_segments(run_dir: Path) -> list[dict]:
    """segments.jsonl's records in start order ([] for a run dir without one)."""
    path = Path(run_dir) / SEGMENTS
    if not path.is_file():
        return []
    out = []
    for no, ln in enumerate(path.read_text().splitlines(), 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{no}: corrupt record ({e.msg} at column {e.colno})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("start_step"), int):
            raise ValueError(f"{path}:{no}: not a segment record (no integer start_step)")
        out.append(rec)
    return sorted(out, key=lambda s: s["start_step"])
