"""Per-rank ordered fingerprint streams (JSONL) and the fixed environment they were taken in.

    {"kind": "header", "role": "trainer", "rank": 1, "env": {...}}
    {"step": 3, "rank": 1, "name": "grad/model.layers.0.self_attn.q_proj.weight",
     "shape": [64, 64], "dtype": "float32", "fp": "9c1e..."}
    {"step": 3, "rank": 1, "name": "state/grad/model.layers.0.mlp.experts.down_proj/expert", "first": 4,
     "shape": [64, 64], "dtype": "float32", "fps": ["0a41...", ...]}

A line with "fps" holds the records of the dim-0 rows of one tensor (per-expert records of a
stacked expert tensor): row r is the record named NAME + str(first + r). `read_trace` expands it,
so every reader sees one record per row, the same records at every EP size.

A stream is written by one process in program order; two runs in the same fixed environment
must produce identical streams. `read_trace` validates every line (errors carry the line
number) and `first_differing_record` finds the first differing record.

Cost. A step's records are fingerprinted in one launch per `record_many` (each byte read once)
on a side stream of the tensors' GPU, which waits for the work that produced them and is not
waited for by the work after them, until `fence` (the writer calls it before it next changes
those tensors in place); the tensors are kept from reuse until the launch has read them. Results
come back without a host wait: `flush` starts one copy to the host behind an event and hands the
writing to the trace's writer thread, which writes the records whose results have arrived, in
program order (the JSON lines and the host-side fingerprints of `record_known` run there, while the
caller goes on); the rest follow at a later flush, at `drain` (a checkpoint waits for it, so a trace
holds every record up to the checkpoint it resumes from) or at `close`. Every other call first waits
for the writer, whose errors are raised there. The work table of a launch is assembled from per-tensor chunk lists
cached by (address mod 16, rows, row bytes, first word index), so a step over the same shapes
builds no chunk list anew (kernels/fingerprint.py: segment_tables).
"""

from __future__ import annotations

import functools
import json
import platform
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlalign import kernels
from rlalign.fingerprint import Part, Pending, result_salts
from rlalign.monitor.divergence import first_divergence

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


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RowNames:
    """The names of a tensor's dim-0 rows as records: row r is NAME + str(first + r)."""

    name: str
    first: int = 0


class _Known:
    """Fingerprints computed on the host when their records are written (`fps()`), queued like a
    Pending read-back."""

    def __init__(self, fps: Callable[[], list[str]]):
        self.fps = fps

    def ready(self) -> bool:
        return True

    def hex(self) -> list[str]:
        return self.fps()


