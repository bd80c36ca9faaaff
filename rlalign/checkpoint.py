"""Checkpoints: trainer state as safetensors through torch.distributed.checkpoint, plus the driver's
meta.json. Nothing in a checkpoint directory is ever unpickled.

    RUN_DIR/checkpoints/step_000012/        complete (meta.json present)
    RUN_DIR/checkpoints/step_000015.tmp/    being written; ignored by resume

A checkpoint at step k holds the state after step k: model, fp32 masters and AdamW state, keyed
as Trainer.checkpoint_state keys them (expert tensors per global expert, dense masters and AdamW
state per dense unit, so any EP size, with trainer.shard_dense or without, can load them; a
sharded rank writes and reads only its own units), and meta.json with the step, the data
position, RNG states, the weights fingerprint and an index of every tensor: its file, dtype,
shape and fingerprint (rlalign.monitor.fingerprint: taken of the trainer's tensors on their
device when the save starts, one launch; the same value the CPU recomputes from the files).

Format. Each trainer rank writes through DCP's HuggingFaceStorageWriter (save_distributed=True):
one `shard-<rank+1>-model-00001-of-00001.safetensors` per rank (DCP's planner writes a tensor held
by several ranks once) and no DCP `.metadata` pickle; then a `fingerprints-rank<r>.json`. Loading
goes through HuggingFaceStorageReader, which builds DCP's metadata from the safetensors headers
(JSON) and reads tensors with safetensors.safe_open: no pickle.load/torch.load on file contents (a
stray `.metadata` or any other file is never opened). The driver's complete() merges the ranks'
fingerprints with the shard headers into meta.json (written last, atomically) and renames the
directory into place: a crash or a failed write leaves the previous checkpoint the latest one.

Asynchronous saves. AsyncSaver.save() stages this rank's tensors into CPU copies it owns (the
trainer may change its own at once), then DCP's async_save writes them in a background thread
(over a gloo group of the trainer ranks kept for checkpoints, so the training collectives never
interleave with the checkpoint's), followed by the fingerprints and, on rank 0 once every rank
reports success, complete(): the checkpoint appears (meta.json, rename) while the RL loop runs on.
The next save and the end of the run wait for it (AsyncSaver.wait raises what went wrong). The
files are the bytes a synchronous save_shards writes (the same writer and planner on the same
values); a crash mid-save leaves a .tmp directory, ignored, and the previous checkpoint the newest
complete one.

All non-tensor state is JSON: meta.json (python_rng as [version, [state...], gauss_next], torch_rng
as a list of bytes) and the ranks' fingerprint files, which complete() folds into meta.json.

Checks. verify(path) checks the files without reading tensor data: meta.json is valid JSON of this
format, every shard listed is present with the recorded size and a safetensors header that covers
exactly the file and holds the listed tensors, and no other .safetensors file is in the directory.
verify(path, tensors=True) also recomputes every tensor's fingerprint. load_shards() (the trainer
ranks) runs verify(path), loads into CPU buffers, compares each tensor's fingerprint with meta.json
and only then copies into the trainer. Every problem raises CheckpointError, one line naming the
checkpoint, the file, what is wrong and the newest intact other checkpoint.
"""

from __future__ import annotations

import errno as _errno
import json
import os
import random
import re
import shutil
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from rlalign.faults import maybe_fail
from rlalign.monitor.fingerprint import fingerprint, state_fingerprints

