"""Per-rank ordered fingerprint streams (JSONL) and the fixed environment they were taken in.

    {"kind": "header", "role": "trainer", "rank": 1, "env": {...}}
    {"step": 3, "rank": 1, "name": "grad/model.layers.0.self_attn.q_proj.weight",
     "shape": [64, 64], "dtype": "float32", "fp": "9c1e..."}

A stream is written by one process in program order; two runs in the same fixed environment
must produce identical streams. `read_trace` validates every line (errors carry the line
number) and `first_divergence` finds the first differing record.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlalign.monitor.fingerprint import fingerprint

# config sections that define the computation; run.*, logger, checkpoint, monitor, dist do not
ENV_SECTIONS = ("seed", "device", "model", "kernels", "generator", "trainer", "task", "algorithm")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_class() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return cpu_model()


def fixed_environment(cfg: DictConfig) -> dict:
    """Model, data, seed, software, hardware class and topology: what must match for bitwise repeatability."""
    c = OmegaConf.to_container(cfg, resolve=True)
    env = {k: c[k] for k in ENV_SECTIONS}
    env["software"] = {"torch": torch.__version__, "python": platform.python_version()}
    env["hardware"] = hardware_class()
    env["topology"] = {"trainer_ep": cfg.trainer.ep_size, "generator_ep": cfg.generator.ep_size,
                       "device": cfg.device}
    return env


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def env_difference(a: dict, b: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys whose values differ (keys under an allowed prefix are ignored)."""
    fa, fb = flatten(a), flatten(b)
    keys = sorted(set(fa) | set(fb))
    return [k for k in keys if fa.get(k) != fb.get(k) and not any(k == p or k.startswith(p + ".") for p in allowed)]


class Trace:
    def __init__(self, path: str | Path, role: str, rank: int, env: dict, start_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.step = rank, start_step
        kept = []
        if self.path.exists() and start_step > 0:  # a resumed run rewrites what follows its checkpoint
            for ln in self.path.read_text().splitlines():
                rec = json.loads(ln)
                if rec.get("kind") == "header" or rec["step"] < start_step:
                    kept.append(ln)
        if not kept:
            kept = [json.dumps({"kind": "header", "role": role, "rank": rank, "env": env})]
        self.path.write_text("".join(ln + "\n" for ln in kept))
        self._f = self.path.open("a")

    def record(self, name: str, t: torch.Tensor) -> None:
        self._f.write(json.dumps({"step": self.step, "rank": self.rank, "name": name, "shape": list(t.shape),
                                  "dtype": str(t.dtype).removeprefix("torch."), "fp": fingerprint(t)}) + "\n")

    def record_state(self, prefix: str, state: dict[str, torch.Tensor]) -> None:
        for name in sorted(state):
            self.record(f"{prefix}/{name}", state[name])

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TraceError(ValueError):
    pass


_FIELDS = {"step": int, "rank": int, "name": str, "shape": list, "dtype": str, "fp": str}


def read_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records); a truncated or corrupt line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    header, records = None, []
    with path.open() as f:
        for no, line in enumerate(f, 1):
            if not line.endswith("\n"):
                raise TraceError(f"{path}:{no}: truncated record (no newline; was the writer killed?)")
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{no}: corrupt record ({e.msg} at column {e.colno})") from None
            if no == 1:
                if rec.get("kind") != "header":
                    raise TraceError(f"{path}:1: not an rlalign trace (the first record is not a header)")
                header = rec
                continue
            bad = [k for k, t in _FIELDS.items() if not isinstance(rec.get(k), t)]
            if bad:
                raise TraceError(f"{path}:{no}: record lacks or mistypes field(s) {bad}")
            records.append(rec)
    if header is None:
        raise TraceError(f"{path}: empty trace")
    return header, records


def first_divergence(a: list[dict], b: list[dict]) -> dict | None:
    """The first index where the two record lists differ, with both records and whether the
    records before it in the same step (its inputs) all matched."""
    for i, (ra, rb) in enumerate(zip(a, b)):
        if ra != rb:
            same_step_before = [j for j in range(i) if a[j]["step"] == ra["step"]]
            return {"index": i, "a": ra, "b": rb, "inputs_matched": all(a[j] == b[j] for j in same_step_before),
                    "previous": a[i - 1]["name"] if i else None, "step_first": not same_step_before}
    if len(a) != len(b):
        i = min(len(a), len(b))
        return {"index": i, "a": a[i] if i < len(a) else None, "b": b[i] if i < len(b) else None,
                "inputs_matched": True, "previous": a[i - 1]["name"] if i else None, "length": (len(a), len(b)),
                "step_first": False}
    return None
