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

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlalign import checkpoint as ckpt
from rlalign.config import model_args
from rlalign.factory import model_from_config, sampling_params
from rlalign.logger import RunLogger, json_line, truncate_jsonl
from rlalign.model import check_hf_dir, save_hf
from rlalign.monitor.consistency import compare
from rlalign.monitor.divergence import report, tap_order
from rlalign.parallel import weight_sync
from rlalign.parallel.launch import shard_range
from rlalign.parallel.weight_sync import SyncError
from rlalign.rollout.generator import generator_plan, releases_memory
from rlalign.rollout.types import Rollout, SamplingParams
from rlalign.rundir import RunLock, record_segment, stale_note
from rlalign.stop import Stopped, StopSignals
from rlalign.tasks import Example, make_task
from rlalign.tasks.reward_calls import RewardCall, RewardCaller, RewardError
from rlalign.tasks.tokenizer import make_tokenizer
from rlalign.training.losses import grpo_advantages
from rlalign.training.plan import Sample, merge_stat
from rlalign.training.state import checkpoint_nbytes
from rlalign.workers import GeneratorWorker, TrainerWorker

__all__ = ["MismatchError", "RewardError", "SyncError", "Stopped", "train", "main"]

# an abandoned step leaves its workers busy (their trace-closing call queues behind it): the idle ones
# answer within this, and the exit stays within the scheduler's kill deadline after run.stop_grace_s
ABANDONED_TRACE_WAIT_S = 2.0


class MismatchError(RuntimeError):
    pass


def step_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


def _prepare(cfg: DictConfig):
    """All checks that need no actor, so bad input fails in seconds, before Ray starts: the task,
    the reward (called once), every prompt of steps 0..run.steps-1 (it encodes and fits the
    context), the model directory's tensors (headers only), sizes and sampling."""
    t = cfg.task
    task = make_task(t.name, cfg.seed, reward=t.reward, path=t.path, **OmegaConf.to_container(t.kwargs))
    tok = make_tokenizer(t.tokenizer)
    args = check_hf_dir(cfg.model.path, cfg.model.dtype) if cfg.model.path else model_args(cfg)
    if tok.vocab_size > args.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model only {args.vocab_size}")
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
    rewards.score([RewardCall(ex.answer, ex, f"the answer of {ex.source or repr(ex.prompt)} (a check before the run)")],
                  "the check before the run:")
    return task, tok, rewards