FORMAT = "rlalign-checkpoint/2 (DCP safetensors shards + JSON index)"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{6})$")
_STEP_ANY = re.compile(r"^step_(\d{6})(\.tmp)?$")
_FPS = re.compile(r"^fingerprints-rank(\d{5})\.json$")
_SUFFIX = ".safetensors"
_MAX_HEADER = 100_000_000  # bytes; safetensors' own limit
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not loadable; the message is one line."""


class _Damage(Exception):
    """Internal: what is wrong with one file of a checkpoint (file name, description)."""

    def __init__(self, file: str, what: str):
        super().__init__(file, what)
        self.file, self.what = file, what


# --- paths ------------------------------------------------------------------------------------------
def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tmp_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:06d}.tmp"


def _step_of(path: Path) -> int | None:
    m = _STEP_ANY.match(Path(path).name)
    return int(m[1]) if m else None


def _run_dir_of(path: Path) -> Path | None:
    path = Path(path)
    return path.parent.parent if path.parent.name == "checkpoints" else None


def shard_name(rank: int) -> str:
    """The file DCP's HuggingFaceStorageWriter(save_distributed=True) writes for a rank."""
    return f"shard-{rank + 1:05d}-model-00001-of-00001{_SUFFIX}"


def list_complete(run_dir: Path) -> list[Path]:
    """step_NNNNNN directories with a meta.json, oldest first (not checked: see verify)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if _STEP_DIR.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name)[1]))


# --- small file helpers (the places a full disk shows up) ------------------------------------------
def _oneline(s: object) -> str:
    return " ".join(str(s).split())


def _cause(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{os.strerror(e.errno)} ({_errno.errorcode.get(e.errno, e.errno)})"
    return _oneline(f"{type(e).__name__}: {e}")


def _write_file(path: Path, data: bytes) -> None:
    """Write, flush and fsync `path` (raises OSError, e.g. ENOSPC)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json_atomic(path: Path, obj: object) -> None:
    part = path.with_name(path.name + ".part")
    _write_file(part, (json.dumps(obj) + "\n").encode())
    os.replace(part, path)


def _fsync_dir(path: Path) -> None:
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
def _read_json(path: Path) -> object:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise _Damage(path.name, "missing") from None
    except OSError as e:
        raise _Damage(path.name, f"unreadable: {_cause(e)}") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise _Damage(path.name, f"invalid JSON ({msg}{where}; {len(raw)} bytes, truncated?)") from None


def _read_header(path: Path) -> dict:
    """The tensor entries of a safetensors file's JSON header, after checking that the header and
    the data it describes cover the file exactly."""
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise _Damage(name, f"truncated: {size} bytes, shorter than a safetensors header")
            n = int.from_bytes(raw, "little")
            if n > _MAX_HEADER:
                raise _Damage(name, f"not a safetensors file (header length {n})")
            if 8 + n > size:
                raise _Damage(name, f"truncated: {size} bytes, its header alone needs {8 + n}")
            text = f.read(n)
    except FileNotFoundError:
        raise _Damage(name, "missing") from None
    except OSError as e:
        raise _Damage(name, f"unreadable: {_cause(e)}") from None
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
        raise _Damage(name, f"malformed safetensors header ({_oneline(e)})") from None
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "trailing bytes"
        raise _Damage(name, f"{what}: {size} bytes, its header describes {8 + n + end}")
    return header


