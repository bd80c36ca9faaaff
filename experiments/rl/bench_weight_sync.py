"""Weight sync trainer -> generator on Ray actors (rlalign.parallel.weight_sync), bits checked.

    python experiments/rl/bench_weight_sync.py [--models bench-moe,bench-moe-large] [--modes separate,colocated]
                                            [--reps 5] [--out DIR]

Modes (2 GPUs): `separate` = trainer EP 1 on GPU 0, generator EP 1 on GPU 1 (NCCL broadcast over
the trainer-rank-0 + generator group); `colocated` = placement.colocate=true, trainer EP 2 on GPUs
0/1, generator EP 1 on GPU 0 (expert shards gathered in the trainer group, CUDA IPC to the
generator). Per model and mode: one Job (the actors `rlalign train` uses); a first sync (group
set-up, NCCL init); a trainer update on random tokens; `reps` timed device syncs (driver wall
time of Job.sync_weights, each checked by the device fingerprints); then an independent bitwise
check: both sides' unsharded weights on the host, compared tensor by tensor. Prints a table; writes
DIR/weight_sync_<models>_<machine>.json (after every model and mode, so a timeout keeps what was measured).
`--device cpu --models tiny-moe` is the CPU rehearsal (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
from record import RESULTS, environment  # noqa: E402

from rlalign import cluster  # noqa: E402
from rlalign.config import load_config  # noqa: E402
from rlalign.job import Job  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402
from rlalign.sequences import Sample  # noqa: E402

TARGETS_S = {"bench-moe": 0.2, "bench-moe-large": 2.0}  # seconds per sync, 2xH200
MODES = {"separate": ["trainer.ep_size=1", "generator.ep_size=1", "placement.colocate=false"],
         "colocated": ["trainer.ep_size=2", "generator.ep_size=1", "placement.colocate=true"]}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _bits_equal(a: dict, b: dict) -> tuple[bool, str | None]:
    if sorted(a) != sorted(b):
        return False, f"names differ: {sorted(set(a) ^ set(b))[:3]}"
    for k in sorted(a):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False, k
        iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        if not torch.equal(x.contiguous().view(iv), y.contiguous().view(iv)):
            return False, k
    return True, None


def _perturb(job: Job, cfg, seed: int) -> float:
    """One trainer update on random tokens: the trainer's weights move away from the generator's."""
    g = torch.Generator().manual_seed(seed)
    vocab = cfg.model.vocab_size
    samples = []
    for i in range(8):
        prompt = torch.randint(2, vocab, (16,), generator=g).tolist()
        response = torch.randint(2, vocab, (48,), generator=g).tolist()
        samples.append(Sample(prompt, response, torch.full((48,), -2.0), 1.0 if i % 2 else -1.0, i,
                              params=SamplingParams.from_config(cfg)))
    t = time.perf_counter()
    job.trainers.call("train_step", samples, OmegaConf.to_container(cfg.algorithm, resolve=True), seed)
    return time.perf_counter() - t


def bench_one(model: str, mode: str, a) -> dict:
    over = [f"model={model}", f"device={a.device}", *MODES[mode], "kernels.mode=default", "kernels.backend=torch",
            "monitor.fingerprints=off", f"sync.bucket_mb={a.bucket_mb}", f"run.dir=/tmp/bench_weight_sync_{mode}",
            "trainer.micro_batch_size=8"]
    cfg = load_config(over)
    res = {"model": model, "mode": mode, "overrides": over}
    t = time.perf_counter()
    job = Job(cfg)
    try:
        job.trainers.call("pid")
        job.generators.call("pid")
        res["actors_start_s"] = time.perf_counter() - t
        log(f"{model} {mode}: actors up in {res['actors_start_s']:.1f}s")
        t = time.perf_counter()
        first = job.sync_weights(-1)
        fp0 = first.weights_fp
        res["first_sync_s"] = time.perf_counter() - t  # plans, process group, NCCL init
        res["bytes"], res["buckets"] = first.metrics["sync/bytes"], first.metrics["sync/buckets"]
        res["perturb_train_step_s"] = _perturb(job, cfg, 0)
        _perturb(job, cfg, 1)  # the weights move again: what the generator holds next came by the device path
        times, fps, sides = [], set(), []
        for k in range(a.reps):
            t = time.perf_counter()
            synced = job.sync_weights(k)
            times.append(time.perf_counter() - t)
            fps.add(synced.weights_fp)
            sides.append((synced.metrics["time/sync_trainer_s"], synced.metrics["time/sync_generator_s"]))
        res["device"] = {"median_s": statistics.median(times), "min_s": min(times), "times_s": times,
                         "trainer_side_median_s": statistics.median(s[0] for s in sides),
                         "generator_side_median_s": statistics.median(s[1] for s in sides),
                         "GB_per_s": res["bytes"] / statistics.median(times) / 1e9,
                         "fingerprints_checked": True, "weights_changed": fp0 not in fps and len(fps) == 1}
        target = TARGETS_S.get(model)
        res["device"]["target_s"] = target
        res["device"]["meets_target"] = target is not None and res["device"]["median_s"] <= target
        log(f"{model} {mode}: device sync median {res['device']['median_s'] * 1e3:.1f} ms over {a.reps} "
            f"({res['bytes'] / 1e9:.2f} GB, {res['buckets']} buckets)")
        t = time.perf_counter()
        (trainer_state, _), *_ = job.trainers.call("full_state", False)
        gen_state = job.generators.call("full_state")[0]
        res["bits_equal"], res["first_differing_tensor"] = _bits_equal(trainer_state, gen_state)
        res["bit_check_s"] = time.perf_counter() - t
        res["params"] = sum(v.numel() for v in trainer_state.values())
        del trainer_state, gen_state
        log(f"{model} {mode}: bits equal: {res['bits_equal']}")
    finally:
        job.close()
    return res


def table(rows: list[dict]) -> str:
    head = (f"{'model':<16}{'mode':<11}{'params':>8}{'GB':>7}{'bkts':>6}{'device ms':>11}{'min ms':>8}"
            f"{'GB/s':>7}{'bits':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<16}{r['mode']:<11} ERROR {r['error'][:80]}")
            continue
        d = r["device"]
        lines.append(f"{r['model']:<16}{r['mode']:<11}{r['params'] / 1e9:>7.2f}B{r['bytes'] / 1e9:>7.2f}"
                     f"{r['buckets']:>6}{d['median_s'] * 1e3:>11.1f}{d['min_s'] * 1e3:>8.1f}{d['GB_per_s']:>7.1f}"
                     f"{str(r['bits_equal']):>6}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bench-moe,bench-moe-large")
    ap.add_argument("--modes", default="separate,colocated")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS))
    ap.add_argument("--name", default=None, help="result file name (default weight_sync_<models>_<gpu>x<count>.json)")
    a = ap.parse_args()
    a.t_start = time.perf_counter()
    ngpu = torch.cuda.device_count() if a.device == "cuda" else 0
    if a.device == "cuda" and ngpu < 2:
        print(f"bench_weight_sync: needs 2 GPUs (found {ngpu})", file=sys.stderr)
        return 2
    machine = f"{torch.cuda.get_device_name(0).split()[-1].lower()}x{ngpu}" if ngpu else "cpu"
    name = a.name or f"weight_sync_{a.models.replace(',', '+')}_{machine}"
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {**environment(), "what": __doc__.strip().splitlines()[0], "reps": a.reps,
              "bucket_mb": a.bucket_mb, "targets_s": TARGETS_S,
              "results": []}
    own = cluster.connect()
    try:
        for model in a.models.split(","):
            for mode in a.modes.split(","):
                try:
                    record["results"].append(bench_one(model, mode, a))
                except Exception as e:  # keep what was measured; the table shows the error
                    log(f"{model} {mode}: {type(e).__name__}: {e}")
                    record["results"].append({"model": model, "mode": mode, "error": f"{type(e).__name__}: {e}"})
                (out_dir / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    finally:
        cluster.disconnect(own)
    print(table(record["results"]), flush=True)
    print(f"wrote {out_dir / (name + '.json')} in {time.perf_counter() - a.t_start:.0f}s", flush=True)
    return 0 if all(r.get("bits_equal") for r in record["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
