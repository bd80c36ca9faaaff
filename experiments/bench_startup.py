"""`rlalign train`'s start-up on a running Ray cluster: the product (both groups' processes started at once, their
models built at once where they do not share GPUs: rlalign/job.py) against the sequential start-up (the trainer
group started and built, then the generator group's processes started), alternating in one process over one
private cluster. Each run: the tiny default model on the CPU, one step; the time from the call to train() to its
return, and until the job's two groups are up.

    python experiments/bench_startup.py [--runs 6] [--trainer-ep 1] [--out DIR] [--name startup_cpu]
        [--overrides device=cuda kernels.backend=triton ...]   (config overrides added to every run)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

VARIANTS = ("product", "sequential")


@contextmanager
def sequential():
    """Each ActorGroup started as it is made (the trainer group built before the generator's processes start)."""
    from rlalign.actors import group

    init, start = group.ActorGroup.__init__, group.start_groups

    def started_init(self, *a, start=True, **k):
        init(self, *a, start=True, **k)
        self._started = True

    def start_rest(groups):
        start([g for g in groups if not getattr(g, "_started", False)])

    group.ActorGroup.__init__, group.start_groups = started_init, start_rest
    try:
        yield
    finally:
        group.ActorGroup.__init__, group.start_groups = init, start


def one_run(overrides: list[str], run_dir: Path) -> dict:
    from rlalign.config import load_config
    from rlalign.rl import train

    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    from rlalign import job

    real = job.Job.__init__

    def traced(self, *a, **k):
        real(self, *a, **k)
        marks["groups_up_s"] = time.perf_counter() - t0  # the Job made: both groups started

    job.Job.__init__ = traced
    try:
        train(load_config([*overrides, f"run.dir={run_dir}"]))
    finally:
        job.Job.__init__ = real
    wall = time.perf_counter() - t0
    return {"wall_s": wall, **marks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6, help="runs per variant (alternating)")
    ap.add_argument("--trainer-ep", type=int, default=1)
    ap.add_argument("--out", default=str(record.RESULTS))
    ap.add_argument("--name", default="startup_cpu")
    ap.add_argument("--overrides", nargs="*", default=[], help="config overrides added to every run")
    a = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    from rlalign import cluster

    overrides = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=4", "run.steps=1",
                 f"trainer.ep_size={a.trainer_ep}", "generator.ep_size=1", "logger.console=false",
                 "checkpoint.enabled=false", *a.overrides]
    real_disconnect = cluster.disconnect
    cluster.disconnect = lambda initialized: None  # one private cluster for every run (started by the first)
    root = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        one_run(overrides, root / "warm")  # starts the cluster; not timed
        for i in range(a.runs):
            for v in VARIANTS:
                if v == "sequential":
                    with sequential():
                        r = one_run(overrides, root / f"{v}{i}")
                else:
                    r = one_run(overrides, root / f"{v}{i}")
                runs[v].append(r)
                print(f"{v:10s} run {i}: {r['wall_s']:.2f} s (both groups up at {r['groups_up_s']:.2f} s)",
                      flush=True)
    finally:
        cluster.disconnect = real_disconnect
        real_disconnect(True)
        shutil.rmtree(root, ignore_errors=True)
    med = {v: statistics.median(r["wall_s"] for r in runs[v]) for v in VARIANTS}
    sync = {v: statistics.median(r["groups_up_s"] for r in runs[v]) for v in VARIANTS}
    summary = {"product_wall_s_median": med["product"], "sequential_wall_s_median": med["sequential"],
               "product_groups_up_s_median": sync["product"], "sequential_groups_up_s_median": sync["sequential"],
               "product_over_sequential": med["product"] / med["sequential"], "runs_per_variant": a.runs,
               "trainer_ep": a.trainer_ep, "overrides": a.overrides}
    shown = (f"a 1-step tiny run of `rlalign train` ({' '.join(a.overrides) or 'on the CPU'}) on a running private "
             f"cluster (trainer EP {a.trainer_ep}, generator EP 1), median of {a.runs} alternating runs: both groups "
             "started at once "
             f"{med['product']:.2f} s against {med['sequential']:.2f} s started one after the other "
             f"({med['product'] / med['sequential']:.2f}x); both groups up at {sync['product']:.2f} "
             f"against {sync['sequential']:.2f} s")
    path = record.write(a.name, {"summary": summary, "runs": runs, "what_it_shows": shown}, a.out,
                        command="python " + " ".join(sys.argv))
    print(shown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