class Job:
    """The driver's view of the two actor groups."""

    def __init__(self, cfg: DictConfig):
        from rlalign import cluster
        from rlalign.actors.group import ActorGroup
        from rlalign.actors.placement import Placement
        from rlalign.actors.probe import check_shared_dir

        self.cfg = cfg
        self.own_ray = cluster.connect(cfg.placement.num_cpus)  # RAY_ADDRESS's cluster, else a private one
        n, m = cfg.trainer.ep_size, generator_plan(cfg).ranks
        self.placement = Placement.create(cfg, [("trainer", n), ("generator", m)])  # from the cluster's nodes
        print(f"rlalign train: {self.placement.describe()}", file=sys.stderr, flush=True)
        check_shared_dir(Path(cfg.run.dir), {s.node for g in self.placement.slots.values() for s in g})
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        cfg_dict["run"]["dir"] = str(Path(cfg.run.dir).resolve())  # the ranks' working directory is not ours
        self.trainers = ActorGroup("trainer", TrainerWorker, n, cfg_dict, self.placement)
        self.generators = ActorGroup("generator", GeneratorWorker, m, cfg_dict, self.placement)
        self.sync_specs = None  # the weight sync's tensors, once its process group is up
        self.ipc = self.placement.transport == "ipc"
        self.last_sync: dict = {}  # the latest sync's bytes, buckets and per-side seconds (step metrics)
        self.weights_fp: str | None = None
        self.trainer_gc_s = 0.0  # the step's longest time in Python's garbage collector on a trainer rank
        self.peaks: dict[str, float | None] = {}  # role -> the step's peak GPU memory of its busiest rank, GiB
        self.inner: dict[str, float] = {}  # per-step metrics from inside the workers (slowest rank): seconds, GiB
        # colocated on CUDA the generator gives its memory back after generating (until the weight sync);
        # its weights too unless a mismatch dump may read them (deterministic kernels, on_mismatch=raise)
        self.release = releases_memory(cfg)
        self.generator_need = 0  # bytes the trainer leaves free on a shared GPU after its step
        self.trainer_sync = None  # the direct sync's trainer side, from the last train step (one trainer rank)
        self.release_weights = not (cfg.kernels.mode == "deterministic" and cfg.monitor.on_mismatch == "raise")

    def open_traces(self, start_step: int) -> None:
        self.trainers.call("open_trace", start_step)
        self.generators.call("open_trace", start_step)

    def sync_weights(self, step: int) -> str:
        """The trainer's weights into the generator group; both sides' fingerprints compared
        (SyncError names the first tensor that differs). Returns the weights' combined fingerprint."""
        from rlalign.actors.group import call_together

        if self.sync_specs is None:
            self._open_weight_sync()
        if self.ipc:
            direct = self.trainers.world == 1 and self.generators.world == 1
            taken, self.trainer_sync = self.trainer_sync, None
            t_outs = [taken] if direct and taken is not None else self.trainers.call("send_weights", True, direct)
            g_outs = self.generators.call("receive_weights", step, t_outs[0].ipc, t_outs[0].device_uuid, direct)
            if not direct:
                self.trainers.call("release_weights")
        else:
            t_outs, g_outs = call_together([(self.trainers, "send_weights", self.trainers.submit("send_weights")),
                                            (self.generators, "receive_weights",
                                             self.generators.submit("receive_weights", step))])
        fps = weight_sync.merge(self.sync_specs, [o.shares for o in t_outs], "trainer", dense_on_all=False)
        gen = weight_sync.merge(self.sync_specs, [o.shares for o in g_outs], "generator", dense_on_all=True)
        self.last_sync = {"sync/bytes": t_outs[0].bytes, "sync/buckets": t_outs[0].buckets,
                          "time/sync_trainer_s": max(o.seconds for o in t_outs),
                          "time/sync_generator_s": max(o.seconds for o in g_outs),
                          "time/sync_resume_s": max(o.resume_seconds for o in g_outs),
                          "time/sync_generator_call_s": max(o.call_seconds for o in g_outs)}
        self.weights_fp = weight_sync.check(fps, gen)  # what the generator holds now (mismatch dumps name it)
        return self.weights_fp

    def _open_weight_sync(self) -> None:
        """Plans on both sides (compared), then the trainer-rank-0 + generator-ranks process group
        (not needed colocated on CUDA: CUDA IPC through Ray)."""
        from rlalign.actors.group import call_together

        bucket_bytes = self.cfg.sync.bucket_mb << 20
        m = self.generators.world
        host = self.placement.slots["trainer"][0].node.address  # the sync group meets at trainer rank 0's node
        (t_specs, port), *_ = self.trainers.call("prepare_weight_sync", bucket_bytes, 0 if self.ipc else 1 + m, host)
        (g_specs, _), *_ = self.generators.call("prepare_weight_sync", bucket_bytes)
        weight_sync.check_specs(t_specs, g_specs)
        if not self.ipc:
            n = self.trainers.world
            call_together([
                (self.trainers, "join_weight_sync", self.trainers.submit(
                    "join_weight_sync", per_rank=[(host, port, 0 if r == 0 else -1, 1 + m) for r in range(n)])),
                (self.generators, "join_weight_sync", self.generators.submit(
                    "join_weight_sync", per_rank=[(host, port, 1 + g, 1 + m) for g in range(m)])),
            ])
        self.sync_specs = t_specs

    def close_traces(self, timeout_s: float | None = None) -> None:
        """Every worker writes the trace records still on their way back from its device and closes
        its stream. timeout_s (best effort, before the actors are killed after a failure): a worker
        that died or does not answer in time is left; its stream ends where its process did."""
        import ray

        groups = [g for g in (getattr(self, "trainers", None), getattr(self, "generators", None)) if g is not None]
        if timeout_s is None:
            for g in groups:
                g.call("close_trace")
            return
        refs = [ref for g in groups for ref in g.submit("close_trace")]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:  # the run is failing already; this error is not its cause
                pass

    def close(self, trace_timeout_s: float = 30.0) -> None:
        from rlalign import cluster

        self.close_traces(timeout_s=trace_timeout_s)
        for g in (getattr(self, "trainers", None), getattr(self, "generators", None)):
            if g is not None:
                g.kill()
        if getattr(self, "placement", None) is not None:
            self.placement.remove()
        cluster.disconnect(getattr(self, "own_ray", False))


