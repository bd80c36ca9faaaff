"""`rlalign train`: GRPO on Ray with a trainer group and a generator group at different EP sizes.

One step:
    prompts (task, pure function of seed and step) -> GeneratorGroup (EP m): tokens + logprobs
    -> rewards -> GRPO advantages -> TrainerGroup (EP n): PPO-clip, old logprobs = generator's;
       returns its own pre-update logprobs -> monitor compares both sides token by token
    -> weight sync trainer -> generator, verified by fingerprints on both sides
    -> metrics (console, metrics.jsonl, W&B) -> checkpoint
Everything that can be wrong in the config, the task or the data fails before an actor starts.

Under a scheduler: the run holds its directory (rlalign.rundir.RunLock: a second job is refused);
a resume whose checkpoint is already at run.steps has nothing to do and returns at once (a retry of
a finished job); segments.jsonl keeps the config of every start.

Stopping (rlalign.stop: run.stop_signals and SIGINT). When a checkpoint written or being written
covers every step done, the step in flight is cut at once and the run exits once that checkpoint is
complete (no new save); when the step in flight has not yet reached the trainer's update, it is cut
at once and the trainer's unchanged state is checkpointed; otherwise the step finishes and its
checkpoint is written. All within run.stop_grace_s. Before Ray starts, a probe of run.dir's write
rate estimates a checkpoint's write time and warns in one line when it exceeds run.stop_grace_s.

Failing (a reward, a worker, a mismatch): the checkpoint being written is first given time to
finish (Saves.error_wait_s), watched on the disk, so that the error's line names it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlalign import checkpoint as ckpt
from rlalign.agent import env_class, episode_limits, stop_token_ids
from rlalign.config import model_args
from rlalign.export import TOKENIZER_DIR, keep_tokenizer, model_meta, tokenizer_nbytes
from rlalign.job import Job
from rlalign.logger import Phases, RunLogger, json_line, truncate_jsonl
from rlalign.model import check_hf_dir
from rlalign.parallel.weight_sync import SyncError
from rlalign.rollout.generator import check_generator
from rlalign.rundir import RunLock, claim_run_dir, record_segment, stale_note
from rlalign.step import MismatchError, run_step
from rlalign.stop import Stopped, StopSignals
from rlalign.tasks import make_task
from rlalign.tasks.reward_calls import RewardCall, RewardCaller, RewardError
from rlalign.tasks.tokenizer import make_tokenizer, observation_encoder, tokenizer_dir
from rlalign.training.losses import resolve_loss
from rlalign.training.trainer import checkpoint_nbytes, checkpoint_shapes

__all__ = ["MismatchError", "RewardError", "SyncError", "Stopped", "train", "main"]

# an abandoned step leaves its workers busy (their trace-closing call queues behind it): the idle ones
# answer within this, and the exit stays within the scheduler's kill deadline after run.stop_grace_s
ABANDONED_TRACE_WAIT_S = 2.0
# a failing run waits this long (or 4x the estimated save time, if longer) for the checkpoint being written
SAVE_IN_FLIGHT_MIN_WAIT_S = 60.0
PRUNE_WAIT_S = 30.0  # a stopping run waits at most this long for the older checkpoints' delete after a publish


def _prepare(cfg: DictConfig):
    """All checks that need no actor, so bad input fails in seconds, before Ray starts: the task,
    the reward (called once), every prompt of steps 0..run.steps-1 (it encodes and fits the
    context), the model directory's tensors (headers only), sizes and sampling."""
    t = cfg.task
    task = make_task(t.name, cfg.seed, reward=t.reward, path=t.path, **OmegaConf.to_container(t.kwargs))
    tok = make_tokenizer(t.tokenizer, cfg.model.path, t.chat)
    if cfg.model.path or t.tokenizer:
        print(f"rlalign train: tokenizer: {tok.describe()}", file=sys.stderr, flush=True)
    args = check_hf_dir(cfg.model.path, cfg.model.dtype) if cfg.model.path else model_args(cfg)
    if tok.vocab_size > args.vocab_size:
        raise ValueError(f"{tok.name} has {tok.vocab_size} ids but the model ({cfg.model.path or cfg.model.name}) "
                         f"only {args.vocab_size}")
    check_generator(cfg)
    if cfg.logger.wandb.enabled and importlib.util.find_spec("wandb") is None:  # the extra, asked for before Ray
        raise ModuleNotFoundError("logger=wandb: No module named 'wandb'", name="wandb")
    if t.env:  # the environment's class imports, observations fit the chat template, the limits the model
        env_class(cfg)
        observation_encoder(tok, t.observation_role)
        stop_token_ids(tok, tuple(t.stop))  # each stop string encodes
    context = episode_limits(cfg).max_context_len if t.env else None
    resolve_loss(cfg.algorithm)  # a user's loss (algorithm.loss) imports here, before any actor
    max_new = t.max_new_tokens
    examples = task.all_examples() or [ex for s in range(cfg.run.steps) for ex in task.examples(s, t.num_prompts)]
    for ex in examples:
        where = ex.source or f"task {t.name} prompt {ex.prompt!r}"
        ids = tok.encode(ex.prompt, where=where)
        overflow = args.context_overflow(len(ids), max_new)
        if overflow:
            raise ValueError(f"{where}: the prompt {overflow.replace('max_new_tokens', 'task.max_new_tokens')}")
        if context is not None and len(ids) >= context:
            raise ValueError(f"{where}: the prompt has {len(ids)} tokens, leaving no room for a turn within "
                             f"task.max_context_len={context}")
    rewards = RewardCaller(task, t.reward_timeout_s, t.reward_timeout_fallback, t.reward_workers)
    ex = examples[0]
    where = f"the answer of {ex.source or repr(ex.prompt)} (a check before the run)"
    rewards.score([RewardCall(ex.answer_text(), ex, where)], "the check before the run:")
    return task, tok, rewards


