"""A run directory shared by the segments of one run (start, preemption, resume, scheduler retry)
and by nobody else at the same time.

    with RunLock(run_dir):          # a second job on the directory is refused, naming the holder
        claim_run_dir(run_dir, resume, overwrite)          # another run's steps: refused, or deleted
        record_segment(run_dir, start_step, resume, cfg)   # segments.jsonl + config.yaml

RunLock holds an exclusive flock(2) on RUN_DIR/.rlalign.lock for the job's lifetime and writes
its holder (host, pid, start time, command) into that file. The kernel drops the flock when the
process ends, however it ends (kill -9, OOM killer, a node's NFS lease running out), so a
crashed job never blocks the next one: the file still names the crashed holder, which the next
job reports as a stale lock it takes over. A clean exit empties the file. Only the file's
contents are rewritten, never the file itself, so every job locks the same inode.

A directory that holds another run's work (its logged steps, a checkpoint, trace records) is not
written over silently: claim_run_dir refuses it in one line naming what it holds, unless
checkpoint.resume continues that run or run.overwrite=true deletes its files (and only its files)
first.

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
import shlex
import shutil
import socket
import sys
from pathlib import Path

from omegaconf import OmegaConf

from rlalign.checkpoint_files import list_complete
from rlalign.config_search import ConfigSource
from rlalign.logger import json_line, written_text

LOCK = ".rlalign.lock"
SEGMENTS = "segments.jsonl"
# what a run writes into its directory besides the lock: run.overwrite=true deletes these and nothing else
RUN_FILES = ("metrics.jsonl", SEGMENTS, "config.yaml", "divergence.jsonl", ".wandb_id")
RUN_DIRS = ("checkpoints", "traces", "report", "wandb", "tokenizer")
RUN_DIR_GLOBS = ("mismatch-step*",)


class RunDirLocked(RuntimeError):
    """Another live job holds the run directory; the message names it."""


class RunDirTaken(ValueError):
    """The run directory holds an earlier run's work and nothing said to continue it or to delete it."""


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
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise NotADirectoryError(f"run.dir {self.run_dir}: a file, or below one, not a directory; choose "
                                     "another run.dir") from None
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
    text = written_text(path)
    for no, ln in enumerate(text.splitlines(), 1):
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


def model_changes(run_dir: Path, ckpt: Path, cfg) -> dict:
    """{model.KEY: value} where the run segment that wrote checkpoint `ckpt` (its step_N name) had another
    model than `cfg`: a resume with `cfg` would not fit that checkpoint ({} when no segment says)."""
    try:
        step = int(Path(ckpt).name.rsplit("_", 1)[-1])
        segs = [s for s in read_segments(run_dir) if s["start_step"] <= step]
    except ValueError:  # an unreadable record
        return {}
    then = segs[-1].get("config", {}).get("model") if segs else None
    if not isinstance(then, dict):
        return {}
    now = OmegaConf.to_container(cfg.model, resolve=True)
    return {f"model.{k}": v for k, v in then.items() if k in now and now[k] != v}


def _logged_steps(run_dir: Path) -> list[int]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for ln in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(ln)["step"]))
        except (ValueError, KeyError, TypeError):  # a line cut short by a killed writer
            continue
    return steps


def held_run(run_dir: Path) -> tuple[str, int | None] | None:
    """What `run_dir` holds of an earlier run's work, in words ('a finished run: steps 0-2 of 3 in
    metrics.jsonl, checkpoint step_000002, started 2026-12-04T21:37:02'), and its run.steps when it
    finished them (else None); None when it holds none: no logged step, no complete checkpoint, no
    trace record (a start that did no step is no work)."""
    run_dir = Path(run_dir)
    steps, done = _logged_steps(run_dir), list_complete(run_dir)
    traces = [p for p in (run_dir / "traces").glob("*.jsonl") if p.stat().st_size]
    if not (steps or done or traces):
        return None
    try:
        segs = read_segments(run_dir)
    except ValueError:
        segs = []
    last = segs[-1].get("config") if segs else None
    total = last.get("run", {}).get("steps") if isinstance(last, dict) else None
    parts = []
    if steps:
        parts.append(f"steps {min(steps)}-{max(steps)}" + (f" of {total}" if total else "") + " in metrics.jsonl")
    if done:
        parts.append(f"checkpoint {done[-1].name}")
    if traces and not steps:
        parts.append(f"{len(traces)} trace files")
    if segs:
        parts.append(f"started {segs[-1].get('started')}")
    finished = total if total and steps and max(steps) >= total - 1 else None
    return f"{'a finished run' if finished else 'a run'}: {', '.join(parts)}", finished