def _check(path: Path, tensors: bool) -> dict:
    """meta.json of a checkpoint after the checks of verify(); raises _Damage."""
    path = Path(path)
    if not path.is_dir():
        raise _Damage(str(path), "not a directory")
    meta = _read_json(path / META)
    if not isinstance(meta, dict):
        raise _Damage(META, "not a JSON object")
    if meta.get("format") != FORMAT:
        raise _Damage(META, f"format {meta.get('format')!r}, expected {FORMAT!r} (an older checkpoint holds a "
                            f"pickled DCP .metadata, which is not loaded)")
    for key, typ in (("step", int), ("files", dict), ("tensors", dict)):
        if not isinstance(meta.get(key), typ):
            raise _Damage(META, f"field {key!r} missing or not {typ.__name__}")
    files: dict = meta["files"]
    for f in sorted(p.name for p in path.iterdir() if p.name.endswith(_SUFFIX)):
        if f not in files:
            raise _Damage(f, "a .safetensors file meta.json does not list (not part of this checkpoint)")
    headers = {}
    for f, info in sorted(files.items()):
        p = path / f
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or "/" in f:
            raise _Damage(META, f"malformed entry for file {f!r}")
        if not p.is_file():
            raise _Damage(f, "missing")
        size = p.stat().st_size
        if size != info["bytes"]:
            raise _Damage(f, f"{size} bytes, meta.json records {info['bytes']} (truncated or overwritten)")
        headers[f] = _read_header(p)
    for key, t in meta["tensors"].items():
        try:
            f, dtype, shape = t["file"], t["dtype"], list(t["shape"])
            str(t["fp"])
        except (TypeError, KeyError):
            raise _Damage(META, f"malformed entry for tensor {key!r}") from None
        if f not in headers:
            raise _Damage(META, f"tensor {key!r} is in {f!r}, a file it does not list")
        h = headers[f].get(key)
        if not isinstance(h, dict) or h.get("dtype") != dtype or h.get("shape") != shape:
            raise _Damage(f, f"tensor {key!r} missing or not {dtype}{shape} as meta.json records")
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
                        raise _Damage(f, f"tensor {key!r} has fingerprint {got}, meta.json records {want} "
                                         f"(its bytes changed)")
        except _Damage:
            raise
        except Exception as e:  # safetensors' own errors
            raise _Damage(f, f"unreadable: {_cause(e)}") from None


def newest_intact(run_dir: Path, before: int | None = None, exclude: Path | None = None,
                  tensors: bool = False) -> Path | None:
    """The newest complete checkpoint of run_dir that passes verify(., tensors) (steps < before;
    not `exclude`), or None."""
    ex = Path(exclude).resolve() if exclude is not None else None
    for p in reversed(list_complete(run_dir)):
        if (before is not None and _step_of(p) >= before) or (ex is not None and p.resolve() == ex):
            continue
        try:
            _check(p, tensors)
            return p
        except _Damage:
            continue
    return None


def _hint(path: Path, tensors: bool = False) -> str:
    run_dir = _run_dir_of(path)
    if run_dir is None:
        return ""
    other = newest_intact(run_dir, exclude=path, tensors=tensors)
    if other is None:
        return f"; {checkpoint_dir(run_dir)} holds no other intact checkpoint"
    return f"; newest intact checkpoint: {other} (checkpoint.resume={other})"


def _damaged(path: Path, d: _Damage, tensors: bool = False) -> CheckpointError:
    return CheckpointError(_oneline(f"checkpoint {path} is not loadable: {d.file}: {d.what}{_hint(path, tensors)}"))


def verify(path: Path, tensors: bool = False) -> dict:
    """meta.json of the checkpoint at `path` once its files check out (see the module docstring);
    tensors=True also recomputes every tensor's fingerprint (reads all data). Raises CheckpointError
    naming the checkpoint, the file, what is wrong and the newest intact other checkpoint."""
    try:
        return _check(Path(path), tensors)
    except _Damage as d:
        raise _damaged(Path(path), d, tensors) from None


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
            except _Damage as d:
                print(f"rlalign: checkpoint {p} is damaged ({d.file}: {d.what}); skipping it", file=sys.stderr)
        if done:
            raise CheckpointError(f"checkpoint.resume=auto: none of the {len(done)} checkpoints in "
                                  f"{checkpoint_dir(run_dir)} is intact (see above); refusing to start from step 0")
        return None
    p = Path(resume)
    if not (p / META).is_file():
        raise FileNotFoundError(f"checkpoint.resume={resume!r}: not a complete checkpoint (no meta.json)")
    verify(p)
    return p


def read_meta(path: Path) -> dict:
    """meta.json as a dict; CheckpointError (naming the file) if it is not valid JSON."""
    try:
        meta = _read_json(Path(path) / META)
    except _Damage as d:
        raise _damaged(Path(path), d) from None
    if not isinstance(meta, dict):
        raise _damaged(Path(path), _Damage(META, "not a JSON object"))
    return meta