def train(cfg: DictConfig, status: dict | None = None) -> dict:
    """The run (module docstring); its summary. `status` (the CLI's) gets 'run_dir' once the run
    holds its directory, so that an error from then on names the checkpoint to resume from."""
    phase = Phases("rlalign train", cfg.logger.console)  # lines from Ray's start on: an error before is one line
    task, tok, rewards = _prepare(cfg)
    run_dir = Path(cfg.run.dir)
    signals = [*cfg.run.stop_signals, "SIGINT"]  # Ctrl-C stops as a scheduler's SIGTERM does (exit 130)
    with RunLock(run_dir) as lock, StopSignals(signals, cfg.run.stop_grace_s) as stop:
        note = stale_note(lock)
        if note:
            print(f"rlalign train: note: {note}", file=sys.stderr, flush=True)
        note = claim_run_dir(run_dir, cfg.checkpoint.resume, cfg.run.overwrite)  # another run's work: refused
        if note:
            print(f"rlalign train: {note}", file=sys.stderr, flush=True)
        cleared = ckpt.clear_leftovers(run_dir)  # an interrupted run's partial saves and prunes
        if cleared:
            print(f"rlalign train: checkpoints an interrupted run left unfinished: {'; '.join(cleared)}",
                  file=sys.stderr, flush=True)
        resume = ckpt.resolve_resume(run_dir, cfg.checkpoint.resume)
        start = ckpt.read_meta(resume)["step"] + 1 if resume else 0
        if start >= cfg.run.steps:
            print(f"rlalign train: nothing to do: {resume} holds step {start - 1}, so run.steps={cfg.run.steps} are "
                  f"done (raise run.steps to train further)", file=sys.stderr, flush=True)
            return {**summarize(run_dir, cfg.run.steps, start, {}), "nothing_to_do": True,
                    "sync/weights_fp": ckpt.read_meta(resume).get("weights_fp")}
        shapes = checkpoint_shapes(cfg) if resume is not None or cfg.checkpoint.enabled else {}
        if resume is not None:  # a checkpoint of another model fails now, not once the actors have started
            _check_fits(resume, shapes, run_dir, status)
        saves = Saves(cfg, run_dir, start - 1)
        if cfg.checkpoint.enabled:  # before Ray starts: a checkpoint that cannot fit fails now, not after the steps
            parts = checkpoint_parts(cfg, shapes, saves.tokenizer)
            ckpt.check_space(run_dir, parts, range(start, cfg.run.steps), saves.every, cfg.run.steps,
                             cfg.checkpoint.keep)
            saves.measure(sum(parts.values()))
            saves.copy_tokenizer()
        if status is not None:
            status["run_dir"] = run_dir
        if resume is not None:
            print(f"rlalign train: resumed from {resume} (step {start - 1}); running steps "
                  f"{start}..{cfg.run.steps - 1}", file=sys.stderr, flush=True)
        record_segment(run_dir, start, resume, OmegaConf.to_container(cfg, resolve=True),
                       OmegaConf.to_yaml(cfg, resolve=True))
        last = _run(cfg, task, tok, rewards, run_dir, resume, start, stop, saves, phase, status)
    summary = summarize(run_dir, cfg.run.steps, start, last)
    if cfg.logger.console:
        print(f"rlalign train: {done_line(summary, cfg.kernels.mode)}", file=sys.stderr, flush=True)
    return summary