@dataclass
class StepBatch:
    """One step's work: the examples (each prompt repeated samples_per_prompt times), their
    token ids, their sample ids (a pure function of the step) and the sampling parameters."""

    examples: list[Example]
    prompts: list[list[int]]
    sample_ids: list[int]
    params: SamplingParams


def make_batch(cfg: DictConfig, task, tok, step: int) -> StepBatch:
    P, G = cfg.task.num_prompts, cfg.task.samples_per_prompt
    examples = [ex for ex in task.examples(step, P) for _ in range(G)]
    prompts = [tok.encode(ex.prompt, where=f"step {step} prompt") for ex in examples]
    params = sampling_params(cfg, tok.eos_token_id, step_seed(cfg.seed, step), cfg.task.max_new_tokens)
    return StepBatch(examples, prompts, [step * P * G + i for i in range(P * G)], params)


def generate_rollouts(job: Job, batch: StepBatch, step: int) -> tuple[list[Rollout], dict]:
    """The generator group's rollouts in sample order, and its per-token row fingerprints."""
    m = job.generators.world
    parts = [list(shard_range(len(batch.prompts), m, r)) for r in range(m)]
    outs = job.generators.call("generate", per_rank=[
        ([batch.prompts[i] for i in p], [batch.sample_ids[i] for i in p], batch.params, step, job.release,
         job.release_weights) for p in parts])
    job.peaks["generator"] = _max_peak(outs)
    if job.release and outs[0].peak_bytes is not None:  # what it takes back, with room for the allocator's rounding
        job.generator_need = max(o.peak_bytes for o in outs) + (2 << 30)
    held = [o.held_bytes for o in outs if o.held_bytes is not None]
    job.inner.pop("memory/generator_released_gib", None)
    if held:  # what the generator still holds while the trainer trains
        job.inner["memory/generator_released_gib"] = max(held) / 2**30
    job.inner["time/generate_engine_s"] = max(o.seconds for o in outs)
    job.inner["time/generate_monitor_s"] = max(o.monitor_s for o in outs)
    return [r for o in outs for r in o.rollouts], {k: v for o in outs for k, v in o.rows.items()}


def _max_peak(outs) -> float | None:
    """The largest of a group's per-rank peak allocated GPU memory, GiB (None on the CPU)."""
    peaks = [o.peak_bytes for o in outs if o.peak_bytes is not None]
    return max(peaks) / 2**30 if peaks else None


def score_rewards(rewards: RewardCaller, tok, batch: StepBatch, rollouts: list[Rollout],
                  step: int) -> tuple[list[float], list[str], int]:
    """The rewards in sample order, the completions, and how many calls timed out (fallback used)."""
    calls, texts = [], []
    for ex, r in zip(batch.examples, rollouts):
        completion = tok.decode(r.tokens[:-1] if r.finish_reason == "eos" else r.tokens)
        texts.append(completion)
        calls.append(RewardCall(completion, ex, f"sample {r.sample_id} (step {step}, prompt {ex.prompt!r}, "
                                                f"completion {completion!r})"))
    values, timed_out = rewards.score(calls, f"step {step}")
    return values, texts, timed_out


