"""Environment record attached to every benchmark result (date, machine, versions, command)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from rlalign.monitor.trace import cpu_model

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "git_commit": commit,
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


def write(name: str, payload: dict, out_dir: str | os.PathLike | None = None) -> Path:
    out = Path(out_dir or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({**environment(), **payload}, indent=2) + "\n")
    return path
