"""Is the RL step the sum of its parts? `rlalign train` colocated on one GPU beside the same phases
run alone in one process, plus what colocation costs in memory. Each phase writes a part JSON;
`summary` merges them into results JSON.

    python experiments/bench_rl_step.py rl --label L [--model M] [--steps 5] [overrides ...]
        `rlalign train` in-process (one Ray cluster), the issue's settings (one GPU, colocated,
        16 prompts x 8 samples x 256 new tokens, checkpoints off unless overridden): per-step phases,
        the workers' own share of each phase, peak GPU memory per role; an error (CUDA OOM) recorded
    python experiments/bench_rl_step.py parts [--model M] [--steps 4] [overrides ...]
        the same steps' phases alone, in one process (no Ray): NativeEngine.generate on the step's
        prompts, Trainer.train_step on its samples, the colocated weight sync's device work
        (weight_sync.send/receive with the buckets handed over directly, fingerprints merged and
        checked); also the cost of offloading the generator's weights to pinned host memory and back
    python experiments/bench_rl_step.py summary --name NAME      parts -> results/NAME.json

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
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
            "logger.console=false", f"run.steps={steps}"]


def _wait_gpu_free(limit_s: float = 60.0) -> None:
    import subprocess

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return
        if not used or max(int(u) for u in used) < 4096:
            return
        time.sleep(0.5)


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
            _wait_gpu_free()
            try:
                res["train_summary"] = train(load_config([*over, f"run.dir={d}"]))
                res["error"] = None
            except Exception as e:  # recorded: e.g. a CUDA out-of-memory is a result here
                res["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            path = Path(d) / "metrics.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    finally:
        cluster.disconnect(True)
    res["wall_s"] = time.perf_counter() - t0
    res["oom"] = bool(res["error"]) and ("out of memory" in res["error"].lower() or "OutOfMemory" in res["error"])
    steady = rows[1:] or rows
    res["steps_done"] = len(rows)
    res["median_after_first"] = {k: _median(r.get(f"time/{k}") for r in steady) for k in TIMES}
    res["per_step"] = [{k: r.get(f"time/{k}") for k in TIMES} for r in rows]
    res["peak_gib"] = {role: max((r.get(f"memory/{role}_peak_gib") or 0.0 for r in rows), default=None)
                       for role in ("trainer", "generator")}
    res["mismatched_tokens"] = sum(r["consistency/mismatched_tokens"] for r in rows)
    res["tokens"] = sum(r["consistency/tokens"] for r in rows)
    m = res["median_after_first"]
    if m["step_s"]:
        print(f"{a.label}: {len(rows)} steps, step {m['step_s']:.3f}s = generate {m['generate_s']:.3f} "
              f"(engine {m['generate_engine_s'] or 0:.3f}) + reward {m['reward_s']:.3f} + train {m['train_s']:.3f} "
              f"(trainer {m['train_trainer_s'] or 0:.3f}) + compare {m['compare_s']:.3f} + sync {m['sync_s']:.3f} "
              f"(trainer {m['sync_trainer_s']:.3f}, generator {m['sync_generator_s']:.3f}) + checkpoint "
              f"{m['checkpoint_s']:.3f}; peaks {res['peak_gib']}; mismatched {res['mismatched_tokens']} of "
              f"{res['tokens']}; wall {res['wall_s']:.0f}s", flush=True)
    print(f"{a.label}: error {res['error'][:300] if res['error'] else None}", flush=True)
    _part(Path(a.out), f"rl_{a.label}", res)


# --- the phases alone ----------------------------------------------------------------------------------
def parts(a) -> None:
    import torch
    from omegaconf import OmegaConf

    from rlalign.config import load_config
    from rlalign.factory import apply_kernels, model_from_config
    from rlalign.parallel import weight_sync
    from rlalign.rl import make_batch, score_rewards
    from rlalign.rollout.generator import make_generator
    from rlalign.tasks import make_task
    from rlalign.tasks.reward_calls import RewardCaller
    from rlalign.tasks.tokenizer import make_tokenizer
    from rlalign.training.losses import grpo_advantages
    from rlalign.training.plan import Sample
    from rlalign.training.trainer import Trainer

    over = [*_base(a.model, a.steps), *a.overrides]
    cfg = load_config([*over, "run.dir=/tmp/bench_rl_step_parts"])
    _wait_gpu_free()
    apply_kernels(cfg)
    t = cfg.task
    task = make_task(t.name, cfg.seed, reward=t.reward, path=t.path, **OmegaConf.to_container(t.kwargs))
    tok = make_tokenizer(t.tokenizer)
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
        samples = [Sample(p, r.tokens, r.logprobs, x, r.sample_id) for p, r, x in zip(batch.prompts, rollouts, adv)]
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
def summary(a) -> None:
    out = Path(a.out)
    parts_ = {p.stem.removeprefix("part_"): json.loads(p.read_text()) for p in sorted(out.glob("part_*.json"))}
    runs = {k.removeprefix("rl_"): v for k, v in parts_.items() if k.startswith("rl_")}
    iso = {k.removeprefix("parts_"): v for k, v in parts_.items() if k.startswith("parts_")}
    ratios = {}
    for label, r in runs.items():
        p = iso.get(r["model"])
        step = r["median_after_first"].get("step_s")
        if p and step and "fingerprints=off" in r["command"]:
            ratios[label] = step / p["sum_of_phases_s"]
    print(json.dumps({"step_over_sum_of_phases": ratios}, indent=1))
    res = {"summary": {"step_over_sum_of_phases": ratios}, "runs": runs, "parts": iso,
           "what_it_shows": a.shows or "RL step vs its phases alone (see runs and parts)."}
    print("wrote", record.write(a.name, res, a.results, command=a.command))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("rl", "parts", "summary"))
    ap.add_argument("overrides", nargs="*", default=[])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_rl_step"), help="part JSONs")
    ap.add_argument("--results", default=None, help="where the result JSON goes (default experiments/results)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--label", default="run")
    ap.add_argument("--model", default="qwen3-30b-a3b-rehearsal")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--run-root", default=None, help="rl: where the run dir goes (default: the temp dir)")
    ap.add_argument("--command", default=None)
    ap.add_argument("--offload", type=int, default=1, help="parts: time the weights to pinned host and back")
    ap.add_argument("--shows", default=None)
    a = ap.parse_intermixed_args()
    {"rl": rl, "parts": parts, "summary": summary}[a.phase](a)


if __name__ == "__main__":
    main()