# --- trainer ranks ---------------------------------------------------------------------------------
def _dist_on() -> bool:

    return dist.is_available() and dist.is_initialized()


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when no process group is up; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _dcp():
    """torch.distributed.checkpoint, imported on first use: ~1 s of imports (sympy among them) that
    a process which never saves or loads (a generator actor) does not pay."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _dcp_cause(e: BaseException, rank: int) -> tuple[int, BaseException]:
    """(rank, exception) inside DCP's CheckpointException (an OSError first): the rank that failed,
    which every rank reports."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        inner = sorted((r, x[0] if isinstance(x, tuple) else x) for r, x in e.failures.items())
        return next(((r, x) for r, x in inner if isinstance(x, OSError)), inner[0])
    return rank, e


def _previous(path: Path, step: int | None) -> str:
    run_dir = _run_dir_of(path)
    prev = newest_intact(run_dir, before=step) if run_dir is not None else None
    return f"; the previous checkpoint {prev} is intact" if prev else "; there is no earlier complete checkpoint"


def _write_error(path: Path, step: int | None, e: BaseException, rank: int | None = None) -> CheckpointError:
    filename = getattr(e, "filename", None)
    where = f"{filename}" if filename else f"{path}"
    who = f" (rank {rank})" if rank is not None else ""
    return CheckpointError(_oneline(f"checkpoint of step {step} not written{who}: {where}: {_cause(e)}"
                                    f"{_previous(path, step)}"))


def _prepare_dir(path: Path, rank: int) -> None:
    """Rank 0 empties `path` of an earlier attempt's leftovers (no rank writes before rank 0 joins
    DCP's plan)."""
    if rank == 0:
        if path.is_dir():
            for p in path.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        path.mkdir(parents=True, exist_ok=True)


def _dcp_failed(e: BaseException, path: Path, step: int | None, rank: int) -> CheckpointError:
    """DCP raised CheckpointException (a BaseException) on every rank: rank 0 removes the .tmp."""
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    failed, cause = _dcp_cause(e, rank)
    return _write_error(path, step, cause, failed)


def _write_fingerprints(path: Path, step: int | None, rank: int, fps: dict[str, str]) -> None:
    try:
        _write_json_atomic(path / f"fingerprints-rank{rank:05d}.json",
                           {"rank": rank, "shard": shard_name(rank), "tensors": fps})
    except OSError as e:
        raise _write_error(path, step, e, rank) from None


def save_shards(state: dict[str, torch.Tensor], path: str | Path, rank: int = 0, group=None) -> None:
    """One trainer rank's part of a checkpoint (all ranks call it together): its tensors through DCP
    as safetensors, then fingerprints-rank<r>.json. On any failure (e.g. ENOSPC) every rank raises
    CheckpointError naming the step, the path and the cause; rank 0 removes the .tmp directory."""
    path = Path(path)
    step = _step_of(path)
    try:
        _prepare_dir(path, rank)
        fps = state_fingerprints(state)
        cpu = {k: v.detach().cpu() for k, v in state.items()}
    except OSError as e:
        raise _write_error(path, step, e, rank) from None
    try:
        with _quiet_single_process():
            dcp = _dcp()
            dcp.save(cpu, storage_writer=dcp.HuggingFaceStorageWriter(str(path), save_distributed=True),
                     process_group=group, no_dist=not _dist_on())
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _dcp_failed(e, path, step, rank) from None
    _write_fingerprints(path, step, rank, fps)


