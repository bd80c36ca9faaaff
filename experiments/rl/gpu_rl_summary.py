"""Summarise a GPU `rlalign train` run (metrics.jsonl) into results JSON: mismatch totals and the
step-time breakdown (generate / score / train / sync), first steps (compile/warm-up) shown apart.

    python experiments/rl/gpu_rl_summary.py RUN_DIR NAME [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("name")
    ap.add_argument("--out", default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--command", default=None, help="the run's command line (default: this script's)")
    a = ap.parse_args()
    run = Path(a.run_dir)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    keys = ["time/generate_s", "time/reward_s", "time/train_s", "time/sync_s", "time/checkpoint_s", "time/step_s"]
    steady = rows[a.warmup:] or rows
    mem = ["memory/trainer_peak_gib", "memory/generator_peak_gib"]  # CUDA runs: busiest rank's peak
    out = {
        "steps": len(rows),
        "tokens_total": sum(r["consistency/tokens"] for r in rows),
        "mismatched_tokens_total": sum(r["consistency/mismatched_tokens"] for r in rows),
        "max_abs_diff_max": max(r["consistency/logprob_abs_diff_max"] for r in rows),
        "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
        "breakdown_median_s_after_warmup": {k.split("/")[1]: statistics.median(r[k] for r in steady) for k in keys},
        "first_step_s": rows[0]["time/step_s"],
        "peak_memory_gib_max": {k.split("/")[1]: max(r[k] for r in rows if k in r)
                                for k in sorted({k for r in rows for k in r if k.startswith("memory/")})},
        "config": (run / "config.yaml").read_text() if (run / "config.yaml").exists() else None,
        "per_step": [{k: r[k] for k in ["step", "reward/mean", "consistency/tokens", "consistency/mismatched_tokens",
                                         *keys, *mem] if k in r} for r in rows],
    }
    for k, v in out["breakdown_median_s_after_warmup"].items():
        print(f"{k:12} {v:.3f}s")
    for k, v in out["peak_memory_gib_max"].items():
        print(f"{k:24} {v:.1f} GiB")
    print(f"mismatched {out['mismatched_tokens_total']} / {out['tokens_total']} tokens over {len(rows)} steps")
    print("wrote", record.write(a.name, out, a.out, a.command))


if __name__ == "__main__":
    main()