def checkpoint_parts(cfg: DictConfig, shapes: dict | None, tokenizer: str | None) -> dict[str, int]:
    """A checkpoint's bytes by part, as check_space() counts them: the trainer state (checkpoint_nbytes), the
    copy of the run's tokenizer files it keeps (step_N/tokenizer) and, with checkpoint.export_hf, the model in
    its dtype with those files again (step_N/hf)."""
    parts = checkpoint_nbytes(cfg, shapes)
    parts["tokenizer copy"] = tokenizer_nbytes(tokenizer)
    if cfg.checkpoint.export_hf:
        parts["Hugging Face export"] = parts[f"{cfg.model.dtype} weights"] + parts["tokenizer copy"]
    return parts


def _check_fits(resume: Path, shapes: dict, run_dir: Path, status: dict | None) -> None:
    """The checkpoint to resume from holds every tensor of this config's trainer (`shapes`) in its shape and
    dtype, checked on the driver before Ray starts (each trainer rank checks its share again as it loads):
    one of another model is refused in the ranks' words, and the error's line (status['run_dir']) names
    the model it was written with and the command that resumes it."""
    try:
        ckpt.fitting_index(resume, ckpt.read_meta(resume), shapes)
    except ckpt.CheckpointError:
        if status is not None:
            status["run_dir"] = run_dir
        raise


class Saves:
    """The run's checkpoints as the driver sees them: `covered`, the newest step with a checkpoint
    written or being written; `in_flight`, a background save not yet waited for. A save's progress
    is printed from the disk (checkpoint_files.SaveWatch); a failing run waits for the save in
    flight on the disk too (its meta.json appears when trainer rank 0 publishes it), which needs no
    answer from a trainer rank that is busy with a step or dead."""

    def __init__(self, cfg: DictConfig, run_dir: Path, covered: int):
        self.cfg, self.run_dir, self.covered = cfg, run_dir, covered
        self.every = ckpt.checkpoint_every(cfg.checkpoint.every, cfg.run.steps)
        self.in_flight: int | None = None
        self.nbytes, self.save_s = 0, 0.0  # the checkpoint's size and its estimated write time (measure())
        # meta.json records the model and each checkpoint keeps the tokenizer's files (copy_tokenizer), so that
        # `rlalign export` needs nothing but the checkpoint
        self.tokenizer = tokenizer_dir(cfg.task.tokenizer, cfg.model.path)
        self.model = model_meta(model_args(cfg), cfg.model.dtype, self.tokenizer) if cfg.checkpoint.enabled else {}
        self.kept: Path | None = None  # RUN_DIR/tokenizer once copy_tokenizer() has copied it there
        self._watch = None

    def copy_tokenizer(self) -> None:
        """RUN_DIR/tokenizer: a copy of the run's Hugging Face tokenizer files, which each checkpoint then
        keeps (step_N/tokenizer), made once at the start and read by the trainer rank that publishes a
        checkpoint (the run dir is shared storage); none for the built-in char tokenizer, which an export
        writes out."""
        d = self.run_dir / TOKENIZER_DIR
        keep_tokenizer(self.tokenizer, d)
        self.kept = d.resolve() if self.tokenizer is not None else None

    def measure(self, nbytes: int) -> None:
        """The write rate of run.dir's checkpoints directory (a probe file, removed): the estimated
        save time, and one line when it exceeds run.stop_grace_s."""
        d = ckpt.checkpoint_dir(self.run_dir)
        rate = ckpt.measure_write_rate(d, ckpt.probe_bytes(nbytes))
        self.nbytes, self.save_s = nbytes, nbytes / rate
        warning = ckpt.grace_warning(nbytes, rate, self.cfg.run.stop_grace_s, d, self.every)
        if warning:
            print(f"rlalign train: warning: {warning}", file=sys.stderr, flush=True)

    @property
    def error_wait_s(self) -> float:
        """How long a failing run waits for the save in flight."""
        return max(SAVE_IN_FLIGHT_MIN_WAIT_S, 4 * self.save_s)

    def save(self, job: Job, step: int, weights_fp: str, wait: bool) -> float:
        """The checkpoint of `step`: staged now; written (and published by trainer rank 0) in the
        background unless `wait`. Returns the trainer ranks' staging time."""
        tmp = ckpt.tmp_path(self.run_dir, step)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        publish = {"run_dir": str(self.run_dir.resolve()), "step": step, "keep": self.cfg.checkpoint.keep,
                   "export_hf": self.cfg.checkpoint.export_hf, "tokenizer": str(self.kept) if self.kept else None,
                   "meta": {"data_position": step + 1, "weights_fp": weights_fp, **self.model}}
        self.close()
        self._watch = ckpt.SaveWatch(self.run_dir, step, self.nbytes)
        staging_s, said = job.save_checkpoint(str(tmp.resolve()), publish, wait)
        for line in said:  # the trainer's choice of staging, once
            print(f"rlalign train: {line}", file=sys.stderr, flush=True)
        self.covered, self.in_flight = step, None if wait else step
        return staging_s

    def wait(self, job: Job) -> None:
        """Until the save in flight is complete (its CheckpointError if it could not be written)."""
        try:
            job.wait_checkpoint()
        finally:
            self.in_flight = None

    def wait_on_disk(self, timeout_s: float | None) -> Path | None:
        """The save in flight, once published (None: it failed, or not within timeout_s)."""
        step, self.in_flight = self.in_flight, None
        return ckpt.wait_published(self.run_dir, step, timeout_s) if step is not None else None

    def wait_pruned(self) -> None:
        """Until the prune that follows a publish is over (a run that exits now would cut a delete short)."""
        ckpt.wait_pruned(self.run_dir, self.cfg.checkpoint.keep, PRUNE_WAIT_S)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None