class _Staged:
    """DCP's AsyncStager for a state dict that AsyncSaver already copied: nothing more to copy."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncSaver:
    """One trainer rank's checkpoint writer in the background (module docstring). All trainer
    ranks call save() together; at most one save is in flight (save() first waits for the last)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlalign-checkpoint")
        self._pending: Future | None = None
        self._group = None

    def _gloo_group(self, group):
        """A gloo group of the trainer ranks for the background thread's collectives, created once
        (a collective over the default group: every trainer rank is in save())."""
        if not _dist_on():
            return None
        if self._group is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        return self._group

    def save(self, state: dict[str, torch.Tensor], path: str | Path, rank: int = 0, group=None,
             publish: dict | None = None) -> None:
        """Stage this rank's tensors (CPU copies) and start writing them; returns before the write.
        publish = {"run_dir", "step", "meta", "keep"}: rank 0 then completes the checkpoint itself
        (complete()) once every rank has written its part."""
        self.wait()
        path = Path(path)
        step = _step_of(path)
        try:
            _prepare_dir(path, rank)
            fps = state_fingerprints(state)  # on the tensors' device, before they can change
            cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        except OSError as e:
            raise _write_error(path, step, e, rank) from None
        pg = self._gloo_group(group)
        try:
            with _quiet_single_process():
                dcp = _dcp()
                writer = dcp.HuggingFaceStorageWriter(str(path), save_distributed=True)
                written = dcp.async_save(cpu, storage_writer=writer, process_group=pg, no_dist=pg is None,
                                         async_stager=_Staged())
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise _dcp_failed(e, path, step, rank) from None
        self._pending = self._pool.submit(self._finish, written, fps, path, step, rank, pg, publish)

    def _finish(self, written: Future, fps: dict[str, str], path: Path, step: int | None, rank: int, pg,
                publish: dict | None) -> Path | None:
        maybe_fail("checkpoint.write", rank)
        error = None
        try:
            written.result()
        except BaseException as e:
            error = _dcp_failed(e, path, step, rank)
        if error is None:
            try:
                _write_fingerprints(path, step, rank, fps)
            except CheckpointError as e:
                error = e
        ok = [error is None]
        if pg is not None:  # every rank's outcome, so rank 0 publishes only a whole checkpoint
            everyone = [None] * dist.get_world_size(pg)
            dist.all_gather_object(everyone, error is None, group=pg)
            ok = everyone
        if error is not None:
            raise error
        if not all(ok):
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            bad = [r for r, v in enumerate(ok) if not v]
            raise CheckpointError(f"checkpoint of step {step} not written: rank(s) {bad} failed{_previous(path, step)}")
        if publish is not None and rank == 0:
            return complete(Path(publish["run_dir"]), publish["step"], publish["meta"], publish["keep"])
        return None

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any): the published checkpoint's path (rank 0 with
        publish), else None; raises its CheckpointError."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None


def load_shards(state: dict[str, torch.Tensor], path: str | Path, rank: int = 0, group=None) -> dict:
    """Load a checkpoint into `state` (Trainer.checkpoint_state() of this rank; all ranks call it
    together). Checks the files (verify), reads into CPU buffers through DCP's safetensors reader,
    compares every tensor's fingerprint with meta.json, then copies into `state`; the trainer is
    left untouched when anything is wrong (CheckpointError). Returns meta.json."""


    path = Path(path)
    meta = verify(path)
    index = meta["tensors"]
    buf: dict[str, torch.Tensor] = {}
    for k, t in state.items():
        e = index.get(k)
        if e is None:
            raise _damaged(path, _Damage(META, f"no tensor {k!r} (rank {rank}; another model or config?)"))
        if e["dtype"] != _ST_DTYPE.get(t.dtype) or list(e["shape"]) != list(t.shape):
            raise _damaged(path, _Damage(e["file"], f"tensor {k!r} is {e['dtype']}{e['shape']}, the trainer holds "
                                                    f"{_ST_DTYPE.get(t.dtype, t.dtype)}{list(t.shape)}"))
        buf[k] = torch.empty(t.shape, dtype=t.dtype)
    try:
        with _quiet_single_process():
            dcp = _dcp()
            dcp.load(buf, storage_reader=dcp.HuggingFaceStorageReader(str(path)), process_group=group,
                     no_dist=not _dist_on())
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failed, cause = _dcp_cause(e, rank)
        what = f"read failed on rank {failed}: {_cause(cause)}"
        raise _damaged(path, _Damage("(safetensors shards)", what)) from None
    fps = state_fingerprints(buf)
    for k in sorted(buf):
        got, want = fps[k], index[k]["fp"]
        if got != want:
            raise _damaged(path, _Damage(index[k]["file"], f"tensor {k!r} has fingerprint {got}, meta.json records "
                                                           f"{want} (its bytes changed)"), tensors=True)
    with torch.no_grad():
        for k, t in state.items():
            t.copy_(buf[k])
    return meta


