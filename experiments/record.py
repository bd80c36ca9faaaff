"""Environment record attached to every benchmark result (date, machine, versions, command, git describe).

    python experiments/record.py NAME [--out DIR] [--command CMD] < result.json

wraps a JSON result printed by another tool (the last line of its stdout, e.g. `rlalign agree`) in
the same record and writes DIR/NAME.json.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from rlalign.monitor.trace import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def git_describe() -> str:
    """`git describe --always --dirty` of the checkout ("-dirty": uncommitted changes were measured);
    "unknown" outside a git checkout."""
    return _git("describe", "--always", "--dirty") or "unknown"


def environment(command: str | None = None) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command or " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        # a copied checkout (the GPU machine's) may carry a stale .git: the caller then names the code
        "git_commit": os.environ.get("RLALIGN_GIT_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        "git_describe": os.environ.get("RLALIGN_GIT_COMMIT") or git_describe(),
    }
    try:
        import triton

        env["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["machine"]["gpu"] = torch.cuda.get_device_name(0)
        env["machine"]["gpus"] = torch.cuda.device_count()
        env["versions"]["cuda"] = torch.version.cuda
    return env


def gpu_tag() -> str:
    """The card a result's default name carries: "h200", "h100", ... from torch's device name (the first
    `[A-Z]<digits>` word, lowered), "gpu" for a card without one, "cpu" without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    m = re.search(r"\b([A-Z]\d{2,4})\b", torch.cuda.get_device_name(0))
    return m.group(1).lower() if m else "gpu"


def write(name: str, payload: dict, out_dir: str | os.PathLike | None = None, command: str | None = None) -> Path:
    out = Path(out_dir or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**environment(command), **payload}, indent=2) + "\n")
    return path


def wait_gpu_free(limit_s: float = 60.0) -> None:
    """The previous run's actors are killed asynchronously: wait until their GPU memory is back."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return
        if not used or max(int(u) for u in used) < 4096:
            return
        time.sleep(1.0)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="wrap a JSON result from stdin in the environment record")
    ap.add_argument("name")
    ap.add_argument("--out", default=None)
    ap.add_argument("--command", default=None, help="the command that produced the result")
    a = ap.parse_args()
    lines = [x for x in sys.stdin.read().splitlines() if x.strip()]
    if not lines:
        sys.exit("record.py: no result on stdin")
    print("wrote", write(a.name, {"result": json.loads(lines[-1])}, a.out, a.command))


if __name__ == "__main__":
    main()
