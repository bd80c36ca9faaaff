"""Run logging: start-up phases and a line per step on stderr (a progress bar under them on a
terminal), metrics.jsonl in the run directory, and W&B. stdout stays free for the command's JSON.

    [4/50] step 3  reward 0.031  loss -0.0107  kl 0  len 4.8  1312 tok/s  mismatched 0/612  max|d| 0  0.66s  ETA 0:29

(step_line: loss, and kl after it, are shown when the step logs them; the ETA is the steps left times the mean
step time of this start, its first step, which warms up, left out once there are others.)

metrics.jsonl holds one JSON object per step (see rlalign/monitor/consistency.py for the
consistency/* names). W&B is optional and imported only when logger.wandb.enabled; its mode
follows logger.wandb.mode, else $WANDB_MODE, else 'offline' when no API key is configured.

In W&B, every step logs its numbers, and:
  consistency/abs_diff_hist    a wandb.Histogram of |Δ logprob| (trainer - generator) over the
                               step's DIFFERING tokens in decades: x = log10 |Δ|, [-8, -7) holds
                               those in (0, 1e-7], ..., [-1, 0) those above 0.1
                               (rlalign.monitor.consistency.HIST_EDGES)
  consistency/identical_tokens the tokens with |Δ| = 0, a number of their own (in a decade bin they
                               would read as |Δ| ~ 1e-9)
  consistency/worst_tokens     (steps with mismatches) a table of the worst tokens by |Δ|: sample,
                               position, token, both logprobs, |Δ| and the op where the token's
                               rows first differ (monitor.fingerprints=layers)
  consistency/divergence_by_op (steps with mismatches, monitor.fingerprints=layers) a table: per
                               op, the token rows that differ there and the mismatched tokens
                               that first diverged there
  samples                      every logger.wandb.sample_table_every steps, the first
                               logger.wandb.num_samples samples (prompt, completion, reward)
A string metric (consistency/first_divergent_op, sync/weights_fp, ...) goes to the run summary:
summary[KEY] holds its latest value and summary[KEY_step] the step it came from. Every string
value and alert of the run (this process) is also kept, one row per (step, key, value), in the
table `text_metrics`, logged when the logger closes. rlalign/wandb_workspace.py saves a W&B
workspace laid out for these keys.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def wandb_mode(cfg_mode: str | None) -> str:
    if cfg_mode:
        return cfg_mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def json_safe(record: dict) -> dict:
    """Standard JSON: a non-finite number (NaN, inf) becomes null, its name listed under
    'nonfinite' so that a reader sees which value it was (bare NaN breaks strict parsers); in a
    nested value the name is the dotted path ('abs_diff_hist.3')."""
    bad: list[str] = []

    def clean(v, name: str):
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(name)
            return None
        if isinstance(v, dict):
            return {k: clean(x, f"{name}.{k}" if name else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x, f"{name}.{i}") for i, x in enumerate(v)]
        return v

    out = clean(record, "")
    return {**out, "nonfinite": bad} if bad else record


def json_line(record: dict) -> str:
    """`record` as one line of standard JSON (json_safe: non-finite numbers null and named)."""
    return json.dumps(json_safe(record), allow_nan=False)


def written_text(path: Path) -> str:
    """The text of a file rlalign wrote (JSON lines); ValueError naming the file and the first byte that is
    not UTF-8."""
    try:
        return Path(path).read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): not a file "
                         "rlalign wrote") from None


LOSS_KEYS = ("actor/loss", "actor/pg_loss")  # the first the step logs is the line's loss
# ... and its kl: to the reference (algorithm.kl_coef > 0), else KL(old || current) over the update's epochs
KL_KEYS = ("kl/ref_k3", "kl/old_new_k3", "actor/kl")  # (else the first kl/* key, else none)


def _first(metrics: dict, keys: tuple[str, ...], prefix: str | None = None) -> float | None:
    for k in keys:
        if isinstance(metrics.get(k), int | float):
            return metrics[k]
    if prefix is not None:
        for k, v in metrics.items():
            if k.startswith(prefix) and isinstance(v, int | float):
                return v
    return None


def clock_text(seconds: float) -> str:
    """0:29, 12:05, 1:02:03."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def step_line(step: int, total: int, metrics: dict, eta_s: float | None) -> str:
    """One step on the console (module docstring): [done/total], the step, reward, loss, kl, mean
    response length, tokens/s, the generator/trainer comparison, the step's time and the ETA."""
    parts = [f"[{step + 1}/{total}] step {step}", f"reward {metrics['reward/mean']:.3f}"]
    loss, kl = _first(metrics, LOSS_KEYS), _first(metrics, KL_KEYS, "kl/")
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    if kl is not None:
        parts.append(f"kl {kl:.3g}")
    if "response/length_mean" in metrics:
        parts.append(f"len {metrics['response/length_mean']:.1f}")
    if "time/step_tok_per_s" in metrics:
        parts.append(f"{metrics['time/step_tok_per_s']:.0f} tok/s")
    parts += [f"mismatched {metrics['consistency/mismatched_tokens']}/{metrics['consistency/tokens']}",
              f"max|d| {metrics['consistency/logprob_abs_diff_max']:.2g}", f"{metrics['time/step_s']:.2f}s"]
    if eta_s is not None:
        parts.append(f"ETA {clock_text(eta_s)}")
    return "  ".join(parts)


