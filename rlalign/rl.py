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
a finished job); run.stop_signals (SIGTERM) finish the step and its checkpoint, then stop
(rlalign.stop); segments.jsonl keeps the config of every start.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlalign import checkpoint as ckpt
from rlalign.config import model_args
from rlalign.factory import sampling_params
from rlalign.job import Job
from rlalign.logger import RunLogger, json_line, truncate_jsonl
from rlalign.model import check_hf_dir
from rlalign.parallel.weight_sync import SyncError
from rlalign.rollout.generator import generator_plan
from rlalign.rundir import RunLock, record_segment, stale_note
from rlalign.step import MismatchError, run_step
from rlalign.stop import Stopped, StopSignals
from rlalign.tasks import make_task
from rlalign.tasks.reward_calls import RewardCall, RewardCaller, RewardError
from rlalign.tasks.tokenizer import make_tokenizer
from rlalign.training.state import checkpoint_nbytes

__all__ = ["MismatchError", "RewardError", "SyncError", "Stopped", "train", "main"]

# an abandoned step leaves its workers busy (their trace-closing call queues behind it): the idle ones
# answer within this, and the exit stays within the scheduler's kill deadline after run.stop_grace_s
ABANDONED_TRACE_WAIT_S = 2.0


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
    generator_plan(cfg)
    max_new = sampling_params(cfg, tok.eos_token_id, 0, cfg.task.max_new_tokens).max_new_tokens
    examples = task.all_examples() or [ex for s in range(cfg.run.steps) for ex in task.examples(s, t.num_prompts)]
    for ex in examples:
        where = ex.source or f"task {t.name} prompt {ex.prompt!r}"
        ids = tok.encode(ex.prompt, where=where)
        if len(ids) + max_new > args.max_position_embeddings:
            raise ValueError(f"{where}: the prompt has {len(ids)} tokens; with max_new_tokens={max_new} it exceeds "
                             f"the model's context of {args.max_position_embeddings} positions")
    rewards = RewardCaller(task, t.reward_timeout_s, t.reward_timeout_fallback, t.reward_workers)
    ex = examples[0]
    where = f"the answer of {ex.source or repr(ex.prompt)} (a check before the run)"
    rewards.score([RewardCall(ex.answer_text(), ex, where)], "the check before the run:")
    return task, tok, rewards


def train(cfg: DictConfig, status: dict | None = None) -> dict:
    """The run (module docstring); its summary. `status` (the CLI's) gets 'run_dir' once the run
    holds its directory, so that an error from then on names the checkpoint to resume from."""
    task, tok, rewards = _prepare(cfg)
    run_dir = Path(cfg.run.dir)
    with RunLock(run_dir) as lock, StopSignals(list(cfg.run.stop_signals), cfg.run.stop_grace_s) as stop:
        note = stale_note(lock)
        if note:
            print(f"rlalign train: note: {note}", file=sys.stderr, flush=True)
        resume = ckpt.resolve_resume(run_dir, cfg.checkpoint.resume)
        start = ckpt.read_meta(resume)["step"] + 1 if resume else 0
        if start >= cfg.run.steps:
            print(f"rlalign train: nothing to do: {resume} holds step {start - 1}, so run.steps={cfg.run.steps} are "
                  f"done (raise run.steps to train further)", file=sys.stderr, flush=True)
            return {**summarize(run_dir, cfg.run.steps, start, {}), "nothing_to_do": True,
                    "sync/weights_fp": ckpt.read_meta(resume).get("weights_fp")}
        if cfg.checkpoint.enabled:  # before Ray starts: a checkpoint that cannot fit fails now, not after the steps
            ckpt.check_space(run_dir, checkpoint_nbytes(cfg), range(start, cfg.run.steps), cfg.checkpoint.every,
                             cfg.run.steps, cfg.checkpoint.keep)
        if status is not None:
            status["run_dir"] = run_dir
        if resume is not None:
            print(f"rlalign train: resumed from {resume} (step {start - 1}); running steps "
                  f"{start}..{cfg.run.steps - 1}", file=sys.stderr, flush=True)
        record_segment(run_dir, start, resume, OmegaConf.to_container(cfg, resolve=True),
                       OmegaConf.to_yaml(cfg, resolve=True))
        last = _run(cfg, task, tok, rewards, run_dir, resume, start, stop)
    return summarize(run_dir, cfg.run.steps, start, last)


def _save(job: Job, cfg: DictConfig, run_dir: Path, step: int, weights_fp: str, wait: bool) -> None:
    """The checkpoint of `step`: staged now; written (and published by trainer rank 0) in the
    background unless `wait`."""
    tmp = ckpt.tmp_path(run_dir, step)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    publish = {"run_dir": str(run_dir.resolve()), "step": step, "keep": cfg.checkpoint.keep,
               "meta": {"data_position": step + 1, "weights_fp": weights_fp}}
    job.save_checkpoint(str(tmp.resolve()), publish, wait)


