"""`rlalign agree` for trainer EP {1,2,4} x generator EP {1,2} x {bf16, fp32}, deterministic, plus the
default-mode negative twin; each row is the command's JSON and its wall time (process start-up
included).

    python experiments/rl/ep_agree_matrix.py [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402


def agree(overrides: list[str]) -> dict:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "rlalign.cli", "agree", *overrides], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"rlalign agree {' '.join(overrides)} failed:\n{p.stderr}")
    return {"overrides": overrides, "wall_s": round(wall, 2), **json.loads(p.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--trainer-ep", default="1,2,4")
    ap.add_argument("--generator-ep", default="1,2")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for dtype in ("bfloat16", "float32"):
        for mode in ("deterministic", "default"):
            for tep in map(int, a.trainer_ep.split(",")):
                for gep in map(int, a.generator_ep.split(",")):
                    if mode == "default" and (tep, gep) != (2, 1):
                        continue  # one negative twin per dtype
                    r = agree([f"device={a.device}", f"model.dtype={dtype}", f"kernels.mode={mode}",
                               f"trainer.ep_size={tep}", f"generator.ep_size={gep}"])
                    rows.append(r)
                    print(f"{dtype:9} {mode:13} trainer EP {tep} generator EP {gep}: tokens {r['tokens']:5d} "
                          f"mismatched {r['mismatched_tokens']:5d} max|d| {r['max_abs_diff']:.3g}  {r['wall_s']:.1f}s",
                          flush=True)
    name = a.name or f"ep_agree_{a.device.split(':')[0]}"
    print("wrote", record.write(name, {"rows": rows}, a.out))


if __name__ == "__main__":
    main()