def eta_seconds(step_times: list[float], steps_left: int) -> float | None:
    """The steps left times the mean step time, without the first (warm-up) step once there are others."""
    if not step_times:
        return None
    times = step_times[1:] or step_times
    return steps_left * sum(times) / len(times)


class Phases:
    """A command's start-up on stderr, one line as each phase begins, with the seconds since the start:
    `rlalign train: [19.5 s] starting 2 trainer ranks (EP 2), each building its model shard`. Silent
    when disabled."""

    def __init__(self, prog: str, enabled: bool = True, out=None, clock: Callable[[], float] = time.monotonic):
        self.prog, self.enabled, self.out, self.clock = prog, enabled, out, clock
        self.t0 = clock()

    def __call__(self, what: str) -> None:
        if self.enabled:
            print(f"{self.prog}: [{self.clock() - self.t0:.1f} s] {what}", file=self.out or sys.stderr, flush=True)


class RunLogger:
    def __init__(self, cfg: DictConfig, run_dir: Path, start_step: int, total_steps: int):
        self.cfg, self.run_dir = cfg, run_dir
        self.text_rows: list[list] = []  # [step, key, value] of string metrics and alerts
        self.next_step, self.last_step, self.total_steps = start_step, None, total_steps
        self.step_times: list[float] = []  # this start's steps, for the ETA
        self.metrics_path = run_dir / "metrics.jsonl"
        if cfg.logger.jsonl:
            truncate_jsonl(self.metrics_path, start_step)
        self.wandb = None
        if cfg.logger.wandb.enabled:
            import wandb

            w = cfg.logger.wandb
            self.wandb = wandb.init(
                project=w.project,
                name=w.name or run_dir.name,
                dir=str(run_dir),
                mode=wandb_mode(w.mode),
                config=OmegaConf.to_container(cfg, resolve=True),
                id=_wandb_id(run_dir),
                resume="allow",
            )
        self.progress = None
        if cfg.logger.console and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]rlalign train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), transient=False, console=Console(stderr=True))
            self.task = self.progress.add_task("", total=total_steps, completed=start_step)
            self.progress.start()

    def log(self, step: int, metrics: dict, detail: dict | None = None) -> None:
        """One step's metrics; `detail` (rl.mismatch_detail) when tokens differed."""
        if self.cfg.logger.jsonl:
            with self.metrics_path.open("a") as f:
                f.write(json_line({"step": step, **metrics}) + "\n")
        texts = {k: v for k, v in metrics.items() if isinstance(v, str)}
        self.text_rows += [[step, k, v] for k, v in texts.items()]
        if self.wandb is not None:
            self.wandb.log({**{k: v for k, v in metrics.items() if isinstance(v, int | float)},
                            **wandb_media(metrics, detail)}, step=step)
            for k, v in texts.items():
                self.wandb.summary[k] = v
                self.wandb.summary[f"{k}_step"] = step
        self.next_step, self.last_step = step + 1, step
        self.step_times.append(metrics["time/step_s"])
        line = step_line(step, self.total_steps, metrics, eta_seconds(self.step_times, self.total_steps - step - 1))
        if self.progress is not None:
            self.progress.console.print(line, highlight=False)
            self.progress.update(self.task, advance=1)
        elif self.cfg.logger.console:
            print(line, file=sys.stderr, flush=True)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        w = self.cfg.logger.wandb
        if self.wandb is None or not rows or step % max(1, w.sample_table_every):
            return
        import wandb

        cols = list(rows[0])
        table = wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows[: w.num_samples]])
        self.wandb.log({"samples": table}, step=step)

    def alert(self, title: str, text: str) -> None:
        """An alert comes before its step's log(): its row in text_metrics carries that step."""
        print(f"rlalign: {title}: {text}", file=sys.stderr, flush=True)
        self.text_rows.append([self.next_step, f"alert/{title}", text])
        if self.wandb is not None:
            self.wandb.summary[f"alert/{title}"] = text
            try:
                self.wandb.alert(title=title, text=text)
            except Exception as e:  # offline runs cannot send alerts; the console line stands
                print(f"rlalign: W&B alert not sent ({type(e).__name__})", file=sys.stderr)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.wandb is not None:
            if self.text_rows:
                import wandb

                table = wandb.Table(columns=["step", "key", "value"], data=self.text_rows)
                at = {} if self.last_step is None else {"step": self.last_step}
                self.wandb.log({"text_metrics": table}, **at)
            self.wandb.finish()


