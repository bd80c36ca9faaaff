"""A checkpoint directory's layout, its files and their checks (rlalign.checkpoint writes and loads
them): paths, the small-file helpers where a full disk shows up, and verify / resolve_resume /
read_meta, which read JSON and safetensors headers only (tensor data only for fingerprints). Every
problem is a CheckpointError of one line naming the checkpoint, the file, what is wrong and the
newest intact other checkpoint."""

from __future__ import annotations

import errno as _errno
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open

from rlalign.fingerprint import fingerprint

FORMAT = "rlalign-checkpoint/2 (DCP safetensors shards + JSON index)"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{6})$")
_STEP_ANY = re.compile(r"^step_(\d{6})(\.tmp)?$")
FPS = re.compile(r"^fingerprints-rank(\d{5})\.json$")
SUFFIX = ".safetensors"
_MAX_HEADER = 100_000_000  # bytes; safetensors' own limit
ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not loadable; the message is one line."""


class Damage(Exception):
    """Internal: what is wrong with one file of a checkpoint (file name, description)."""

    def __init__(self, file: str, what: str):
        super().__init__(file, what)
        self.file, self.what = file, what


# --- paths ------------------------------------------------------------------------------------------
def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tmp_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:06d}.tmp"


def step_of(path: Path) -> int | None:
    m = _STEP_ANY.match(Path(path).name)
    return int(m[1]) if m else None


def run_dir_of(path: Path) -> Path | None:
    path = Path(path)
    return path.parent.parent if path.parent.name == "checkpoints" else None


_SHARD = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")


def shard_name(rank: int, index: int = 1, of: int = 1) -> str:
    """The file DCP's HuggingFaceStorageWriter(save_distributed=True) writes for a rank's bucket
    `index` of `of`."""
    return f"shard-{rank + 1:05d}-model-{index:05d}-of-{of:05d}{SUFFIX}"


def rank_of_file(name: str) -> int | None:
    """The trainer rank that wrote a shard file (shard_name's inverse), or None."""
    m = _SHARD.match(name)
    return int(m[1]) - 1 if m else None


def list_complete(run_dir: Path) -> list[Path]:
    """step_NNNNNN directories with a meta.json, oldest first (not checked: see verify)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if _STEP_DIR.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name)[1]))


_LEFTOVER = re.compile(r"^step_(\d{6})\.(tmp|old|pruned)$")


def prune(path: Path) -> None:
    """Remove the checkpoint at `path`: renamed to step_N.pruned first (one atomic step), then deleted, so
    a process killed mid-delete leaves no half-deleted step_N that reads as a checkpoint, only a
    .pruned directory that clear_leftovers removes at the next start."""
    trash = path.with_name(path.name + ".pruned")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clear_leftovers(run_dir: Path) -> list[str]:
    """What an interrupted run left in run_dir/checkpoints, before a run there starts (no save is in flight:
    the run dir's lock is held): a prune cut short (step_N.pruned: removed), a save never published
    (step_N.tmp: removed), a publish cut short between moving step_N aside and renaming its replacement
    into place (step_N.old: put back where no step_N is, else removed). Returns what it did, one phrase each."""
    d = checkpoint_dir(run_dir)
    done = []
    for p in sorted(d.iterdir()) if d.is_dir() else ():
        m = _LEFTOVER.match(p.name)
        if m is None or not p.is_dir():
            continue
        final = p.with_name(f"step_{m[1]}")
        if m[2] == "old" and not final.exists():
            os.replace(p, final)
            done.append(f"{p.name} put back as {final.name}")
            continue
        nbytes = dir_bytes(p)
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"{p.name} removed ({size_text(nbytes)})")
    return done


# --- small file helpers (the places a full disk shows up) ------------------------------------------
def oneline(s: object) -> str:
    return " ".join(str(s).split())


def cause(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{os.strerror(e.errno)} ({_errno.errorcode.get(e.errno, e.errno)})"
    return oneline(f"{type(e).__name__}: {e}")


def _write_file(path: Path, data: bytes) -> None:
    """Write, flush and fsync `path` (raises OSError, e.g. ENOSPC)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, obj: object) -> None:
    part = path.with_name(path.name + ".part")
    _write_file(part, (json.dumps(obj) + "\n").encode())
    os.replace(part, path)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- reading and checking -------------------------------------------------------------------------
def read_json(path: Path) -> object:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise Damage(path.name, "missing") from None
    except OSError as e:
        raise Damage(path.name, f"unreadable: {cause(e)}") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise Damage(path.name, f"invalid JSON ({msg}{where}; {len(raw)} bytes, truncated?)") from None


def read_header(path: Path) -> dict:
    """The tensor entries of a safetensors file's JSON header, after checking that the header and
    the data it describes cover the file exactly."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise Damage(name, f"truncated: {size} bytes, shorter than a safetensors header")
            n = int.from_bytes(raw, "little")
            if n > _MAX_HEADER:
                raise Damage(name, f"not a safetensors file (header length {n})")
            if 8 + n > size:
                raise Damage(name, f"truncated: {size} bytes, its header alone needs {8 + n}")
            text = f.read(n)
    except FileNotFoundError:
        raise Damage(name, "missing") from None
    except OSError as e:
        raise Damage(name, f"unreadable: {cause(e)}") from None
    try:
        header = json.loads(text)
        header.pop("__metadata__", None)
        end = 0
        for key, v in header.items():
            lo, hi = v["data_offsets"]
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
                raise ValueError(f"bad data_offsets of {key!r}")
            end = max(end, hi)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise Damage(name, f"malformed safetensors header ({oneline(e)})") from None
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "trailing bytes"
        raise Damage(name, f"{what}: {size} bytes, its header describes {8 + n + end}")
    return header


def _check(path: Path, tensors: bool) -> dict:
    """meta.json of a checkpoint after the checks of verify(); raises Damage."""
    path = Path(path)
    if not path.is_dir():
        raise Damage(str(path), "not a directory" if path.exists() else "no such directory")
    meta = read_json(path / META)
    if not isinstance(meta, dict):
        raise Damage(META, "not a JSON object")
    if meta.get("format") != FORMAT:
        raise Damage(META, f"format {meta.get('format')!r}, expected {FORMAT!r} (an older checkpoint holds a "
                            f"pickled DCP .metadata, which is not loaded)")
    for key, typ in (("step", int), ("files", dict), ("tensors", dict)):
        if not isinstance(meta.get(key), typ):
            raise Damage(META, f"field {key!r} missing or not {typ.__name__}")
    named = re.fullmatch(r"step_(\d+)", path.name)
    if isinstance(meta["step"], bool) or meta["step"] < 0 or named and int(named[1]) != meta["step"]:
        raise Damage(META, f"step {meta['step']!r} does not match the directory {path.name}" if named else
                     f"step {meta['step']!r} is not a step number (an int >= 0)")
    files: dict = meta["files"]
    for f in sorted(p.name for p in path.iterdir() if p.name.endswith(SUFFIX)):
        if f not in files:
            raise Damage(f, "a .safetensors file meta.json does not list (not part of this checkpoint)")
    headers = {}
    for f, info in sorted(files.items()):
        p = path / f
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or "/" in f:
            raise Damage(META, f"malformed entry for file {f!r}")
        if not p.is_file():
            raise Damage(f, "missing")
        size = p.stat().st_size
        if size != info["bytes"]:
            raise Damage(f, f"{size} bytes, meta.json records {info['bytes']} (truncated or overwritten)")
        headers[f] = read_header(p)
    for key, t in meta["tensors"].items():
        try:
            f, dtype, shape = t["file"], t["dtype"], list(t["shape"])
            str(t["fp"])
        except (TypeError, KeyError):
            raise Damage(META, f"malformed entry for tensor {key!r}") from None
        if f not in headers:
            raise Damage(META, f"tensor {key!r} is in {f!r}, a file it does not list")
        h = headers[f].get(key)
        if not isinstance(h, dict) or h.get("dtype") != dtype or h.get("shape") != shape:
            raise Damage(f, f"tensor {key!r} missing or not {dtype}{shape} as meta.json records")
    if tensors:
        _check_fingerprints(path, meta)
    return meta


def _check_fingerprints(path: Path, meta: dict) -> None:


    by_file: dict[str, list[str]] = {}
    for key, t in meta["tensors"].items():
        by_file.setdefault(t["file"], []).append(key)
    for f, keys in sorted(by_file.items()):
        try:
            with safe_open(str(path / f), framework="pt") as st:
                for key in sorted(keys):
                    got, want = fingerprint(st.get_tensor(key)), meta["tensors"][key]["fp"]
                    if got != want:
                        raise Damage(f, f"tensor {key!r} has fingerprint {got}, meta.json records {want} "
                                         f"(its bytes changed)")
        except Damage:
            raise
        except Exception as e:  # safetensors' own errors
            raise Damage(f, f"unreadable: {cause(e)}") from None


def newest_intact(run_dir: Path, before: int | None = None, exclude: Path | None = None,
                  tensors: bool = False) -> Path | None:
    """The newest complete checkpoint of run_dir that passes verify(., tensors) (steps < before;
    not `exclude`), or None."""
    ex = Path(exclude).resolve() if exclude is not None else None
    for p in reversed(list_complete(run_dir)):
        if (before is not None and step_of(p) >= before) or (ex is not None and p.resolve() == ex):
            continue
        try:
            _check(p, tensors)
            return p
        except Damage:
            continue
    return None


RESUME = "checkpoint.resume={}"  # how a train user takes another checkpoint (an export's: rlalign.export.EXPORT)


def _hint(path: Path, tensors: bool = False, use: str = RESUME) -> str:
    run_dir = run_dir_of(path)
    if run_dir is None:
        return ""
    other = newest_intact(run_dir, exclude=path, tensors=tensors)
    if other is None:
        return f"; {checkpoint_dir(run_dir)} holds no other intact checkpoint"
    return f"; newest intact checkpoint: {other} ({use.format(other)})"


def damaged(path: Path, d: Damage, tensors: bool = False, use: str = RESUME) -> CheckpointError:
    """`use`: how the user names another checkpoint, a format of its path (the hint's)."""
    return CheckpointError(oneline(f"checkpoint {path} is not loadable: {d.file}: {d.what}"
                                   f"{_hint(path, tensors, use)}"))


def fitting_index(path: Path, meta: dict, state: dict[str, torch.Tensor], rank: int | None = None) -> dict:
    """meta.json's tensor index once the checkpoint fits the trainer's `state` (one rank's, or with rank None
    the whole trainer's, as the driver checks it before Ray starts): every tensor of the state there with
    its shape and dtype, and every model tensor of the checkpoint one the trainer has (an expert's tensors
    by their parameter: each rank holds some experts of every one); else CheckpointError naming the first
    tensor that does not fit."""
    index, on = meta["tensors"], "" if rank is None else f" (rank {rank})"
    for k, t in state.items():
        e = index.get(k)
        if e is None:
            raise mismatch(path, meta, f"no tensor {k!r}, which the trainer holds{on}")
        if e["dtype"] != ST_DTYPE.get(t.dtype) or list(e["shape"]) != list(t.shape):
            raise mismatch(path, meta, f"tensor {k!r} is {e['dtype']}{e['shape']} in {e['file']}, the trainer holds "
                                       f"{ST_DTYPE.get(t.dtype, t.dtype)}{list(t.shape)}{on}")
    held = {_EXPERT.sub("", k) for k in state if k.startswith("model/")}
    extra = sorted(k for k in index if k.startswith("model/") and _EXPERT.sub("", k) not in held)
    if extra:
        e = index[extra[0]]
        raise mismatch(path, meta, f"tensor {extra[0]!r} ({e['dtype']}{e['shape']} in {e['file']}) is not part of "
                                   f"the trainer's model")
    return index


_EXPERT = re.compile(r"/expert\d+$")
MODEL_SHAPE = ("hidden_size", "num_hidden_layers", "num_experts", "moe_intermediate_size", "vocab_size")


def mismatch(path: Path, meta: dict, what: str) -> CheckpointError:
    """An intact checkpoint that does not fit the trainer (another model shape or config): `what`, and the
    model its meta.json records. No other checkpoint is named: the run's others hold the same model."""
    m = meta.get("model")
    held = (f"; it holds a model of {', '.join(f'{k}={m.get(k)}' for k in MODEL_SHAPE)} (its meta.json)"
            if isinstance(m, dict) else "")
    return CheckpointError(oneline(f"checkpoint {path} does not fit this run's model or config: {what}{held}"))


def verify(path: Path, tensors: bool = False, use: str = RESUME) -> dict:
    """meta.json of the checkpoint at `path` once its files check out (see the module docstring);
    tensors=True also recomputes every tensor's fingerprint (reads all data). Raises CheckpointError
    naming the checkpoint, the file, what is wrong and the newest intact other checkpoint."""
    try:
        return _check(Path(path), tensors)
    except Damage as d:
        raise damaged(Path(path), d, tensors, use) from None


def resolve_resume(run_dir: Path, resume: str) -> Path | None:
    """checkpoint.resume: 'never' -> None; a path -> that checkpoint once verify() passes (else
    CheckpointError); 'auto' -> the newest complete checkpoint that passes verify(). A damaged newer
    one is skipped and announced on stderr (the run redoes its steps, deterministically); if
    checkpoints exist but none passes, CheckpointError rather than a silent start from step 0.
    verify() here reads no tensor data: the trainer ranks check every fingerprint on load."""
    if resume == "never":
        return None
    if resume == "auto":
        done = list_complete(run_dir)
        for p in reversed(done):
            try:
                _check(p, tensors=False)
                return p
            except Damage as d:
                print(f"rlalign: checkpoint {p} is damaged ({d.file}: {d.what}); skipping it", file=sys.stderr)
        if done:
            raise CheckpointError(f"checkpoint.resume=auto: none of the {len(done)} checkpoints in "
                                  f"{checkpoint_dir(run_dir)} is intact (see above); refusing to start from step 0")
        return None
    p = Path(resume)
    if not (p / META).is_file():
        run = p if checkpoint_dir(p).is_dir() else p.parent if p.name == "checkpoints" else None
        newest = newest_intact(run) if run is not None else None
        hint = f"; it is a run's directory, whose newest intact checkpoint is {newest}" if newest else ""
        if p.name == META and p.is_file():
            raise FileNotFoundError(f"checkpoint.resume={resume!r}: a checkpoint's {META}, not the checkpoint; give "
                                    f"its directory: checkpoint.resume={p.parent}")
        raise FileNotFoundError(f"checkpoint.resume={resume!r}: not a complete checkpoint (no meta.json){hint}")
    verify(p)
    return p


def read_meta(path: Path) -> dict:
    """meta.json as a dict; CheckpointError (naming the file) if it is not valid JSON."""
    try:
        meta = read_json(Path(path) / META)
    except Damage as d:
        raise damaged(Path(path), d) from None
    if not isinstance(meta, dict):
        raise damaged(Path(path), Damage(META, "not a JSON object"))
    return meta


# --- sizes, rates and progress (saves, loads, exports) -------------------------------------------
def size_text(n: float) -> str:
    """Bytes as '100 kB' / '3.23 MB' / '61.2 GB' (3 significant digits)."""
    if n < 1e6:
        return f"{n / 1e3:.3g} kB"
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _seconds_text(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class Progress:
    """Progress lines of a long transfer on stderr (never stdout, whose last line is a command's JSON
    summary): nothing for one that ends within `after_s`; then a line every `every_s` with the bytes
    done, the rate and the time left, and one when it ends. `clock` and `out` are for tests."""

    AFTER_S = 3.0
    EVERY_S = 5.0

    def __init__(self, what: str, total: int, after_s: float | None = None, every_s: float | None = None,
                 clock=None, out=None):
        self.what, self.total = what, total
        self.after_s = self.AFTER_S if after_s is None else after_s
        self.every_s = self.EVERY_S if every_s is None else every_s
        self.clock = clock or time.monotonic
        self.out = out
        self.t0 = self.clock()
        self.next = self.t0 + self.after_s
        self.printed = False

    def _print(self, text: str) -> None:
        print(text, file=self.out or sys.stderr, flush=True)
        self.printed = True

    def update(self, done: int) -> None:
        now = self.clock()
        if now < self.next:
            return
        self.next = now + self.every_s
        if done <= 0:
            self._print(f"{self.what}: nothing yet of {size_text(self.total)} after {_seconds_text(now - self.t0)}")
            return
        rate = done / max(now - self.t0, 1e-9)
        left = f", ~{_seconds_text((self.total - done) / rate)} left" if rate > 0 and done < self.total else ""
        pct = min(100.0, 100 * done / max(self.total, 1))  # file headers and indexes come on top of the tensors
        self._print(f"{self.what}: {size_text(done)} of {size_text(self.total)} ({pct:.0f} %, "
                    f"{size_text(rate)}/s{left})")

    def done(self, done: int | None = None, result: str = "done") -> None:
        """The closing line, when a progress line was printed (a short transfer stays silent)."""
        if self.printed:
            n = self.total if done is None else done
            s = self.clock() - self.t0
            rate = size_text(n / max(s, 1e-9))
            self._print(f"{self.what}: {result}: {size_text(n)} in {_seconds_text(s)} ({rate}/s)")


def dir_bytes(path: Path) -> int:
    """The bytes of the files directly in `path` (0 if it is gone)."""
    total = 0
    try:
        for p in path.iterdir():
            try:
                total += p.stat().st_size
            except OSError:
                pass
    except OSError:
        return 0
    return total


def published(run_dir: Path, step: int) -> Path | None:
    """The complete checkpoint of `step` (its meta.json is present: rank 0 renamed it into place), or None."""
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    return final if (final / META).is_file() else None


class SaveWatch:
    """A daemon thread that prints the progress of the checkpoint of `step` being written (the bytes of
    its .tmp directory: the driver sees the ranks' files on the shared run dir) and a closing line
    once it is published; it ends then, when its .tmp directory, once seen, goes (a failed write), or
    at close()."""

    def __init__(self, run_dir: Path, step: int, total: int, poll_s: float = 0.5):
        self.run_dir, self.step, self.poll_s = run_dir, step, poll_s
        self.progress = Progress(f"rlalign train: checkpoint of step {step}", total)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"rlalign-checkpoint-watch-{step}")
        self._thread.start()

    def _watch(self) -> None:
        tmp, seen = tmp_path(self.run_dir, self.step), False
        while True:
            stopping = self._stop.wait(self.poll_s)
            if published(self.run_dir, self.step) is not None:
                self.progress.done(result="written")
                return
            if stopping:
                return
            if tmp.is_dir():
                seen = True
                self.progress.update(dir_bytes(tmp))
            elif seen:
                return

    def close(self) -> None:
        """Stop watching (the closing line first, if the checkpoint is published by now)."""
        self._stop.set()
        self._thread.join(timeout=5)


def wait_published(run_dir: Path, step: int, timeout_s: float | None, poll_s: float = 0.1) -> Path | None:
    """Wait, watching the disk, until the checkpoint of `step` is published: its path; None when its
    .tmp directory is gone without it (the write failed) or after timeout_s. Needs no answer from a
    trainer rank (busy with a step, or dead). A signal handler's exception interrupts it."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    tmp = tmp_path(run_dir, step)
    while True:
        done = published(run_dir, step)
        if done is not None:
            return done
        if not tmp.is_dir() or (end is not None and time.monotonic() >= end):
            return published(run_dir, step)
        time.sleep(poll_s)


def wait_pruned(run_dir: Path, keep: int, timeout_s: float, poll_s: float = 0.1) -> bool:
    """After a publish, until the publishing rank's prune is over (no complete checkpoint beyond the newest
    `keep`, none being deleted): a process that exits sooner (a stop signal, an error) would cut a
    delete short. False after timeout_s."""
    end = time.monotonic() + timeout_s
    d = checkpoint_dir(run_dir)
    while True:
        deleting = d.is_dir() and any(p.name.endswith(".pruned") for p in d.iterdir())
        if not deleting and not (keep > 0 and len(list_complete(run_dir)) > keep):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)


PROBE_MIN_BYTES, PROBE_MAX_BYTES = 4 << 20, 64 << 20


def measure_write_rate(directory: Path, nbytes: int) -> float:
    """Bytes per second of one writer into `directory`: a file of `nbytes` random bytes written,
    fsynced and removed (random, so that a compressing file system does not flatter it)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = os.urandom(nbytes)
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        t0 = time.perf_counter()
        _write_file(probe, data)
        seconds = time.perf_counter() - t0
    finally:
        probe.unlink(missing_ok=True)
    return nbytes / max(seconds, 1e-9)


def probe_bytes(checkpoint_bytes: int) -> int:
    """The probe's size: the checkpoint's, within [4 MiB, 64 MiB]."""
    return min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, checkpoint_bytes))


def grace_warning(checkpoint_bytes: int, rate: float, grace_s: float, where: Path, every: int = 0) -> str | None:
    """One line when a checkpoint of `checkpoint_bytes` at `rate` bytes/s (one writer) takes longer than
    run.stop_grace_s, naming the knobs of the orchestrators that send the stop signal (and saving every
    step, unless the run's checkpoint interval `every` is 1 already); else None."""
    seconds = checkpoint_bytes / rate
    if seconds <= grace_s:
        return None
    each = "" if every == 1 else (", or save every step (checkpoint.every=1: a stop then waits only for the write "
                                  "already under way)")
    return (f"a checkpoint of {size_text(checkpoint_bytes)} takes ~{_seconds_text(seconds)} at the "
            f"{size_text(rate)}/s measured in {where}, longer than run.stop_grace_s={grace_s:g} s: a stop signal "
            f"(preemption, Ctrl-C) may end the run before its checkpoint is written; raise run.stop_grace_s above "
            f"~{seconds:.0f} s and the orchestrator's grace above that (Kubernetes: terminationGracePeriodSeconds; "
            f"Slurm: KillWait, or sbatch --signal=TERM@SECONDS to be signalled earlier){each}")