def _run(cfg: DictConfig, task, tok, rewards: RewardCaller, run_dir: Path, resume: Path | None, start: int,
         stop: StopSignals, saves: Saves, phase: Phases, status: dict | None = None) -> dict:
    """Steps start..run.steps-1 on the actor groups; the last step's metrics (_Run)."""
    return _Run(cfg, task, tok, rewards, run_dir, resume, start, stop, saves, phase, status).run()


class _Run:
    """Steps start..run.steps-1 on the actor groups (train() holds the run dir and the signals)."""

    def __init__(self, cfg: DictConfig, task, tok, rewards: RewardCaller, run_dir: Path, resume: Path | None,
                 start: int, stop: StopSignals, saves: Saves, phase: Phases, status: dict | None = None):
        self.cfg, self.task, self.tok, self.rewards, self.phase = cfg, task, tok, rewards, phase
        self.status = status if status is not None else {}  # the CLI's: 'damaged', a checkpoint that did not load
        self.run_dir, self.resume, self.start, self.stop, self.saves = run_dir, resume, start, stop, saves
        self.job: Job | None = None
        self.logger: RunLogger | None = None
        self.done, self.weights_fp = start - 1, ""  # the last step done (logged) and its weights' fingerprint
        self.doing, self.last = "while starting the actors", {}
        stop.plan = self.stop_plan

    def stop_plan(self) -> str | None:
        """At a stop signal (in its handler): what stopping at once does, or None to finish the step in
        flight first (its update has begun, and no checkpoint covers the step before it)."""
        if not self.cfg.checkpoint.enabled:
            return "checkpoint.enabled=false, nothing to save"
        if self.saves.covered >= self.done:
            if self.done < self.start:
                return "no step of this run has finished"
            return (f"the checkpoint of step {self.done} covers the steps done"
                    + (" (waiting for its write)" if self.saves.in_flight is not None else ""))
        trained = self.job.trainer_step if self.job is not None else None
        if trained is None or trained <= self.done:
            return f"writing the checkpoint of step {self.done} (the step in flight has not changed the trainer)"
        return None

    def run(self) -> dict:
        """The last step's metrics. A stop signal ends it with Stopped (rlalign.stop); an error first
        lets the checkpoint being written finish (within Saves.error_wait_s)."""
        truncate_jsonl(self.run_dir / "divergence.jsonl", self.start)
        try:
            self._start()
            for step in range(self.start, self.cfg.run.steps):
                if self.stop.requested:  # after the step the signal came in: its checkpoint, then stop
                    raise self._stop_between_steps(step)
                self.doing = f"during step {step}"
                self._step(step)
            self.doing = f"while writing the checkpoint of step {self.cfg.run.steps - 1}"
            self.saves.wait(self.job)  # the last checkpoint is complete before the run ends
            self.job.close_traces()
        except Stopped:
            raise
        except KeyboardInterrupt:
            if not self.stop.requested:
                raise
            raise self._stopped_now() from None
        except Exception as e:
            self._failed(e)
            raise
        finally:
            self._close()
        return self.last

    def _start(self) -> None:
        job = self.job = Job(self.cfg, self.phase)
        job.open_traces(self.start)
        if self.resume is not None:
            self.phase(f"loading {self.resume}")
            try:
                job.load_checkpoint(str(self.resume.resolve()))
            except Exception:
                self._check_loaded()
                raise
        self.phase("the first weight sync, trainer -> generator")
        self.weights_fp = job.sync_weights(self.start - 1).weights_fp
        self.phase(f"running steps {self.start}..{self.cfg.run.steps - 1} (the first one warms up)")
        self.logger = RunLogger(self.cfg, self.run_dir, self.start, self.cfg.run.steps)

    def _check_loaded(self) -> None:
        """After the trainer ranks failed to load the checkpoint: when its bytes no longer match the fingerprints
        of its meta.json (read again here), status['damaged'] names it, so that the error's resume command
        names another checkpoint (checkpoint.resume=auto, which checks the files but not their data, would
        pick it again)."""
        try:
            ckpt.verify(self.resume, tensors=True)
        except ckpt.CheckpointError:
            self.status["damaged"] = self.resume

    def _step(self, step: int) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        result = run_step(self.job, cfg, self.task, self.tok, self.rewards, step, self.weights_fp)
        metrics = result.metrics
        if "consistency/alert" in metrics:
            self.logger.alert("generator/trainer mismatch", metrics.pop("consistency/alert"))
        t1 = time.perf_counter()
        metrics["time/checkpoint_staging_s"] = 0.0  # the trainer's copy into host buffers (a staged save)
        if ckpt.is_due(step, self.saves.every, cfg.run.steps) and cfg.checkpoint.enabled:
            metrics["time/checkpoint_staging_s"] = self.saves.save(self.job, step, result.weights_fp,
                                                                   wait=not cfg.checkpoint.async_save)
        metrics["time/checkpoint_s"] = time.perf_counter() - t1
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["time/step_tok_per_s"] = (metrics["prompt/tokens"] + metrics["response/tokens"]) / metrics[
            "time/step_s"]
        self.logger.log(step, metrics, result.detail)
        self.logger.log_samples(step, result.samples)
        self.last, self.weights_fp, self.done = metrics, result.weights_fp, step

    def _stop_between_steps(self, step: int) -> Stopped:
        """A stop signal came during the last step, which is done now: its checkpoint, then Stopped."""
        if step > self.start:
            self.doing = f"while writing the checkpoint of step {step - 1}"
            if self.cfg.checkpoint.enabled and self.saves.covered < step - 1:
                self.saves.save(self.job, step - 1, self.weights_fp, wait=True)
            self.saves.wait(self.job)
        return self.stop.stopped(f"after step {step - 1} and its checkpoint" if step > self.start else
                                 f"before step {step}")

    def _stopped_now(self) -> Stopped:
        """Stopped for a stop signal that interrupted the run: cut at once (stop_plan), after the checkpoint
        that covers the steps done is complete; or abandoned (past run.stop_grace_s, or a second signal)."""
        stop, k = self.stop, self.done
        if stop.cut and not stop.abandoned:
            try:
                if not self.cfg.checkpoint.enabled:
                    return stop.stopped(f"{self.doing}, at once (checkpoint.enabled=false: nothing to save)")
                if k < self.start:
                    return stop.stopped(f"{self.doing}, at once: no step of this run had finished")
                if self.saves.covered >= k:
                    self.doing = f"while waiting for the checkpoint of step {k} being written"
                    done = ckpt.published(self.run_dir, k) or self.saves.wait_on_disk(None)
                    if done is not None:  # complete: what may outlast the grace now is the prune after it
                        self.doing = (f"while removing the checkpoints before step {k} (checkpoint.keep="
                                      f"{self.cfg.checkpoint.keep}), the checkpoint of step {k} complete")
                    self.saves.wait_pruned()
                    if done is None:
                        return stop.stopped(f"during step {k + 1}: the checkpoint of step {k} could not be written")
                    return stop.stopped(f"during step {k + 1}, at once: the checkpoint of step {k} covers the steps "
                                        f"done (no new save)")
                self.doing = f"while writing the checkpoint of step {k}"
                self.saves.save(self.job, k, self.weights_fp, wait=True)
                return stop.stopped(f"during step {k + 1}, at once, after writing the checkpoint of step {k} "
                                    f"(the step in flight had not changed the trainer)")
            except KeyboardInterrupt:  # the grace period ended, or a second signal came
                pass
        return stop.stopped(f"{self.doing} (abandoned: not done within run.stop_grace_s={stop.grace_s:g} s, or "
                            f"signalled again)")

    def _failed(self, e: Exception) -> None:
        """The run failed: first the checkpoint being written (within Saves.error_wait_s), so that the error's
        line names it; a stop signal meanwhile ends the wait (Stopped)."""
        if self.stop.requested:  # e.g. the signal reached the actors too (Slurm signals every process of the job)
            raise self.stop.stopped(f"{self.doing} ({type(e).__name__}: {e})") from e
        step = self.saves.in_flight
        if step is None:
            return
        if ckpt.published(self.run_dir, step) is not None:
            self.saves.wait_pruned()
            return
        bound = self.saves.error_wait_s
        print(f"rlalign train: {type(e).__name__} {self.doing}; waiting up to {bound:.0f} s for the checkpoint of "
              f"step {step} being written", file=sys.stderr, flush=True)
        self.stop.plan = lambda: "no longer waiting for the checkpoint being written"
        try:
            done = self.saves.wait_on_disk(bound)
        except KeyboardInterrupt:
            raise self.stop.stopped(f"{self.doing} ({type(e).__name__}: {e})") from e
        if done is not None:
            self.saves.wait_pruned()
            what = f"is complete: {done}"
        elif ckpt.tmp_path(self.run_dir, step).is_dir():
            what = f"was not written within {bound:.0f} s (left as a .tmp, which resume ignores)"
        else:
            what = "could not be written (its .tmp is gone)"
        print(f"rlalign train: the checkpoint of step {step} {what}", file=sys.stderr, flush=True)

    def _close(self) -> None:
        self.stop.disarm()
        self.saves.close()
        if self.logger is not None:
            self.logger.close()
        if self.job is not None:  # a step cut short or abandoned: a worker busy with it never answers
            busy = self.stop.abandoned or self.stop.cut
            self.job.close(trace_timeout_s=ABANDONED_TRACE_WAIT_S if busy else 30.0)