def claim_run_dir(run_dir: Path, resume: str, overwrite: bool) -> str | None:
    """With the directory's lock held: an earlier run's work there (held_run) is refused, in one line
    that names it and the ways on, unless checkpoint.resume continues it ('auto', or a checkpoint in
    this directory) or `overwrite` (run.overwrite) deletes its files first (RUN_FILES, RUN_DIRS,
    RUN_DIR_GLOBS: nothing else in the directory). The line saying what was deleted, or None."""
    run_dir = Path(run_dir)
    held = held_run(run_dir)
    if held is None:
        return None
    what, finished = held
    here = resume == "auto" or (resume != "never" and Path(resume).resolve().is_relative_to(run_dir.resolve()))
    if here:
        return None
    if not overwrite:
        using = "" if resume == "never" else f" (checkpoint.resume={resume} is another run's)"
        more = f" and run.steps > {finished}" if finished else ""
        raise RunDirTaken(f"run.dir {run_dir} holds {what}{using}; continue it with checkpoint.resume=auto{more}, "
                          f"choose another run.dir, or set run.overwrite=true to delete that run's files first")
    clear_run(run_dir)
    return f"run.overwrite=true: deleted {what} from {run_dir}"


def clear_run(run_dir: Path) -> None:
    """Delete a run's own files from `run_dir` (never the lock, never a file the run did not write)."""
    run_dir = Path(run_dir)
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    dirs = [run_dir / name for name in RUN_DIRS] + [p for g in RUN_DIR_GLOBS for p in run_dir.glob(g)]
    for d in dirs:
        if d.is_dir():
            shutil.rmtree(d)


def resume_hint(st: dict) -> str:
    """'last complete checkpoint: ...; resume with: rlalign train ...' of a train command (st: its
    overrides, cfg and config source)."""
    run_dir = Path(str(st["cfg"].run.dir))
    bad = st.get("damaged")  # a checkpoint whose data did not load: named, and the resume names another
    done = [p for p in list_complete(run_dir) if bad is None or p.resolve() != Path(bad).resolve()]
    # the checkpoint's own model where this start changed it (segments.jsonl)
    changed = {k: override_value(v) for k, v in model_changes(run_dir, done[-1], st["cfg"]).items()} if done else {}
    dropped = ("run.dir", "checkpoint.resume", *changed)
    kept = [o for o in st["overrides"] if o.split("=", 1)[0].lstrip("+~") not in dropped]
    kept += [f"{k}={v}" for k, v in changed.items()]
    source = st.get("source") or ConfigSource()
    which = "auto" if bad is None or not done else str(done[-1])
    resume = "rlalign train " + shlex.join([*source.argv(), *kept, f"run.dir={run_dir}", f"checkpoint.resume={which}"])
    if bad is not None:
        if not done:
            return f"{bad} does not load and no other checkpoint is complete; start afresh in another run.dir"
        return f"{bad} does not load; the newest other complete checkpoint: {done[-1]}; resume with: {resume}"
    if changed:
        was = ", ".join(f"{k}={v}" for k, v in changed.items())
        return (f"last complete checkpoint: {done[-1]}, written with {was}, which this start changes (segments.jsonl); "
                f"resume with: {resume}; or start afresh in another run.dir")
    if done:
        return f"last complete checkpoint: {done[-1]}; resume with: {resume}"
    given = str(st["cfg"].checkpoint.resume)
    if given not in ("auto", "never"):  # a checkpoint named by path: the run goes on from it, not afresh
        again = resume.rsplit(" checkpoint.resume=", 1)[0] + " " + shlex.join([f"checkpoint.resume={given}"])
        return (f"no complete checkpoint in {run_dir} yet; this run starts from checkpoint.resume={given}: mend what "
                f"the error names and run again: {again}")
    return (f"no complete checkpoint in {run_dir} (checkpoint.every=N saves every N steps); start again with: "
            f"{resume}")


def override_value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