def train_on(job: Job, cfg: DictConfig, batch: StepBatch, rollouts: list[Rollout], adv: list[float],
             step: int) -> tuple[list[torch.Tensor], dict[str, float], dict]:
    """One update of the trainer group on the whole step (each rank runs its share of the fixed
    micro-batch partition); pre-update logprobs in sample order, stats merged in (epoch,
    minibatch, micro-batch) order, so they do not depend on the number of ranks; rows."""
    samples = [Sample(p, r.tokens, r.logprobs, a, r.sample_id) for p, r, a in zip(batch.prompts, rollouts, adv)]
    alg = OmegaConf.to_container(cfg.algorithm, resolve=True)
    outs = job.trainers.call("train_step", samples, alg, step, job.generator_need)
    job.peaks["trainer"] = _max_peak(outs)
    job.trainer_gc_s = max((o.gc_s for o in outs), default=0.0)
    job.inner["time/train_trainer_s"] = max(o.seconds for o in outs)
    job.inner["time/train_monitor_s"] = max(o.monitor_s for o in outs)
    job.trainer_sync = outs[0].sync if len(outs) == 1 else None
    lps = {i: lp for o in outs for i, lp in o.logprobs.items()}
    stats: dict[str, float] = {}
    for _, st in sorted((rec for o in outs for rec in o.stats), key=lambda rec: rec[0]):
        for k, v in st.items():
            stats[k] = v if k.endswith("_last") else merge_stat(k, stats.get(k), v)
    return [lps[i] for i in range(len(samples))], stats, {k: v for o in outs for k, v in o.rows.items()}


def step_metrics(cfg: DictConfig, rewards: list[float], rollouts: list[Rollout], cons: dict,
                 stats: dict[str, float]) -> dict:
    N = len(rollouts)
    upd_tokens = max(1, cons["tokens"] * cfg.algorithm.ppo_epochs)
    lengths = [len(r.tokens) for r in rollouts]
    sampled = torch.cat([r.logprobs.double() for r in rollouts]) if rollouts else torch.zeros(0, dtype=torch.float64)
    metrics = {
        "reward/mean": sum(rewards) / N,
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "prompt/tokens": sum(len(r.prompt) for r in rollouts),
        "prompt/length_mean": sum(len(r.prompt) for r in rollouts) / N,
        "response/tokens": sum(lengths),
        "response/length_mean": sum(lengths) / N,
        "response/length_min": min(lengths),
        "response/length_max": max(lengths),
        "response/clip_frac": sum(r.finish_reason == "length" for r in rollouts) / N,  # stopped by max_new_tokens
        "response/eos_frac": sum(r.finish_reason == "eos" for r in rollouts) / N,
        # mean -log p of the sampled tokens under the generator: the Monte-Carlo estimate of the
        # per-token entropy of the sampling distribution
        "response/entropy": float(-sampled.mean()) if sampled.numel() else 0.0,
        **{f"consistency/{k}": v for k, v in cons.items()},
        "actor/pg_loss": stats.get("pg_loss_sum", 0.0) / upd_tokens,
        "actor/clip_frac": stats.get("clipped_sum", 0.0) / upd_tokens,
        "actor/ratio_mean": stats.get("ratio_sum", 0.0) / upd_tokens,
        "actor/ratio_max": stats.get("ratio_max", 0.0),
        "actor/ratio_min": stats.get("ratio_min", 0.0),
        "actor/grad_norm": stats.get("grad_norm_last", 0.0),
        "actor/lr": cfg.trainer.lr,
    }
    if cfg.algorithm.tis.enabled:
        metrics.update({
            "tis/weight_mean": stats["tis_weight_sum"] / upd_tokens,
            "tis/weight_max": stats["tis_weight_max"],
            "tis/weight_min": stats["tis_weight_min"],
            "tis/clipped_frac": stats["tis_clipped_sum"] / upd_tokens,
        })
    if cfg.algorithm.icepop.enabled:
        metrics["icepop/masked_frac"] = stats["icepop_masked_sum"] / upd_tokens
    if cfg.algorithm.kl_coef > 0:
        metrics["kl/ref_k3"] = stats.get("ref_kl_sum", 0.0) / upd_tokens
    return metrics