def summarize(run_dir: Path, steps: int, start: int, last: dict) -> dict:
    """The run in one JSON object (from metrics.jsonl when present). reward_first5/reward_last5: the
    mean reward of the first/last min(5, steps) steps; reward_gain: the mean of the last k steps minus
    that of the first k, k = max(1, steps // 4) (reward_gain_k), so that a short run's gain compares
    its own beginning and end instead of the same steps twice."""
    out = {"run_dir": str(run_dir), "steps": steps, "start_step": start}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        r = [row["reward/mean"] for row in rows]
        k = min(5, len(r))
        if k:
            out["reward_first5"] = sum(r[:k]) / k
            out["reward_last5"] = sum(r[-k:]) / k
            g = max(1, len(r) // 4)
            out["reward_gain"] = sum(r[-g:]) / g - sum(r[:g]) / g
            out["reward_gain_k"] = g
        out["mismatched_tokens_total"] = sum(row["consistency/mismatched_tokens"] for row in rows)
        out["tokens_total"] = sum(row["consistency/tokens"] for row in rows)
        out["step_s_mean"] = sum(row["time/step_s"] for row in rows) / max(1, len(rows))
    out.update({k: last[k] for k in ("sync/weights_fp",) if k in last})
    return out


def done_line(summary: dict, kernels_mode: str) -> str:
    """The finished run in one line: where it is, and how its generator and trainer compared over every step
    of metrics.jsonl ('0 of 31788 tokens differ ...')."""
    n, of = summary.get("mismatched_tokens_total"), summary.get("tokens_total")
    line = f"done: run.steps={summary['steps']} in {summary['run_dir']}"
    if n is not None:
        line += (f"; {n} of {of} tokens differ between the generator's and the trainer's logprobs "
                 f"(kernels.mode={kernels_mode})")
    return line


def main(cfg: DictConfig, status: dict | None = None) -> int:
    summary = train(cfg, status)
    print(json_line(summary), flush=True)
    return 0