class Trace:
    """One process's stream. `start_step` > 0 opens it for a run resumed from the checkpoint after
    step start_step-1: the records of earlier steps are kept, later ones (written after that
    checkpoint by the interrupted run) dropped.

    The resume re-records some kept steps: it syncs the checkpoint's weights to the generator as
    step start_step-1, whose weights the interrupted run recorded already. A re-recorded record
    equal to the one the trace holds (same step, name and occurrence) is not written again, so a
    resumed trace equals the uninterrupted run's; one that differs replaces the held record (the
    stream then shows the weights this run really had, and `rlalign compare` the difference where
    it arose). Without a trace to continue (resumed into a new run dir) the header records
    start_step and the re-recorded steps are written; compare aligns such a trace by its keys.
    """

    def __init__(self, path: str | Path, role: str, rank: int, env: dict, start_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.step, self.start_step = rank, start_step, start_step
        kept = _history(self.path, start_step) if self.path.exists() and start_step > 0 else []
        self.continued = bool(kept)  # continues an earlier run's stream
        if not kept:
            kept = [json.dumps({"kind": "header", "role": role, "rank": rank, "env": env, "start_step": start_step})]
        self.path.write_text("".join(ln + "\n" for ln in kept))
        self._held: dict[int, dict[tuple, list[tuple[int, dict]]]] = {}  # step -> (step, name) -> (line no, record)
        self._seen: dict[tuple, int] = {}  # (step, name) -> times re-recorded
        self._pending: dict[int, dict] = {}  # line no -> the re-record that replaces the held record
        self.replaced: list[str] = []  # names of held records that a re-record replaced
        self._f = self.path.open("a")
        self._open: list[tuple[list[dict], np.ndarray, torch.Tensor]] = []  # (records, salts, sums): not read back
        self._queue: deque[tuple[list[dict], Pending]] = deque()  # read back (or on the way), not written
        self._side: dict[torch.device, torch.cuda.Stream] = {}  # per GPU: the stream the fingerprints run on
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="trace-writer")
        self._writing: Future | None = None  # the flush the writer thread is doing

    def record(self, name: str, t: torch.Tensor) -> None:
        self.record_many([(name, t)])

    def record_state(self, prefix: str, state: dict[str, torch.Tensor]) -> None:
        """One record per tensor, in name order."""
        self.record_many([(f"{prefix}/{n}", state[n]) for n in sorted(state)])

    def record_many(self, items: list[tuple[str | RowNames, torch.Tensor]]) -> None:
        """Records in the given order, one launch per run of tensors on one device: (name, t) is
        one record of t; (RowNames, t) one record per dim-0 row of t (a tensor of shape
        t.shape[1:]), written as one line (per-expert records of a stacked expert tensor, in place)."""
        self._join()
        parts, recs = [], []
        for name, t in items:
            if parts and t.device != parts[-1].tensor.device:
                self._add(parts, recs)
                parts, recs = [], []
            rows = isinstance(name, RowNames)
            if rows and t.dim() == 0:
                raise ValueError(f"trace {self.path}: {name.name}: rows of a 0-d tensor")
            parts.append(Part(t, rows=rows, name=name.name if rows else name))
            rec = {"step": self.step, "rank": self.rank, "name": name.name if rows else name}
            if rows:
                rec["first"] = name.first
            rec.update(shape=list(t.shape[1:] if rows else t.shape), dtype=_dtype_name(t.dtype))
            rec["fps" if rows else "fp"] = t.shape[0] if rows else None
            recs.append(rec)
        self._add(parts, recs)

    def record_known(self, items: list[tuple[str, tuple[int, ...], torch.dtype]],
                     fps: Callable[[], list[str]]) -> None:
        """Records (name, shape, dtype) whose fingerprints the host has (the weight sync's of the same
        tensors: the same function), one per item from `fps()`, which runs when the records are
        written (the next flush), not now; written after everything recorded before them."""
        self._join()
        self._read_back()
        recs = [{"step": self.step, "rank": self.rank, "name": n, "shape": list(shape), "dtype": _dtype_name(dt),
                 "fp": None} for n, shape, dt in items]
        self._queue.append((recs, _Known(fps)))

    def _add(self, parts: list[Part], recs: list[dict]) -> None:
        if not parts:
            return
        device = parts[0].tensor.device
        if device.type != "cuda":
            self._open.append((recs, result_salts(parts), kernels.fingerprint_sums(parts)))
            return
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the tensors as the work so far leaves them
        with torch.cuda.stream(side):
            sums = kernels.fingerprint_sums(parts)
        for p in parts:
            p.tensor.record_stream(side)  # not reused before the side stream has read it
        self._open.append((recs, result_salts(parts), sums))

    def fence(self) -> None:
        """The current stream waits (on the device) for the fingerprints launched so far: call it
        before changing a recorded tensor in place."""
        for device, side in self._side.items():
            torch.cuda.current_stream(device).wait_stream(side)

    def _read_back(self) -> None:
        """The results recorded since the last call: one device-to-host copy per run of records on
        one device (one per step on a GPU rank)."""
        while self._open:
            device = self._open[0][2].device
            n = next((i for i, (_, _, s) in enumerate(self._open) if s.device != device), len(self._open))
            run, self._open = self._open[:n], self._open[n:]
            recs = [r for rs, _, _ in run for r in rs]
            salts = np.concatenate([x for _, x, _ in run])
            if device.type == "cuda":
                with torch.cuda.stream(self._side[device]):
                    self._queue.append((recs, Pending(torch.cat([s for _, _, s in run]), salts)))
            else:
                self._queue.append((recs, Pending(torch.cat([s for _, _, s in run]), salts)))

    def _join(self) -> None:
        """Wait for the writer thread's flush; its error, if any, is raised here."""
        if self._writing is not None:
            writing, self._writing = self._writing, None
            writing.result()

    def drain(self, wait: bool = True) -> None:
        """Write the records whose results are back (wait=True: all of them), in program order."""
        self._join()
        self._read_back()
        self._write_ready(wait)

    def _write_ready(self, wait: bool) -> None:
        while self._queue and (wait or self._queue[0][1].ready()):
            recs, pending = self._queue.popleft()
            fps, at = pending.hex(), 0
            for rec in recs:
                if "fps" in rec:
                    rec["fps"], at = fps[at : at + rec["fps"]], at + rec["fps"]
                else:
                    rec["fp"], at = fps[at], at + 1
                self._write(rec)

    def _write(self, rec: dict) -> None:
        if self.continued and rec["step"] < self.start_step:
            self._rerecord(rec)
        else:
            self._f.write(json.dumps(rec) + "\n")

    def _rerecord(self, rec: dict) -> None:
        key = (rec["step"], rec["name"])
        n = self._seen[key] = self._seen.get(key, 0) + 1
        if rec["step"] not in self._held:
            held: dict[tuple, list] = {}
            for no, ln in enumerate(self.path.read_text().splitlines()[1:], 1):
                r = json.loads(ln)
                if r["step"] == rec["step"]:
                    held.setdefault((r["step"], r["name"]), []).append((no, r))
            self._held[rec["step"]] = held
        held = self._held[rec["step"]].get(key, [])
        if n > len(held):  # the earlier run did not record it
            self._f.write(json.dumps(rec) + "\n")
            return
        no, old = held[n - 1]
        if old != rec:
            self._pending[no] = rec
            held[n - 1] = (no, rec)

    def _apply_replacements(self) -> None:
        """Rewrite the held records that re-records replaced (once per flush, not per record)."""
        if not self._pending:
            return

        self._f.close()
        lines = self.path.read_text().splitlines()
        olds = {no: json.loads(lines[no]) for no in self._pending}
        for no, rec in self._pending.items():
            lines[no] = json.dumps(rec)
        self.path.write_text("".join(ln + "\n" for ln in lines))
        self._f = self.path.open("a")
        recs = [self._pending[no] for no in sorted(self._pending)]
        # a re-record of another shape is another shard (the run resumed at another EP size): no warning
        changed = [no for no in sorted(self._pending) if _layout(olds[no]) == _layout(self._pending[no])]
        if changed:
            first, old = self._pending[changed[0]], olds[changed[0]]
            warnings.warn(f"{self.path}: the resumed run re-recorded {len(changed)} record(s) of step {first['step']} "
                          f"differently from the trace, first {first['name']} (fingerprint {first['fp']}, the trace "
                          f"held {old['fp']}); the trace now holds what this run recorded", stacklevel=3)
        self.replaced += [r["name"] for r in recs]
        self._pending = {}

    def flush(self) -> None:
        """Start reading back what was recorded; the writer thread writes what has arrived (never
        waits for the device, nor for the writing)."""
        self._join()
        self._read_back()
        self._writing = self._writer.submit(self._flush_written)

    def _flush_written(self) -> None:
        try:
            self._write_ready(wait=False)
            self._apply_replacements()
            self._f.flush()
        except OSError as e:  # a full disk: a buffered write's error names no file; say which
            if e.filename is not None:
                raise
            raise OSError(e.errno, f"{e.strerror} (writing the trace)", str(self.path)) from None

    def close(self) -> None:
        try:
            self.drain(wait=True)
            self._apply_replacements()
        finally:
            self._f.close()
            self._writer.shutdown()