def run_step(job: Job, cfg: DictConfig, task, tok, reward_caller: RewardCaller,
             step: int) -> tuple[dict, list[dict], dict | None]:
    """generate -> rewards -> GRPO advantages -> train -> compare the two sides -> weight sync.
    Returns the step's metrics, its samples and (when tokens differ) the mismatch detail."""
    t0 = time.perf_counter()
    batch = make_batch(cfg, task, tok, step)
    rollouts, gen_rows = generate_rollouts(job, batch, step)
    t1 = time.perf_counter()
    rewards, texts, timed_out = score_rewards(reward_caller, tok, batch, rollouts, step)
    adv = grpo_advantages(rewards, cfg.task.samples_per_prompt, cfg.algorithm.norm_adv_by_std)
    t2 = time.perf_counter()
    train_lps, stats, train_rows = train_on(job, cfg, batch, rollouts, adv, step)
    t3 = time.perf_counter()
    cons = compare([r.logprobs for r in rollouts], train_lps)
    detail = None
    if cons["mismatched_tokens"]:
        detail = mismatch_detail(cfg, batch.prompts, rollouts, train_lps, gen_rows, train_rows)
        if cfg.kernels.mode == "deterministic" and cfg.monitor.on_mismatch == "raise":
            dump = dump_mismatch(job, cfg, step, detail, batch, rollouts)
            raise MismatchError(f"step {step}: {cons['mismatched_tokens']} of {cons['tokens']} tokens differ between "
                                f"generator and trainer in deterministic mode (max |d| "
                                f"{cons['logprob_abs_diff_max']:.3g}, first divergence: "
                                f"{detail['first_divergent_op'] or 'unknown (monitor.fingerprints=layers names it)'}); "
                                f"batch, weights and config dumped to {dump} (replay: rlalign agree "
                                f"agree.replay={dump})")
    t4 = time.perf_counter()
    weights_fp = job.sync_weights(step)
    t5 = time.perf_counter()

    metrics = step_metrics(cfg, rewards, rollouts, cons, stats)
    metrics["reward/timeouts"] = timed_out
    metrics.update({"sync/weights_fp": weights_fp, **job.last_sync, "time/generate_s": t1 - t0,
                    "time/reward_s": t2 - t1, "time/train_s": t3 - t2, "time/compare_s": t4 - t3,
                    "time/sync_s": t5 - t4, "time/trainer_gc_s": job.trainer_gc_s, **job.inner})
    seq_tokens = metrics["prompt/tokens"] + metrics["response/tokens"]
    metrics.update({"time/generate_tok_per_s": metrics["response/tokens"] / max(t1 - t0, 1e-9),
                    "time/train_tok_per_s": seq_tokens * cfg.algorithm.ppo_epochs / max(t3 - t2, 1e-9)})
    metrics.update({f"memory/{role}_peak_gib": v for role, v in job.peaks.items() if v is not None})
    rows = [{"sample_id": r.sample_id, "prompt": ex.prompt, "completion": text, "answer": ex.answer, "reward": rew}
            for r, ex, text, rew in zip(rollouts, batch.examples, texts, rewards)]
    if detail is not None:
        if detail["first_divergent_op"]:
            metrics["consistency/first_divergent_op"] = detail["first_divergent_op"]
        with (Path(cfg.run.dir) / "divergence.jsonl").open("a") as f:
            f.write(json_line({"step": step, **detail}) + "\n")
        if cfg.kernels.mode == "deterministic":
            metrics["consistency/alert"] = (f"step {step}: {cons['mismatched_tokens']} of {cons['tokens']} tokens "
                                            f"differ (first divergence: {detail['first_divergent_op']})")
    return metrics, rows, detail


