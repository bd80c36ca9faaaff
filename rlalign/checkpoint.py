"""Checkpoints: trainer state through torch.distributed.checkpoint plus the driver's meta.json.

    RUN_DIR/checkpoints/step_000012/        complete (meta.json present)
    RUN_DIR/checkpoints/step_000015.tmp/    being written; ignored by resume

A checkpoint at step k holds the state after step k: model, fp32 masters, AdamW state (expert
tensors keyed per global expert, so any EP size can load them), and meta.json with the step,
the data position, RNG states and the weights fingerprint. The trainer ranks write into the
.tmp directory; the driver adds meta.json and renames it into place: a crash mid-write leaves
the previous checkpoint as the latest complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

_STEP_DIR = re.compile(r"^step_(\d{6})$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tmp_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:06d}.tmp"


def complete(run_dir: Path, step: int, meta: dict, keep: int) -> Path:
    """Publish a written .tmp checkpoint atomically; prune old ones beyond `keep`."""
    tmp = tmp_path(run_dir, step)
    meta = {**meta, "step": step, "python_rng": repr(random.getstate()), "torch_rng": torch.get_rng_state().tolist()}
    (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep > 0:
        for old in list_complete(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_complete(run_dir: Path) -> list[Path]:
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name)[1]))


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """checkpoint.resume: 'never' -> None; 'auto' -> the latest complete one (or None); else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        done = list_complete(run_dir)
        return done[-1] if done else None
    p = Path(resume)
    if not (p / "meta.json").is_file():
        raise FileNotFoundError(f"checkpoint.resume={resume!r}: not a complete checkpoint (no meta.json)")
    return p


def read_meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())