def _run(cfg: DictConfig, task, tok, rewards: RewardCaller, run_dir: Path, resume: Path | None, start: int,
         stop: StopSignals) -> dict:
    """Steps start..run.steps-1 on the actor groups; the last step's metrics. A stop signal ends
    the loop after the step in flight and its checkpoint (Stopped); one past the grace period
    abandons the step (Stopped, abandoned)."""
    job = logger = None
    last: dict = {}
    doing = "while starting the actors"
    truncate_jsonl(run_dir / "divergence.jsonl", start)
    try:
        job = Job(cfg)
        job.open_traces(start)
        if resume is not None:
            job.load_checkpoint(str(resume.resolve()))
        weights_fp = job.sync_weights(start - 1).weights_fp

        logger = RunLogger(cfg, run_dir, start, cfg.run.steps)
        every, saved = cfg.checkpoint.every, True  # step start-1 is the resumed checkpoint (or before any)
        for step in range(start, cfg.run.steps):
            if stop.requested:  # before the next step: the last one's checkpoint, then stop
                if step > start:
                    doing = f"while writing the checkpoint of step {step - 1}"
                    if not saved:
                        _save(job, cfg, run_dir, step - 1, weights_fp, wait=True)
                    job.wait_checkpoint()
                raise stop.stopped(f"after step {step - 1} and its checkpoint" if step > start else
                                   f"before step {step}")
            doing = f"during step {step}"
            t0 = time.perf_counter()
            result = run_step(job, cfg, task, tok, rewards, step, weights_fp)
            metrics, weights_fp = result.metrics, result.weights_fp
            if "consistency/alert" in metrics:
                logger.alert("generator/trainer mismatch", metrics.pop("consistency/alert"))
            t1 = time.perf_counter()
            due = ckpt.is_due(step, every, cfg.run.steps)
            saved = due or not cfg.checkpoint.enabled  # nothing left to save (checkpoint.enabled=false: none at all)
            if due and cfg.checkpoint.enabled:
                _save(job, cfg, run_dir, step, weights_fp, wait=not cfg.checkpoint.async_save)
            metrics["time/checkpoint_s"] = time.perf_counter() - t1
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics["time/step_tok_per_s"] = (metrics["prompt/tokens"] + metrics["response/tokens"]) / metrics[
                "time/step_s"]
            logger.log(step, metrics, result.detail)
            logger.log_samples(step, result.samples)
            last = metrics
        doing = f"while writing the checkpoint of step {cfg.run.steps - 1}"
        job.wait_checkpoint()  # the last checkpoint is complete before the run ends
        job.close_traces()
    except Stopped:
        raise
    except KeyboardInterrupt:
        if stop.abandoned:  # the grace period ended, or a second signal came (not Ctrl-C: that stays 130)
            raise stop.stopped(f"{doing} (abandoned: not done within run.stop_grace_s={stop.grace_s:g} s, or "
                               f"signalled again)") from None
        raise
    except Exception as e:
        if stop.requested:  # e.g. the signal reached the actors too (Slurm signals every process of the job)
            raise stop.stopped(f"{doing} ({type(e).__name__}: {e})") from e
        raise
    finally:
        stop.disarm()
        if logger is not None:
            logger.close()
        if job is not None:  # abandoned: a worker busy with the step never answers, so no 30 s wait for it
            job.close(trace_timeout_s=ABANDONED_TRACE_WAIT_S if stop.abandoned else 30.0)
    return last


def summarize(run_dir: Path, steps: int, start: int, last: dict) -> dict:
    """The run in one JSON object (from metrics.jsonl when present)."""
    out = {"run_dir": str(run_dir), "steps": steps, "start_step": start}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        r = [row["reward/mean"] for row in rows]
        k = min(5, len(r))
        if k:
            out["reward_first5"] = sum(r[:k]) / k
            out["reward_last5"] = sum(r[-k:]) / k
            out["reward_gain"] = out["reward_last5"] - out["reward_first5"]
        out["mismatched_tokens_total"] = sum(row["consistency/mismatched_tokens"] for row in rows)
        out["tokens_total"] = sum(row["consistency/tokens"] for row in rows)
        out["step_s_mean"] = sum(row["time/step_s"] for row in rows) / max(1, len(rows))
    out.update({k: last[k] for k in ("sync/weights_fp",) if k in last})
    return out


def main(cfg: DictConfig, status: dict | None = None) -> int:
    summary = train(cfg, status)
    print(json_line(summary), flush=True)
    return 0
