"""Cost of the monitor's fingerprints in an RL step: `rlalign train` on the embedded default with
monitor.fingerprints=off / default / layers, interleaved (off, default, layers, off, ...) to
cancel drift; mean time/step_s over the steps after the first two of each run.

    python experiments/bench_monitor.py [--steps 12] [--reps 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

LEVELS = ("off", "default", "layers")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import os

    import ray

    from rlalign.config import load_config
    from rlalign.rl import train

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False)
    times: dict[str, list[float]] = {lv: [] for lv in LEVELS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for lv in LEVELS:
                d = Path(tmp) / f"{lv}-{rep}"
                train(load_config([f"run.steps={a.steps}", f"run.dir={d}", f"monitor.fingerprints={lv}",
                                   "logger.console=false", *a.overrides]))
                rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
                times[lv] += [r["time/step_s"] for r in rows[a.warmup:]]
                print(f"rep {rep} {lv:8}: mean step {statistics.mean(times[lv][-(a.steps - a.warmup):]):.3f}s",
                      flush=True)
    ray.shutdown()
    mean = {lv: statistics.mean(v) for lv, v in times.items()}
    res = {lv: {"mean_step_s": mean[lv], "median_step_s": statistics.median(times[lv]), "steps": len(times[lv]),
                "overhead_vs_off": mean[lv] / mean["off"] - 1} for lv in LEVELS}
    for lv in LEVELS:
        print(f"{lv:8} mean step {mean[lv]:.3f}s  overhead vs off {100 * res[lv]['overhead_vs_off']:+.1f}%")
    setup = {"steps_per_run": a.steps, "warmup_steps_dropped": a.warmup, "reps": a.reps, "overrides": a.overrides,
             "config": "embedded default (tiny MoE, repeat task, trainer EP 2, generator EP 1, CPU)"}
    print("wrote", record.write("monitor_overhead_cpu", {"setup": setup, "levels": res}, a.out))


if __name__ == "__main__":
    main()