def _layout(rec: dict) -> dict:
    """A record without its fingerprints (a row record: their count)."""
    out = {k: v for k, v in rec.items() if k not in ("fp", "fps")}
    return {**out, "rows": len(rec["fps"])} if isinstance(rec.get("fps"), list) else out


def _history(path: Path, start_step: int) -> list[str]:
    """The header and the records of steps < start_step of an existing trace (a last line cut
    short by a killed writer is dropped: it was being written after the checkpoint)."""
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()
    kept = []
    for no, ln in enumerate(lines, 1):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{no}: corrupt record ({e.msg} at column {e.colno}); cannot resume the trace") \
                from None
        if no == 1:
            if rec.get("kind") != "header":
                raise TraceError(f"{path}:1: not an rlalign trace (the first record is not a header)")
            kept.append(ln)
        elif rec["step"] < start_step:
            kept.append(ln)
    return kept


class TraceError(ValueError):
    pass


_FIELDS = {"step": int, "rank": int, "name": str, "shape": list, "dtype": str, "fp": str}
_ROW_FIELDS = {"step": int, "rank": int, "name": str, "first": int, "shape": list, "dtype": str, "fps": list}


def read_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records); a truncated or corrupt line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    header, records = None, []
    with path.open("rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                line = raw.decode()
            except UnicodeDecodeError as e:
                raise TraceError(f"{path}:{no}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                                 "not an rlalign trace") from None
            if not line.endswith("\n"):
                raise TraceError(f"{path}:{no}: truncated record (no newline; was the writer killed?)")
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{no}: corrupt record ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise TraceError(f"{path}:{no}: a JSON {type(rec).__name__}, not a record (not an rlalign trace?)")
            if no == 1:
                if rec.get("kind") != "header":
                    raise TraceError(f"{path}:1: not an rlalign trace (the first record is not a header)")
                header = rec
                continue
            rows = "fps" in rec
            bad = [k for k, t in (_ROW_FIELDS if rows else _FIELDS).items() if not isinstance(rec.get(k), t)]
            if rows and not bad and not all(isinstance(v, str) for v in rec["fps"]):
                bad = ["fps"]
            if bad:
                raise TraceError(f"{path}:{no}: record lacks or mistypes field(s) {bad}")
            if rows:  # one record per row (module docstring)
                records += [{"step": rec["step"], "rank": rec["rank"], "name": f"{rec['name']}{rec['first'] + r}",
                             "shape": rec["shape"], "dtype": rec["dtype"], "fp": fp} for r, fp in enumerate(rec["fps"])]
            else:
                records.append(rec)
    if header is None:
        raise TraceError(f"{path}: empty trace")
    return header, records


def align_resumed(ha: dict, ra: list[dict], hb: dict, rb: list[dict]) -> tuple[list[dict], list[dict], list[str]]:
    """Two streams made comparable when one begins at a resume without the earlier run's history
    (its header's start_step s > 0): of the other stream this keeps the records of steps >= s
    and, of earlier steps, those the resumed one re-recorded (same step and name), in its own
    order. Returns both lists and a note per trimmed stream."""

    def trim(resumed_header, resumed, other, names):
        s = resumed_header.get("start_step", 0)
        keys = {(r["step"], r["name"]) for r in resumed if r["step"] < s}
        kept = [r for r in other if r["step"] >= s or (r["step"], r["name"]) in keys]
        if len(kept) == len(other):
            return other, []
        return kept, [f"{names[0]} begins at a resume (step {s}) without the earlier steps: compared {names[1]}'s "
                      f"records from step {s} on and the {len(keys)} earlier ones {names[0]} re-recorded "
                      f"({len(other) - len(kept)} left out)"]

    rb2, nb = trim(ha, ra, rb, ("A", "B"))
    ra2, na = trim(hb, rb, ra, ("B", "A"))
    return ra2, rb2, nb + na


def first_differing_record(a: list[dict], b: list[dict]) -> dict | None:
    """The first index where the two record lists differ (divergence.first_divergence), with both
    records and whether the records before it in the same step (its inputs) all matched."""
    i = first_divergence(range(max(len(a), len(b))), lambda i: i >= len(a) or i >= len(b) or a[i] != b[i])
    if i is None:
        return None
    if i < len(a) and i < len(b):
        ra = a[i]
        same_step_before = [j for j in range(i) if a[j]["step"] == ra["step"]]
        return {"index": i, "a": ra, "b": b[i], "inputs_matched": all(a[j] == b[j] for j in same_step_before),
                "previous": a[i - 1]["name"] if i else None, "step_first": not same_step_before}
    return {"index": i, "a": a[i] if i < len(a) else None, "b": b[i] if i < len(b) else None,
            "inputs_matched": True, "previous": a[i - 1]["name"] if i else None, "length": (len(a), len(b)),
            "step_first": False}