# --- driver ----------------------------------------------------------------------------------------
def _index(tmp: Path) -> dict:
    """files + tensors of meta.json from the ranks' fingerprints and the shards' headers."""
    fps: dict[int, dict] = {}
    for p in tmp.iterdir():
        m = _FPS.match(p.name)
        if m:
            fp = _read_json(p)
            if not (isinstance(fp, dict) and isinstance(fp.get("shard"), str) and isinstance(fp.get("tensors"), dict)):
                raise _Damage(p.name, "malformed")
            fps[int(m[1])] = fp
    if not fps or sorted(fps) != list(range(len(fps))):
        raise _Damage("fingerprints-rank*.json", f"expected one per rank 0..n-1, found ranks {sorted(fps)}")
    files, tensors = {}, {}
    for p in sorted(tmp.iterdir()):
        if p.name.endswith(_SUFFIX):
            header = _read_header(p)
            files[p.name] = {"bytes": p.stat().st_size}
            for key, h in header.items():
                if key in tensors:
                    raise _Damage(p.name, f"tensor {key!r} also in {tensors[key]['file']}")
                tensors[key] = {"file": p.name, "dtype": h["dtype"], "shape": h["shape"]}
    by_shard = {fp["shard"]: fp["tensors"] for fp in fps.values()}
    for key, t in tensors.items():
        want = by_shard.get(t["file"], {}).get(key)
        if want is None:
            raise _Damage(t["file"], f"tensor {key!r} has no fingerprint from the rank that wrote it")
        t["fp"] = want
    for r, fp in sorted(fps.items()):
        for key, v in fp["tensors"].items():
            if key not in tensors:
                raise _Damage(f"fingerprints-rank{r:05d}.json", f"tensor {key!r} is in no shard")
            if v != tensors[key]["fp"]:
                raise _Damage(f"fingerprints-rank{r:05d}.json", f"ranks disagree on replicated tensor {key!r} "
                                                                f"({v} vs {tensors[key]['fp']})")
    return {"world": len(fps), "files": files, "tensors": dict(sorted(tensors.items()))}


def complete(run_dir: Path, step: int, meta: dict, keep: int) -> Path:
    """Publish a written .tmp checkpoint: index it into meta.json (written last, atomically) and
    rename the directory into place; prune old ones beyond `keep`. A failure raises CheckpointError
    (the step, the path, the cause) after removing the .tmp directory."""
    tmp = tmp_path(run_dir, step)
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    try:
        index = _index(tmp)
    except _Damage as d:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_oneline(f"checkpoint of step {step} not written: {tmp}: {d.file}: {d.what}"
                                       f"{_previous(tmp, step)}")) from None
    v, state, gauss = random.getstate()
    meta = {**meta, "format": FORMAT, "step": step, "python_rng": [v, list(state), gauss],
            "torch_rng": torch.get_rng_state().tolist(), **index}
    old = final.with_name(final.name + ".old")
    try:
        _write_json_atomic(tmp / META, meta)
        for p in tmp.iterdir():
            if _FPS.match(p.name):
                p.unlink()
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.replace(old, final)
        raise _write_error(tmp, step, e) from None
    shutil.rmtree(old, ignore_errors=True)
    if keep > 0:
        for p in list_complete(run_dir)[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    return final
