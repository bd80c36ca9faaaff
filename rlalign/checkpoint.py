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

import os
import random
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from rlalign.checkpoint_files import (  # noqa: F401 (the checkpoint API re-exported: rlalign.checkpoint is its one entry)
    FORMAT,
    FPS,
    META,
    ST_DTYPE,
    SUFFIX,
    CheckpointError,
    Damage,
    cause,
    checkpoint_dir,
    damaged,
    fsync_dir,
    list_complete,
    newest_intact,
    oneline,
    read_header,
    read_json,
    read_meta,
    resolve_resume,
    run_dir_of,
    shard_name,
    step_of,
    tmp_path,
    verify,
    write_json_atomic,
)
from rlalign.faults import maybe_fail
from rlalign.monitor.fingerprint import state_fingerprints


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
    run_dir = run_dir_of(path)
    prev = newest_intact(run_dir, before=step) if run_dir is not None else None
    return f"; the previous checkpoint {prev} is intact" if prev else "; there is no earlier complete checkpoint"


def _write_error(path: Path, step: int | None, e: BaseException, rank: int | None = None) -> CheckpointError:
    filename = getattr(e, "filename", None)
    where = f"{filename}" if filename else f"{path}"
    who = f" (rank {rank})" if rank is not None else ""
    return CheckpointError(oneline(f"checkpoint of step {step} not written{who}: {where}: {cause(e)}"
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
        write_json_atomic(path / f"fingerprints-rank{rank:05d}.json",
                           {"rank": rank, "shard": shard_name(rank), "tensors": fps})
    except OSError as e:
        raise _write_error(path, step, e, rank) from None


def save_shards(state: dict[str, torch.Tensor], path: str | Path, rank: int = 0, group=None) -> None:
    """One trainer rank's part of a checkpoint (all ranks call it together): its tensors through DCP
    as safetensors, then fingerprints-rank<r>.json. On any failure (e.g. ENOSPC) every rank raises
    CheckpointError naming the step, the path and the cause; rank 0 removes the .tmp directory."""
    path = Path(path)
    step = step_of(path)
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
        step = step_of(path)
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
            raise damaged(path, Damage(META, f"no tensor {k!r} (rank {rank}; another model or config?)"))
        if e["dtype"] != ST_DTYPE.get(t.dtype) or list(e["shape"]) != list(t.shape):
            raise damaged(path, Damage(e["file"], f"tensor {k!r} is {e['dtype']}{e['shape']}, the trainer holds "
                                                    f"{ST_DTYPE.get(t.dtype, t.dtype)}{list(t.shape)}"))
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
        what = f"read failed on rank {failed}: {cause(cause)}"
        raise damaged(path, Damage("(safetensors shards)", what)) from None
    fps = state_fingerprints(buf)
    for k in sorted(buf):
        got, want = fps[k], index[k]["fp"]
        if got != want:
            raise damaged(path, Damage(index[k]["file"], f"tensor {k!r} has fingerprint {got}, meta.json records "
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
        m = FPS.match(p.name)
        if m:
            fp = read_json(p)
            if not (isinstance(fp, dict) and isinstance(fp.get("shard"), str) and isinstance(fp.get("tensors"), dict)):
                raise Damage(p.name, "malformed")
            fps[int(m[1])] = fp
    if not fps or sorted(fps) != list(range(len(fps))):
        raise Damage("fingerprints-rank*.json", f"expected one per rank 0..n-1, found ranks {sorted(fps)}")
    files, tensors = {}, {}
    for p in sorted(tmp.iterdir()):
        if p.name.endswith(SUFFIX):
            header = read_header(p)
            files[p.name] = {"bytes": p.stat().st_size}
            for key, h in header.items():
                if key in tensors:
                    raise Damage(p.name, f"tensor {key!r} also in {tensors[key]['file']}")
                tensors[key] = {"file": p.name, "dtype": h["dtype"], "shape": h["shape"]}
    by_shard = {fp["shard"]: fp["tensors"] for fp in fps.values()}
    for key, t in tensors.items():
        want = by_shard.get(t["file"], {}).get(key)
        if want is None:
            raise Damage(t["file"], f"tensor {key!r} has no fingerprint from the rank that wrote it")
        t["fp"] = want
    for r, fp in sorted(fps.items()):
        for key, v in fp["tensors"].items():
            if key not in tensors:
                raise Damage(f"fingerprints-rank{r:05d}.json", f"tensor {key!r} is in no shard")
            if v != tensors[key]["fp"]:
                raise Damage(f"fingerprints-rank{r:05d}.json", f"ranks disagree on replicated tensor {key!r} "
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
    except Damage as d:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(oneline(f"checkpoint of step {step} not written: {tmp}: {d.file}: {d.what}"
                                       f"{_previous(tmp, step)}")) from None
    v, state, gauss = random.getstate()
    meta = {**meta, "format": FORMAT, "step": step, "python_rng": [v, list(state), gauss],
            "torch_rng": torch.get_rng_state().tolist(), **index}
    old = final.with_name(final.name + ".old")
    try:
        write_json_atomic(tmp / META, meta)
        for p in tmp.iterdir():
            if FPS.match(p.name):
                p.unlink()
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
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
