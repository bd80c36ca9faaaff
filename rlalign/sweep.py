"""--multirun: a command once per combination of comma-separated override values, as Hydra's basic
sweeper expands them (`trainer.lr=1e-4,3e-4 seed=0,1`: four jobs), one job after another in this
process (as the gates run their two trainings). run.dir is the sweep's directory and job N runs in
RUN_DIR/N (unless run.dir is itself swept). Every job's config is composed and checked before the first
starts. A job that fails with an input error is reported and the sweep goes on; Ctrl-C or a stop
signal ends it. At the end: a table on stderr, one JSON line per job on stdout (also written to
RUN_DIR/multirun.jsonl by the commands that use run.dir).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from rlalign.config_search import ConfigError

# the fields of a job's JSON summary the table shows, when the job printed them
TABLE_FIELDS = {"train": ("reward_last5", "mismatched_tokens_total", "sync/weights_fp"),
                "agree": ("tokens", "mismatched_tokens", "max_abs_diff")}
RUN_DIR_COMMANDS = ("train", "gate")


@dataclass
class Job:
    num: int
    overrides: list[str]
    cfg: DictConfig
    run_dir: str | None  # None: the command writes no run directory (agree)
    exit_code: int | None = None  # None: not run (the sweep was interrupted before it)
    summary: dict | None = None  # the last JSON object the job printed on stdout

    def record(self) -> dict:
        return {"job": self.num, "overrides": self.overrides, "run_dir": self.run_dir,
                "exit_code": self.exit_code, "summary": self.summary}


def expand(overrides: list[str]) -> list[list[str]]:
    """Every job's overrides: the product of the sweeps' values (key=a,b; range(...); choice(...)), the
    first override's values outermost, as Hydra's basic sweeper orders them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    except HydraException as e:
        raise ValueError(" ".join(str(e).split())) from None
    if not jobs:
        empty = [o for o in overrides if _sweeps_nothing(o)]
        raise ValueError(f"the sweep has no jobs: {' '.join(empty) or ' '.join(overrides)} gives no value")
    return jobs


def _sweeps_nothing(override: str) -> bool:
    """Whether one override alone expands to no job (an empty range or choice)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (jobs,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides([override]), None)
    return not jobs


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def plan(cmd: str, overrides: list[str], load: Callable[[list[str]], DictConfig]) -> tuple[Path | None, list[Job]]:
    """(the sweep's directory, its jobs, each config composed by `load` and so checked). Commands
    that write a run directory: job N gets run.dir=SWEEP_DIR/N, SWEEP_DIR being the run.dir the first
    job would have; None when run.dir is swept (each job keeps its own) or the command writes none."""
    expanded = expand(overrides)
    dirs = {o for job in expanded for o in job if _key(o) == "run.dir"}
    sweep_dir = None
    if cmd in RUN_DIR_COMMANDS and len(dirs) < 2:
        sweep_dir = Path(str(_load_job(load, expanded, 0).run.dir))
    jobs = []
    for num, job in enumerate(expanded):
        if sweep_dir is not None:
            job = [o for o in job if _key(o) != "run.dir"] + [f"run.dir={sweep_dir / str(num)}"]
        cfg = _load_job(load, expanded, num, job)
        jobs.append(Job(num, job, cfg, str(cfg.run.dir) if cmd in RUN_DIR_COMMANDS else None))
    return sweep_dir, jobs


def _load_job(load: Callable[[list[str]], DictConfig], expanded: list[list[str]], num: int,
              job: list[str] | None = None) -> DictConfig:
    """Job num's config; a refused one is named by its number and swept values."""
    try:
        return load(expanded[num] if job is None else job)
    except ConfigError as e:
        if len(expanded) < 2:
            raise
        swept = [o for o in expanded[num] if any(o not in other for other in expanded)]
        raise ConfigError(f"multirun job {num} of {len(expanded)} ({' '.join(swept)}): {e}") from e


class _Tee(io.TextIOBase):
    """stdout that passes everything through and keeps the last JSON object printed."""

    def __init__(self, out):
        self.out, self.line, self.last = out, "", None

    def write(self, s: str) -> int:
        self.out.write(s)
        *done, self.line = (self.line + s).split("\n")
        for ln in done:
            if ln.startswith("{"):
                try:
                    self.last = json.loads(ln)
                except ValueError:
                    pass
        return len(s)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty()

    def fileno(self) -> int:
        return self.out.fileno()


def run(cmd: str, sweep_dir: Path | None, jobs: list[Job], run_one: Callable[[Job], int]) -> int:
    """Run the jobs in order (run_one: a job's exit status; Ctrl-C and stop signals propagate, after
    the table of the jobs so far); returns 0 when every job returned 0, else the largest status."""
    from contextlib import redirect_stdout

    for job in jobs:
        print(f"rlalign {cmd}: multirun job {job.num} ({job.num + 1} of {len(jobs)}): {' '.join(job.overrides)}",
              file=sys.stderr, flush=True)
        tee = _Tee(sys.stdout)
        try:
            with redirect_stdout(tee):
                job.exit_code = run_one(job)
        except BaseException:
            print(table(cmd, jobs, stopped=job.num), file=sys.stderr, flush=True)
            raise
        job.summary = tee.last
    print(table(cmd, jobs), file=sys.stderr, flush=True)
    lines = [json.dumps(job.record()) for job in jobs]
    if sweep_dir is not None and cmd in RUN_DIR_COMMANDS:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / "multirun.jsonl").write_text("".join(ln + "\n" for ln in lines))
    print("\n".join(lines), flush=True)
    return max(job.exit_code for job in jobs)


def table(cmd: str, jobs: list[Job], stopped: int | None = None) -> str:
    """The sweep's summary: per job its exit status (or `stopped`: the job Ctrl-C or a stop signal
    ended), the swept values, the summary's main fields and the run directory."""
    swept = [k for k in dict.fromkeys(_key(o) for job in jobs for o in job.overrides)
             if k != "run.dir" and len({_value(job, k) for job in jobs}) > 1]
    fields = [f for f in TABLE_FIELDS.get(cmd, ()) if any(f in (job.summary or {}) for job in jobs)]
    head = ["job", "exit", *swept, *fields] + (["run_dir"] if cmd in RUN_DIR_COMMANDS else [])
    rows = [[str(job.num), _status(job, stopped),
             *(_value(job, k) for k in swept), *(_cell((job.summary or {}).get(f, "-")) for f in fields)]
            + ([str(job.run_dir)] if cmd in RUN_DIR_COMMANDS else []) for job in jobs]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    done = sum(job.exit_code == 0 for job in jobs)
    lines = [f"rlalign {cmd}: multirun: {done} of {len(jobs)} jobs exited 0"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    return "\n".join(lines)


def _status(job: Job, stopped: int | None) -> str:
    if job.num == stopped:
        return "stopped"
    return "not run" if job.exit_code is None else str(job.exit_code)


def _value(job: Job, key: str) -> str:
    return next((o.split("=", 1)[1] for o in job.overrides if _key(o) == key and "=" in o), "-")


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
