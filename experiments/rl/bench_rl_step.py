"""Is the RL step the sum of its parts? `rlalign train` colocated on one GPU beside the same phases
run alone in one process, plus what colocation costs in memory. Each phase writes a part JSON;
`summary` merges them into results JSON.

    python experiments/rl/bench_rl_step.py rl --label L [--model M] [--steps 5] [overrides ...]
        `rlalign train` in-process (one Ray cluster), the issue's settings (one GPU, colocated,
        16 prompts x 8 samples x 256 new tokens, checkpoints off unless overridden): per-step phases,
        the workers' own share of each phase, peak GPU memory per role; an error (CUDA OOM) recorded
    python experiments/rl/bench_rl_step.py parts [--model M] [--steps 4] [overrides ...]
        the same steps' phases alone, in one process (no Ray): NativeEngine.generate on the step's
        prompts, Trainer.train_step on its samples, the colocated weight sync's device work
        (weight_sync.send/receive with the buckets handed over directly, fingerprints merged and
        checked); also the cost of offloading the generator's weights to pinned host memory and back
    python experiments/rl/bench_rl_step.py summary --name NAME      parts -> results/NAME.json

A step's time is the median over the steps after the first. `step_over_sum_of_phases` = the RL
run's median step / (median generate + median trainer step + median sync) of `parts`, same model,
same settings, same call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

TIMES = ("step_s", "generate_s", "generate_engine_s", "reward_s", "train_s", "train_trainer_s", "compare_s",
         "sync_s", "sync_trainer_s", "sync_generator_s", "checkpoint_s", "trainer_gc_s")


def _part(out: Path, name: str, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"part_{name}.json").write_text(json.dumps(payload, indent=1) + "\n")


def _base(model: str, steps: int) -> list[str]:
    return [f"model={model}", "device=cuda", "kernels.backend=triton", "trainer.ep_size=1", "generator.ep_size=1",
            "placement.colocate=true", "task.num_prompts=16", "task.samples_per_prompt=8", "task.max_new_tokens=256",
            "checkpoint.enabled=false", "monitor.on_mismatch=warn", "monitor.fingerprints=off",
            f"run.steps={steps}"]



def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# --- the RL run ----------------------------------------------------------------------------------------
def rl(a) -> None:
    from rlalign import cluster
    from rlalign.config import load_config
    from rlalign.rl import train

    over = [*_base(a.model, a.steps), *a.overrides]
    res: dict = {"label": a.label, "model": a.model, "command": "rlalign train " + " ".join(over)}
    root = Path(a.run_root) if a.run_root else None
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    cluster.connect()
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=root) as d:
            record.wait_gpu_free()
            try:
                res["train_summary"] = train(load_config([*over, f"run.dir={d}"]))
                res["error"] = None
            except (Exception, KeyboardInterrupt) as e:  # recorded: e.g. a CUDA out-of-memory is a result here
                res["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            path = Path(d) / "metrics.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    finally:
        cluster.disconnect(True)
    res["wall_s"] = time.perf_counter() - t0
    _record_rows(res, rows, ckpt_last="checkpoint.enabled=true" in " ".join(over))
    _print_run(a.label, res)
    _part(Path(a.out), f"rl_{a.label}", res)


def _record_rows(res: dict, rows: list[dict], ckpt_last: bool) -> None:
    """Medians over the steps after the first, without a last step that wrote the final checkpoint."""
    res["oom"] = bool(res.get("error")) and ("out of memory" in res["error"].lower() or "OutOfMemory" in res["error"])
    steady = (rows[1:-1] if ckpt_last else rows[1:]) or rows
    res["steady_steps"] = [r["step"] for r in steady]
    res["steps_done"] = len(rows)
    res["median_after_first"] = {k: _median(r.get(f"time/{k}") for r in steady) for k in TIMES}
    res["per_step"] = [{k: r.get(f"time/{k}") for k in TIMES} for r in rows]
    res["peak_gib"] = {role: max((r.get(f"memory/{role}_peak_gib") or 0.0 for r in rows), default=None)
                       for role in ("trainer", "generator")}
    res["generator_released_gib"] = max((r.get("memory/generator_released_gib") or 0.0 for r in rows), default=None)
    res["mismatched_tokens"] = sum(r["consistency/mismatched_tokens"] for r in rows)
    res["tokens"] = sum(r["consistency/tokens"] for r in rows)


def _print_run(label: str, res: dict) -> None:
    m = res["median_after_first"]
    if m["step_s"]:
        print(f"{label}: {res['steps_done']} steps, step {m['step_s']:.3f}s = generate {m['generate_s']:.3f} "
              f"(engine {m['generate_engine_s'] or 0:.3f}) + reward {m['reward_s']:.3f} + train {m['train_s']:.3f} "
              f"(trainer {m['train_trainer_s'] or 0:.3f}) + compare {m['compare_s']:.3f} + sync {m['sync_s']:.3f} "
              f"(trainer {m['sync_trainer_s']:.3f}, generator {m['sync_generator_s']:.3f}) + checkpoint "
              f"{m['checkpoint_s']:.3f}; peaks {res['peak_gib']} (generator released: "
              f"{res['generator_released_gib']}); mismatched {res['mismatched_tokens']} of {res['tokens']}; wall "
              f"{res['wall_s']:.0f}s", flush=True)
    print(f"{label}: error {res['error'][:300] if res['error'] else None}", flush=True)


# --- a run with its final checkpoint, resumed from it ------------------------------------------------
class _TrainerRSS:
    """Resident host memory of the trainer ranks (their pids taken when the job starts), sampled every
    20 ms, each sample marked whether a checkpoint is being written (a *.tmp directory exists)."""

    def __init__(self, run_dir: Path):
        import threading

        import rlalign.rl as rl_mod

        self.run_dir, self.pids, self.samples, self._stop = run_dir, [], [], False
        real = rl_mod.Job.__init__
        sampler = self

        def init(job, cfg):
            real(job, cfg)
            import ray

            sampler.pids = ray.get([actor.pid.remote() for actor in job.trainers.actors])

        self._restore = lambda: setattr(rl_mod.Job, "__init__", real)
        rl_mod.Job.__init__ = init
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        total = 0
        for pid in self.pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def _run(self) -> None:
        ck = self.run_dir / "checkpoints"
        while not self._stop:
            if self.pids:
                saving = ck.is_dir() and any(p.suffix == ".tmp" for p in ck.iterdir())
                self.samples.append((time.perf_counter(), self._rss(), saving))
            time.sleep(0.02)

    def stop(self) -> dict:
        self._stop = True
        self._thread.join()
        self._restore()
        before = [r for _, r, saving in self.samples if not saving]
        first = next((i for i, (_, _, saving) in enumerate(self.samples) if saving), None)
        if first is None:
            return {"samples": len(self.samples), "saving_samples": 0}
        base = self.samples[first - 1][1] if first > 0 else (before[-1] if before else 0)
        peak = max(r for _, r, saving in self.samples if saving)
        return {"samples": len(self.samples), "saving_samples": sum(1 for *_, sv in self.samples if sv),
                "rss_before_save_bytes": base, "rss_peak_during_save_bytes": peak,
                "save_host_bytes": max(0, peak - base), "rss_peak_run_bytes": max(r for _, r, _ in self.samples)}


def _gen_weight_records(run_dir: Path, step: int) -> dict:
    from rlalign.monitor.trace import read_trace

    out = {}
    for path in sorted((run_dir / "traces").glob("generator-rank*.jsonl")):
        _, recs = read_trace(path)
        for r in recs:
            if r["step"] == step and r["name"].startswith("weights/"):
                out[(path.name, r["name"])] = r.get("fp", r.get("fps"))
    return out


def ckpt(a) -> None:
    """`rlalign train` of --steps steps with its final checkpoint (host memory of the trainer ranks
    sampled during the save), then a run resumed from that checkpoint for one more step: the
    generator's weight records after the resumed run's first sync (step --steps - 1, what it loaded)
    must equal the first run's after its last sync, record by record."""
    import shutil

    from rlalign import cluster
    from rlalign.config import load_config
    from rlalign.rl import train

    root = Path(a.run_root or tempfile.gettempdir()) / f"bench_rl_step_{a.label}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    over = [*_base(a.model, a.steps), "checkpoint.enabled=true", "checkpoint.every=0", "monitor.fingerprints=default",
            *a.overrides]
    res: dict = {"label": a.label, "model": a.model, "command": "rlalign train " + " ".join(over)}
    cluster.connect()
    try:
        record.wait_gpu_free()
        rss = _TrainerRSS(root / "a")
        t0 = time.perf_counter()
        try:
            res["train_summary"] = train(load_config([*over, f"run.dir={root / 'a'}"]))
            res["error"] = None
        except (Exception, KeyboardInterrupt) as e:
            res["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        res["wall_s"] = time.perf_counter() - t0
        res["host_memory"] = rss.stop()
        path = root / "a" / "metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        _record_rows(res, rows, ckpt_last=True)
        _print_run(a.label, res)
        final = root / "a" / "checkpoints" / f"step_{a.steps - 1:06d}"
        res["final_checkpoint"] = str(final)
        res["final_checkpoint_on_disk"] = (final / "meta.json").is_file()
        state = sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) if final.is_dir() else 0
        res["checkpoint_bytes"] = state
        hm = res["host_memory"]
        if state and "save_host_bytes" in hm:
            hm["save_host_over_state"] = hm["save_host_bytes"] / state
        print(f"{a.label}: final checkpoint {final.name} on disk: {res['final_checkpoint_on_disk']} "
              f"({state / 1e9:.1f} GB); trainer host memory during the save +{hm.get('save_host_bytes', 0) / 1e9:.2f} "
              f"GB = {hm.get('save_host_over_state', float('nan')):.3f} of the state", flush=True)
        _part(Path(a.out), f"ckpt_{a.label}", res)
        if res["final_checkpoint_on_disk"]:
            resumed = [*_base(a.model, a.steps + 1), "checkpoint.enabled=false", "monitor.fingerprints=default",
                       f"checkpoint.resume={final}", *a.overrides]
            res["resume_command"] = "rlalign train " + " ".join(resumed)
            record.wait_gpu_free()
            t0 = time.perf_counter()
            try:
                train(load_config([*resumed, f"run.dir={root / 'b'}"]))
                res["resume_error"] = None
            except (Exception, KeyboardInterrupt) as e:
                res["resume_error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            res["resume_wall_s"] = time.perf_counter() - t0
            ra, rb = _gen_weight_records(root / "a", a.steps - 1), _gen_weight_records(root / "b", a.steps - 1)
            differ = sorted(k[1] for k in ra if ra[k] != rb.get(k))
            path = root / "b" / "metrics.jsonl"
            brows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
            res["resume"] = {"weight_records_compared": len(ra), "weight_records_resumed": len(rb),
                             "weight_records_differing": len(differ), "first_differing": differ[:3],
                             "resumed_steps": [r["step"] for r in brows],
                             "resumed_mismatched_tokens": sum(r["consistency/mismatched_tokens"] for r in brows)}
            res["final_checkpoint_resumes_bitwise"] = bool(
                res["resume_error"] is None and ra and len(ra) == len(rb) and not differ
                and [r["step"] for r in brows] == [a.steps])
            print(f"{a.label}: resumed from the final checkpoint: {res['resume']}; bitwise "
                  f"{res['final_checkpoint_resumes_bitwise']} (wall {res['resume_wall_s']:.0f}s)", flush=True)
    finally:
        cluster.disconnect(True)
        shutil.rmtree(root, ignore_errors=True)  # the next run's checkpoint needs the disk
    _part(Path(a.out), f"ckpt_{a.label}", res)


# --- a run dir too small for the checkpoint ------------------------------------------------------------
def refuse(a) -> None:
    """`rlalign train` (the CLI) of --model with checkpoints on and run.dir under --run-root: it must
    stop before any step, in one line naming the checkpoint's size and the free space."""
    import shutil
    import subprocess

    root = Path(a.run_root or tempfile.gettempdir()) / "bench_rl_step_refuse"
    shutil.rmtree(root, ignore_errors=True)
    over = [*_base(a.model, a.steps), "checkpoint.enabled=true", *a.overrides, f"run.dir={root}"]
    free = shutil.disk_usage(root.parent).free
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "rlalign.cli", "train", *over], capture_output=True, text=True,
                           timeout=a.timeout)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = None, (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    started = (root / "metrics.jsonl").is_file() and (root / "metrics.jsonl").stat().st_size > 0
    res = {"model": a.model, "command": "rlalign train " + " ".join(over), "free_bytes": free, "returncode": rc,
           "seconds": time.perf_counter() - t0, "stderr_lines": lines[-5:], "stderr_line_count": len(lines),
           "a_step_ran": started,
           "refused_in_one_line": rc not in (0, None) and len(lines) == 1 and not started}
    print(f"refuse: rc {rc} in {res['seconds']:.1f}s, {len(lines)} stderr line(s): {lines[-1][:400] if lines else ''}",
          flush=True)
    shutil.rmtree(root, ignore_errors=True)
    _part(Path(a.out), "refuse", res)


# --- the phases alone ----------------------------------------------------------------------------------
def parts(a) -> None:
    import torch
    from omegaconf import OmegaConf

    from rlalign import kernels
    from rlalign.config import load_config
    from rlalign.model.build import model_from_config
    from rlalign.parallel import weight_sync
    from rlalign.rollout.generator import make_generator
    from rlalign.sequences import Sample
    from rlalign.step import make_batch, score_rewards
    from rlalign.tasks import make_task
    from rlalign.tasks.reward_calls import RewardCaller
    from rlalign.tasks.tokenizer import make_tokenizer
    from rlalign.training.losses import grpo_advantages
    from rlalign.training.trainer import Trainer

    over = [*_base(a.model, a.steps), *a.overrides]
    cfg = load_config([*over, "run.dir=/tmp/bench_rl_step_parts"])
    record.wait_gpu_free()
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    t = cfg.task
    task = make_task(t.name, cfg.seed, reward=t.reward, path=t.path, **OmegaConf.to_container(t.kwargs))
    tok = make_tokenizer(t.tokenizer, cfg.model.path, t.chat)
    rewards = RewardCaller(task, t.reward_timeout_s, t.reward_timeout_fallback, t.reward_workers)
    trainer = Trainer(cfg)
    model = model_from_config(cfg)
    engine = make_generator(cfg, model)
    plan = weight_sync.make_plan(weight_sync.tensor_specs(trainer.model, 1), cfg.sync.bucket_mb << 20)
    specs = plan.specs()
    alg = OmegaConf.create(OmegaConf.to_container(cfg.algorithm, resolve=True))

    cuda = cfg.device.startswith("cuda")

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    def sync():
        out, kept = weight_sync.send(trainer.model, plan, 0, 1, None, None, ipc=True)
        handed = [(lambda b=b: b, ()) for b in kept]
        got = weight_sync.receive(model, plan, 0, 1, None, None, handed, out.device_uuid)
        kept.clear()
        fps = weight_sync.merge(specs, [out.shares], "trainer", dense_on_all=False)
        gen = weight_sync.merge(specs, [got.shares], "generator", dense_on_all=True)
        return weight_sync.check(fps, gen)

    rows = []
    _, t_sync0 = timed(sync)
    for step in range(a.steps):
        batch = make_batch(cfg, task, tok, step)
        rollouts, t_gen = timed(lambda batch=batch: engine.generate(batch.prompts, batch.sample_ids, batch.params))
        values, _, _ = score_rewards(rewards, tok, batch, rollouts, step)
        adv = grpo_advantages(values, cfg.task.samples_per_prompt, cfg.algorithm.norm_adv_by_std)
        samples = [Sample(p, r.tokens, r.logprobs, x, r.sample_id, params=r.params)
                   for p, r, x in zip(batch.prompts, rollouts, adv)]
        _, t_train = timed(lambda samples=samples: trainer.train_step(samples, alg))
        _, t_sync = timed(sync)
        tokens = sum(len(r.tokens) for r in rollouts)
        rows.append({"generate_s": t_gen, "train_s": t_train, "sync_s": t_sync, "response_tokens": tokens})
        print(f"parts step {step}: generate {t_gen:.3f} train {t_train:.3f} sync {t_sync:.3f} ({tokens} tokens)",
              flush=True)
    steady = rows[1:] or rows
    med = {k: _median(r[k] for r in steady) for k in ("generate_s", "train_s", "sync_s")}
    # the generator's weights through pinned host memory and back: what offloading them would cost
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=cuda) for p in params]
    offload = []
    for _ in range(3) if a.offload else ():
        _, t_d2h = timed(lambda: [h.copy_(p, non_blocking=True) for h, p in zip(host, params)])
        _, t_h2d = timed(lambda: [p.copy_(h, non_blocking=True) for h, p in zip(host, params)])
        offload.append((t_d2h, t_h2d))
    t_d2h, t_h2d = (statistics.median(x) for x in zip(*offload)) if offload else (None, None)
    res = {"model": a.model, "command": "parts of rlalign train " + " ".join(over), "per_step": rows,
           "median_after_first": med, "sum_of_phases_s": sum(med.values()), "first_sync_s": t_sync0,
           "generator_weights_bytes": nbytes, "offload_d2h_s": t_d2h, "offload_h2d_s": t_h2d,
           "offload_gbps": nbytes / t_d2h / 1e9 if t_d2h else None,
           "peak_gib_process": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    print(f"parts: generate {med['generate_s']:.3f} + train {med['train_s']:.3f} + sync {med['sync_s']:.3f} = "
          f"{res['sum_of_phases_s']:.3f}s; generator weights {nbytes / 1e9:.2f} GB to pinned host {t_d2h}s, back "
          f"{t_h2d}s", flush=True)
    _part(Path(a.out), f"parts_{a.model}", res)


# --- summary -------------------------------------------------------------------------------------------
def _steps_median(run: dict, key: str, steps: range) -> float | None:
    return _median(r.get(key) for i, r in enumerate(run.get("per_step", [])) if i in steps)


def _gpu_env(a) -> dict:
    """Summarising on another machine than the GPU one (--env-from: a result JSON written there by the
    same software): the GPU machine's record, the measurement's date and code."""
    if not a.env_from:
        return {}
    env = json.loads(Path(a.env_from).read_text())
    out = {k: env[k] for k in ("machine", "versions") if k in env}
    out.update({k: v for k, v in (("date", a.date), ("git_commit", a.code), ("git_describe", a.code)) if v})
    return out


def summary(a) -> None:
    """Results JSON of the RL step at real size (--name) and, with --monitor-name, of the monitor's
    cost (the 2 B det runs with monitor default / off, the bench-moe-large pair, the kernel's GB/s)."""
    out = Path(a.out)
    P = {p.stem.removeprefix("part_"): json.loads(p.read_text()) for p in sorted(out.glob("part_*.json"))}
    off, iso = P.get("rl_q_det_off"), P.get(f"parts_{a.model}")
    ck = {m: P.get(f"ckpt_q_{m}") for m in ("det", "default")}
    large, refused = P.get("rl_large_default"), P.get("refuse")
    s: dict = {}
    if off and iso and off["median_after_first"].get("step_s"):
        m = off["median_after_first"]
        s["step_over_sum_of_phases"] = m["step_s"] / iso["sum_of_phases_s"]
        s["sync_share_of_step_2b"] = m["sync_s"] / m["step_s"]
        s["step_s_2b"], s["sum_of_phases_s_2b"] = m["step_s"], iso["sum_of_phases_s"]
    done = [c for c in ck.values() if c]
    s["final_checkpoint_resumes_bitwise"] = bool(done) and all(c.get("final_checkpoint_resumes_bitwise") for c in done)
    s["final_checkpoint_resumes_bitwise_by_kernels"] = {m: (c or {}).get("final_checkpoint_resumes_bitwise")
                                                        for m, c in ck.items()}
    s["save_host_memory_over_state"] = {m: ((c or {}).get("host_memory") or {}).get("save_host_over_state")
                                        for m, c in ck.items()}
    if large:
        s["default_kernels_large_oom"] = bool(large.get("oom"))
        s["default_kernels_large_error"] = large.get("error")
        s["default_kernels_large_peak_gib"] = {**large["peak_gib"], "generator_released": large.get(
            "generator_released_gib")}
    if refused:
        s["small_run_dir_refused_in_one_line"] = refused["refused_in_one_line"]
    res = {**_gpu_env(a), "summary": s, "runs": {k: v for k, v in P.items() if k.startswith(("rl_", "ckpt_"))},
           "parts": iso,
           "refuse": refused, "what_it_shows": a.shows or _shows(s, off, iso, ck, large, refused) + (a.note or "")}
    print(json.dumps(s, indent=1))
    print("wrote", record.write(a.name, res, a.results, command=a.command))
    if a.monitor_name:
        monitor_summary(a, P)


def _fmt(v, f=".3f"):
    return format(v, f) if isinstance(v, (int, float)) else "n/a"


def _shows(s, off, iso, ck, large, refused) -> str:
    parts = []
    if off and iso:
        m, q = off["median_after_first"], iso["median_after_first"]
        parts.append(f"qwen3-30b-a3b-rehearsal colocated on one GPU, deterministic kernels, monitor off: median step "
                     f"{_fmt(m['step_s'])} s (generate {_fmt(m['generate_s'])}, train {_fmt(m['train_s'])}, sync "
                     f"{_fmt(m['sync_s'])}) vs the phases alone in one process {_fmt(q['generate_s'])} + "
                     f"{_fmt(q['train_s'])} + {_fmt(q['sync_s'])} = {_fmt(iso['sum_of_phases_s'])} s: ratio "
                     f"{_fmt(s.get('step_over_sum_of_phases'))} (bar 1.15); the colocated sync is "
                     f"{_fmt(100 * s.get('sync_share_of_step_2b', 0), '.1f')} % of the step (bar 3 %)")
    for m, c in ck.items():
        if c:
            hm = c.get("host_memory") or {}
            parts.append(f"{m} kernels, monitor default, 5 steps with the final checkpoint "
                         f"({_fmt(c.get('checkpoint_bytes', 0) / 1e9, '.1f')} GB) on disk: "
                         f"{c.get('final_checkpoint_on_disk')}, resumed bitwise: "
                         f"{c.get('final_checkpoint_resumes_bitwise')}"
                         f" ({(c.get('resume') or {}).get('weight_records_compared')} generator weight records equal "
                         f"after the resumed run's first sync), trainer host memory during the save "
                         f"+{_fmt(hm.get('save_host_bytes', 0) / 1e9, '.2f')} GB = "
                         f"{_fmt(hm.get('save_host_over_state'))} of the state (bar 0.25)")
    if large:
        parts.append(f"bench-moe-large colocated, default kernels, checkpoints off: {large['steps_done']} steps, "
                     f"CUDA OOM: {large.get('oom')} (error: {(large.get('error') or 'none')[:200]}); peak GPU memory "
                     f"trainer {_fmt(large['peak_gib'].get('trainer'), '.1f')} GiB, generator "
                     f"{_fmt(large['peak_gib'].get('generator'), '.1f')} GiB while generating and "
                     f"{_fmt(large.get('generator_released_gib'), '.2f')} GiB while the trainer trains (before the "
                     f"change, as the issue measured: trainer 118 GiB + generator 21 GiB, CUDA OOM at step 1)")
    if refused:
        parts.append(f"bench-moe-large with a run dir on a disk of {_fmt(refused['free_bytes'] / 1e9, '.0f')} GB "
                     f"free: refused in one line before any step: {refused['refused_in_one_line']} "
                     f"({(refused.get('stderr_lines') or [''])[-1][:300]})")
    return "; ".join(parts) + "."


def monitor_summary(a, P: dict) -> None:
    k = P.get("kernel", {})
    pairs = {"qwen3-30b-a3b-rehearsal": (P.get("rl_q_det_on") or P.get("ckpt_q_det"), P.get("rl_q_det_off")),
             "bench-moe-large": (P.get("rl_large_det_on"), P.get("rl_large_det_off"))}
    models = {}
    for model, (on, off_) in pairs.items():
        if not (on and off_):
            continue
        steps = range(1, min(len(on["per_step"]) - (1 if "checkpoint.enabled=true" in on["command"] else 0),
                             len(off_["per_step"])))
        med = {name: {t: _steps_median(r, t, steps) for t in ("step_s", "generate_s", "train_s", "sync_s")}
               for name, r in (("det:default", on), ("det:off", off_))}
        ratio = {t: med["det:default"][t] / med["det:off"][t] for t in ("step_s", "train_s", "sync_s")
                 if med["det:off"][t]}
        models[model] = {"steps": list(steps), "runs": med, "monitor_on_over_off_step": ratio.get("step_s"),
                         "monitor_on_over_off_train": ratio.get("train_s"),
                         "monitor_on_over_off_sync": ratio.get("sync_s"),
                         "mismatched_tokens": {"det:default": on["mismatched_tokens"],
                                               "det:off": off_["mismatched_tokens"]},
                         "commands": {"det:default": on["command"], "det:off": off_["command"]}}
    ratios = [m["monitor_on_over_off_step"] for m in models.values() if m["monitor_on_over_off_step"]]
    summ = {"gpu": k.get("device"), "monitor_on_over_off_step": max(ratios) if ratios else None,
            "fingerprint_gbps": k.get("fingerprint_gbps"),
            "fingerprint_frac_of_hbm_peak": k.get("fingerprint_frac_of_peak"),
            "sync_on_over_off": {m: v["monitor_on_over_off_sync"] for m, v in models.items()},
            "step_on_over_off": {m: v["monitor_on_over_off_step"] for m, v in models.items()},
            "bits_device_equals_cpu": (k.get("bits") or {}).get("device_equals_numpy")}
    gb = (k.get("bandwidth_setup") or {}).get("bytes", 0) / 1e9
    steps = sorted({i for m in models.values() for i in m["steps"]})
    ratios_text = ", ".join(f"{m} {_fmt(v['monitor_on_over_off_step'])} (sync "
                            f"{_fmt(v['monitor_on_over_off_sync'], '.2f')}x)" for m, v in models.items())
    shows = (f"One call: the fingerprint kernel reads {_fmt(gb, '.1f')} GB of mixed bf16/fp32 tensors at "
             f"{_fmt(k.get('fingerprint_gbps'), '.0f')} GB/s "
             f"({_fmt(100 * (k.get('fingerprint_frac_of_peak') or 0), '.0f')} % of the HBM peak); RL step (one "
             f"GPU, colocated, deterministic kernels, median of steps {steps}) with "
             f"monitor.fingerprints=default over off: {ratios_text} (bars: step 1.03, sync 1.1x).")
    print(json.dumps(summ, indent=1))
    res = {**_gpu_env(a), "summary": summ, "models": models, "kernel": k,
           "what_it_shows": shows + (a.monitor_note or "")}
    print("wrote", record.write(a.monitor_name, res, a.results, command=a.command))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("rl", "ckpt", "refuse", "parts", "summary"))
    ap.add_argument("overrides", nargs="*", default=[])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_rl_step"), help="part JSONs")
    ap.add_argument("--results", default=None, help="where the result JSON goes (default experiments/results)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--label", default="run")
    ap.add_argument("--model", default="qwen3-30b-a3b-rehearsal")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--run-root", default=None, help="rl: where the run dir goes (default: the temp dir)")
    ap.add_argument("--command", default=None)
    ap.add_argument("--timeout", type=float, default=120.0, help="refuse: the CLI's time limit")
    ap.add_argument("--offload", type=int, default=1, help="parts: time the weights to pinned host and back")
    ap.add_argument("--shows", default=None)
    ap.add_argument("--monitor-name", default=None, help="summary: also the monitor's cost as this result")
    ap.add_argument("--note", default=None, help="summary: appended to what_it_shows")
    ap.add_argument("--env-from", default=None, help="summary: machine and versions from this GPU-written JSON")
    ap.add_argument("--date", default=None, help="summary (with --env-from): when the parts were measured")
    ap.add_argument("--code", default=None, help="summary (with --env-from): the code that was measured")
    ap.add_argument("--monitor-note", default=None, help="summary: appended to the monitor result's what_it_shows")
    a = ap.parse_intermixed_args()
    {"rl": rl, "ckpt": ckpt, "refuse": refuse, "parts": parts, "summary": summary}[a.phase](a)


if __name__ == "__main__":
    main()