def mismatch_detail(cfg, prompts, rollouts: list[Rollout], train_lps, gen_table, train_table) -> dict:
    """Worst tokens by |d| and, with per-layer fingerprints, the op where each mismatch began."""

    bad, worst = [], []
    for p, r, t in zip(prompts, rollouts, train_lps):
        g = r.logprobs
        for j in torch.nonzero(g.view(torch.int32) != t.view(torch.int32)).flatten().tolist():
            pos = len(p) + j - 1  # the logits row that predicted token j
            bad.append((r.sample_id, pos))
            worst.append({"sample_id": r.sample_id, "position": pos + 1, "token": r.tokens[j],
                          "generator": float(g[j]), "trainer": float(t[j]), "abs_diff": abs(float(g[j]) - float(t[j]))})
    worst.sort(key=lambda w: -w["abs_diff"])
    args = model_args(cfg)
    rep = report(gen_table, train_table, bad, tap_order(args)) if gen_table and train_table else {
        "first_divergent_op": None, "tokens": [], "by_op": {}}
    return {**rep, "worst_tokens": worst[: cfg.monitor.worst_tokens]}


def dump_mismatch(job, cfg, step, detail, batch: StepBatch, rollouts: list[Rollout]) -> Path:
    """The offending batch, the generator's weights (a HF directory) and the config, for replay."""
    out = Path(cfg.run.dir) / f"mismatch-step{step:06d}"
    out.mkdir(parents=True, exist_ok=True)
    state = job.generators.call("full_state")[0]
    model = model_from_config(OmegaConf.merge(cfg, {"device": "cpu"}))
    model.load_state_dict(state)
    save_hf(model, out / "weights")
    record = {"step": step, "sampling": dataclasses.asdict(batch.params), "prompts": batch.prompts,
              "sample_ids": [r.sample_id for r in rollouts], "responses": [r.tokens for r in rollouts],
              "generator_logprobs": [r.logprobs.tolist() for r in rollouts],
              "weights_fp": job.weights_fp, **detail}
    (out / "batch.json").write_text(json_line(record) + "\n")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return out


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
    job.trainers.call("save", str(tmp.resolve()), publish, wait)


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
            job.trainers.call("load", str(resume.resolve()))
        job.sync_weights(start - 1)

        logger = RunLogger(cfg, run_dir, start, cfg.run.steps)
        every, saved = cfg.checkpoint.every, True  # step start-1 is the resumed checkpoint (or before any)
        for step in range(start, cfg.run.steps):
            if stop.requested:  # before the next step: the last one's checkpoint, then stop
                if step > start:
                    doing = f"while writing the checkpoint of step {step - 1}"
                    if not saved:
                        _save(job, cfg, run_dir, step - 1, last["sync/weights_fp"], wait=True)
                    job.trainers.call("wait_checkpoint")
                raise stop.stopped(f"after step {step - 1} and its checkpoint" if step > start else
                                   f"before step {step}")
            doing = f"during step {step}"
            t0 = time.perf_counter()
            metrics, rows, detail = run_step(job, cfg, task, tok, rewards, step)
            if "consistency/alert" in metrics:
                logger.alert("generator/trainer mismatch", metrics.pop("consistency/alert"))
            t1 = time.perf_counter()
            due = ckpt.is_due(step, every, cfg.run.steps)
            saved = due or not cfg.checkpoint.enabled  # nothing left to save (checkpoint.enabled=false: none at all)
            if due and cfg.checkpoint.enabled:
                _save(job, cfg, run_dir, step, metrics["sync/weights_fp"], wait=not cfg.checkpoint.async_save)
            metrics["time/checkpoint_s"] = time.perf_counter() - t1
            metrics["time/step_s"] = time.perf_counter() - t0
            metrics["time/step_tok_per_s"] = (metrics["prompt/tokens"] + metrics["response/tokens"]) / metrics[
                "time/step_s"]
            logger.log(step, metrics, detail)
            logger.log_samples(step, rows)
            last = metrics
        doing = f"while writing the checkpoint of step {cfg.run.steps - 1}"
        job.trainers.call("wait_checkpoint")  # the last checkpoint is complete before the run ends
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