def wandb_media(metrics: dict, detail: dict | None) -> dict:
    """The step's histogram and mismatch tables as W&B objects (module docstring)."""
    import wandb

    out = {}
    hist = metrics.get("consistency/abs_diff_hist")
    if hist:
        edges = list(range(1 - len(hist), 1))  # log10 decades of the differing tokens, the last (-1, 0]: |d| > 0.1
        out["consistency/abs_diff_hist"] = wandb.Histogram(np_histogram=(hist[1:], edges))
        out["consistency/identical_tokens"] = hist[0]
    if detail:
        first = {(t["sample_id"], t["position"]): t["first_op"] for t in detail.get("tokens", [])}  # logits row
        cols = ["sample_id", "position", "token", "text", "generator_logprob", "trainer_logprob", "abs_diff",
                "first_op"]
        worst = detail.get("worst_tokens", [])
        turn = any("turn" in w for w in worst)  # an episode's tokens: the assistant turn of each
        rows = [[w["sample_id"], w["position"], w["token"], w.get("text"), w["generator"], w["trainer"], w["abs_diff"],
                 first.get((w["sample_id"], w["position"] - 1)), *([w.get("turn")] if turn else [])] for w in worst]
        cols += ["turn"] if turn else []
        out["consistency/worst_tokens"] = wandb.Table(columns=cols, data=rows)
        counts = detail.get("first_op_counts", {})
        by_op = [[op, n, counts.get(op, 0)] for op, n in detail.get("by_op", {}).items()]
        if by_op:
            out["consistency/divergence_by_op"] = wandb.Table(
                columns=["op", "differing_rows", "first_divergence_tokens"], data=by_op)
    return out


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep only records of steps < step (a resumed run rewrites what follows its checkpoint; a
    last line cut short by a killed writer goes too)."""
    if not path.exists():
        return
    keep = []
    for no, ln in enumerate(written_text(path).splitlines(keepends=True), 1):
        if not ln.strip() or not ln.endswith("\n"):
            continue
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{no}: corrupt record ({e.msg}); mend or remove that line to resume") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
            raise ValueError(f"{path}:{no}: a record without an integer step (not written by rlalign?); mend or "
                             "remove that line to resume")
        if rec["step"] < step:
            keep.append(ln)
    path.write_text("".join(keep))


def _wandb_id(run_dir: Path) -> str:
    f = run_dir / ".wandb_id"
    if not f.exists():
        import uuid

        f.write_text(uuid.uuid4().hex[:12])
    try:
        rid = f.read_text().strip()
    except UnicodeDecodeError:
        rid = None
    if not rid or not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", rid):
        raise ValueError(f"{f}: damaged (the W&B run id of this run dir, read {rid!r}); write the run's id back, or "
                         "delete the file to log to a new W&B run")
    return rid
