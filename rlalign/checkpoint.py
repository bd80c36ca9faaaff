"""Checkpoints: trainer state as safetensors through torch.distributed.checkpoint, plus the driver's
meta.json. Nothing in a checkpoint directory is ever unpickled.

    RUN_DIR/checkpoints/step_000012/        complete (meta.json present)
    RUN_DIR/checkpoints/step_000015.tmp/    being written; ignored by resume

A checkpoint at step k holds the state after step k: model, fp32 masters and AdamW state, keyed
as Trainer.checkpoint_state keys them (expert tensors per global expert, dense masters and AdamW
state per dense unit, so any EP size, with trainer.shard_dense or without, can load them; a
sharded rank writes and reads only its own units), and meta.json with the step, the data
position, RNG states, the weights fingerprint and an index of every tensor: its file, dtype,
shape and fingerprint (rlalign.fingerprint: taken of the trainer's tensors on their
device when the save starts, one launch; the same value the CPU recomputes from the files).

Format. Each trainer rank writes through DCP's HuggingFaceStorageWriter (save_distributed=True):
`shard-<rank+1>-model-<i>-of-<n>.safetensors` files, one per bucket i of the checkpoint's tensors
(keys in order of the first rank that holds them, cut into consecutive groups of at most
checkpoint.bucket_mb; a larger tensor alone), holding the bucket's tensors this rank writes (DCP's
planner writes a tensor held by several ranks once), and no DCP `.metadata` pickle; then a
`fingerprints-rank<r>.json`. Loading goes through HuggingFaceStorageReader, which builds DCP's
metadata from the safetensors headers (JSON) and reads tensors with safetensors.safe_open: no
pickle.load/torch.load on file contents (a stray `.metadata` or any other file is never opened).
The driver's complete() merges the ranks' fingerprints with the shard headers into meta.json
(written last, atomically) and renames the directory into place: a crash or a failed write leaves
the previous checkpoint the latest one.

Bounded staging. DCP writes one file at a time: the file's tensors are copied from the trainer's
own (device) tensors to host memory, serialised and written, then the next file's. A save needs a
small multiple of one bucket in host memory (the host copies, safetensors' per-tensor bytes and
the file's bytes: 3-4 buckets), never the whole state (experiments/train/bench_checkpoint_host_memory.py).

Asynchronous saves. AsyncSaver.save() fingerprints this rank's tensors on their device and returns;
a background thread writes them bucket by bucket from the trainer's own tensors (over a gloo group
of the trainer ranks kept for checkpoints, so the training collectives never interleave with the
checkpoint's), then the fingerprints and, on rank 0 once every rank reports success, complete():
the checkpoint appears (meta.json, rename) while the RL loop runs on (the next generation, the
weight sync). The tensors must not change until the write ends: the trainer waits for it before
its next update (TrainerWorker.train_step), the next save and the end of the run wait too
(AsyncSaver.wait raises what went wrong). The files are the bytes a synchronous save_shards
writes (one write function); a crash mid-save leaves a .tmp directory, ignored, and the previous
checkpoint the newest complete one.

Disk space. check_space() runs before Ray starts: the checkpoint's size is the trainer state's
(rlalign.training.trainer.checkpoint_nbytes: the keys checkpoint_state() writes, of a trainer built
on the meta device), times the checkpoints the run holds at once (checkpoint.keep + the one being
written); a run whose checkpoint directory has less free space is refused in one line.

Progress. A load that lasts more than a few seconds prints rank 0's bytes read, rate and time left
on stderr (checkpoint_files.Progress, from DCP's planner as tensors arrive); a save's progress is
printed by the driver, which watches the .tmp directory (checkpoint_files.SaveWatch).

Hugging Face export. With publish["export_hf"] (checkpoint.export_hf), complete() writes the model as
a Hugging Face directory into the checkpoint (step_N/hf, rlalign.export) before renaming it into
place; a failed export leaves the checkpoint complete and is raised after publishing it.

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
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from rlalign.checkpoint_files import (  # noqa: F401 (the checkpoint API re-exported: rlalign.checkpoint is its one entry)
    FORMAT,
    FPS,
    META,
    PROBE_MAX_BYTES,
    ST_DTYPE,
    SUFFIX,
    CheckpointError,
    Damage,
    Progress,
    SaveWatch,
    cause,
    checkpoint_dir,
    damaged,
    fsync_dir,
    grace_warning,
    list_complete,
    measure_write_rate,
    newest_intact,
    oneline,
    probe_bytes,
    published,
    rank_of_file,
    read_header,
    read_json,
    read_meta,
    resolve_resume,
    run_dir_of,
    shard_name,
    size_text,
    step_of,
    tmp_path,
    verify,
    wait_published,
    write_json_atomic,
)
from rlalign.faults import maybe_fail
from rlalign.fingerprint import state_fingerprints


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
        write_json_atomic(path / f"fingerprints-rank{rank:05d}.json", {"rank": rank, "tensors": fps})
    except OSError as e:
        raise _write_error(path, step, e, rank) from None


DEFAULT_BUCKET_BYTES = 512 << 20  # checkpoint.bucket_mb's default


def bucket_files(layout: dict[str, tuple[int, int]], bucket_bytes: int) -> dict[str, int]:
    """{key: file index 1..n} of the checkpoint's tensors from {key: (first rank holding it, bytes)}:
    keys ordered by (rank, key), cut into consecutive groups of at most bucket_bytes (a tensor
    larger than that: a group of its own). Every rank computes the same map from the same layout."""
    out: dict[str, int] = {}
    index, filled = 1, 0
    for key, (_, nbytes) in sorted(layout.items(), key=lambda kv: (kv[1][0], kv[0])):
        if filled and filled + nbytes > bucket_bytes:
            index, filled = index + 1, 0
        out[key] = index
        filled += nbytes
    return out


def _layout(state: dict[str, torch.Tensor], rank: int, group) -> dict[str, tuple[int, int]]:
    """{key: (the first rank holding it, bytes)} over every rank of `group` (all call it)."""
    mine = {k: (rank, v.numel() * v.element_size()) for k, v in state.items()}
    if not _dist_on():
        return mine
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    merged: dict[str, tuple[int, int]] = {}
    for part in everyone:
        for k, (r, n) in part.items():
            if k not in merged or r < merged[k][0]:
                merged[k] = (r, n)
    return merged


def _write(state: dict[str, torch.Tensor], path: Path, rank: int, group, bucket_bytes: int) -> None:
    """This rank's tensors through DCP's safetensors writer, one bucket file at a time, read from
    the tensors where they are (module docstring: bounded staging)."""
    files = bucket_files(_layout(state, rank, group), bucket_bytes)
    with _quiet_single_process():
        dcp = _dcp()
        writer = dcp.HuggingFaceStorageWriter(str(path), fqn_to_index_mapping=files, save_distributed=True)
        # blocking device-to-host copies, tensor by tensor, into plain host memory (DCP's copy-ahead
        # loader would pin buffers that CUDA's host allocator keeps cached after the save)
        writer.per_thread_copy_ahead = 0
        dcp.save(_unshared(state), storage_writer=writer, process_group=group, no_dist=not _dist_on())


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a CPU tensor held under a second key cloned (the AdamW step of a parameter cut
    into several units): DCP writes a CPU tensor that spans its storage in place, and safetensors
    refuses two names on one storage in a file. A device tensor reaches the file through a host
    copy of its own."""
    out, seen = {}, set()
    for k, v in state.items():
        if v.device.type == "cpu":
            ptr = (v.untyped_storage().data_ptr(), v.storage_offset(), v.numel())
            if ptr in seen:
                v = v.clone()
            seen.add(ptr)
        out[k] = v
    return out


def save_shards(state: dict[str, torch.Tensor], path: str | Path, rank: int = 0, group=None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """One trainer rank's part of a checkpoint (all ranks call it together): its tensors through DCP
    as safetensors, one bucket at a time, then fingerprints-rank<r>.json. On any failure (e.g.
    ENOSPC) every rank raises CheckpointError naming the step, the path and the cause; rank 0
    removes the .tmp directory."""
    path = Path(path)
    step = step_of(path)
    try:
        _prepare_dir(path, rank)
        fps = state_fingerprints(state)
    except OSError as e:
        raise _write_error(path, step, e, rank) from None
    try:
        _write(state, path, rank, group, bucket_bytes)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise _dcp_failed(e, path, step, rank) from None
    _write_fingerprints(path, step, rank, fps)


class AsyncSaver:
    """One trainer rank's checkpoint writer in the background (module docstring). All trainer
    ranks call save() together; at most one save is in flight (save() first waits for the last);
    the saved tensors must not change before wait() returns."""

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
             publish: dict | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Fingerprint this rank's tensors and start writing them; returns before the write.
        publish = {"run_dir", "step", "meta", "keep"}: rank 0 then completes the checkpoint itself
        (complete()) once every rank has written its part."""
        self.wait()
        path = Path(path)
        step = step_of(path)
        try:
            _prepare_dir(path, rank)
            fps = state_fingerprints(state)  # on the tensors' device
        except OSError as e:
            raise _write_error(path, step, e, rank) from None
        pg = self._gloo_group(group)
        self._pending = self._pool.submit(self._finish, dict(state), fps, path, step, rank, pg, publish,
                                          bucket_bytes)

    def _finish(self, state: dict[str, torch.Tensor], fps: dict[str, str], path: Path, step: int | None,
                rank: int, pg, publish: dict | None, bucket_bytes: int) -> Path | None:
        error = None
        try:
            maybe_fail("checkpoint.write", rank)
            _write(state, path, rank, pg, bucket_bytes)
        except BaseException as e:
            error = _dcp_failed(e, path, step, rank)
        del state
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
            return complete(Path(publish["run_dir"]), publish["step"], publish["meta"], publish["keep"],
                            publish.get("export_hf", False))
        return None

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any): the published checkpoint's path (rank 0 with
        publish), else None; raises its CheckpointError."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None


def _counting_planner(progress: Progress | None):
    """DCP's default load planner, reporting the bytes read so far to `progress` (None: silent)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Counting(DefaultLoadPlanner):
        done = 0

        def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
            super().commit_tensor(read_item, tensor)
            if progress is not None:
                self.done += tensor.numel() * tensor.element_size()
                progress.update(self.done)

    return Counting()


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
    progress = Progress(f"rlalign: loading {path} (rank 0's part)", sum(t.numel() * t.element_size()
                                                                       for t in buf.values()))
    try:
        with _quiet_single_process():
            dcp = _dcp()
            dcp.load(buf, storage_reader=dcp.HuggingFaceStorageReader(str(path)), process_group=group,
                     no_dist=not _dist_on(), planner=_counting_planner(progress if rank == 0 else None))
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failed, cause = _dcp_cause(e, rank)
        what = f"read failed on rank {failed}: {cause(cause)}"
        raise damaged(path, Damage("(safetensors shards)", what)) from None
    progress.done(result="read")
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
# checkpoint.every=null: a save every tenth of the run, at least every MAX_AUTO_EVERY steps
AUTO_EVERY_FRACTION, MAX_AUTO_EVERY = 10, 50


def checkpoint_every(every: int | None, steps: int) -> int:
    """The run's steps between checkpoints: checkpoint.every, or (null, the default) sized to the run:
    ceil(run.steps / 10), at most 50, so that a crash (kill -9, a lost node) loses at most a tenth of
    the run and at most 50 steps (a stop signal or Ctrl-C checkpoints the newest state anyway). The
    last step always checkpoints (is_due); 0 means only it."""
    if every is not None:
        return every
    return min(MAX_AUTO_EVERY, -(-steps // AUTO_EVERY_FRACTION))


def is_due(step: int, every: int, steps: int) -> bool:
    """Whether the run checkpoints after `step` (every N steps, and always after its last)."""
    return bool(every and (step + 1) % every == 0) or step == steps - 1


def held_at_once(existing: int, saves: int, keep: int) -> int:
    """How many more checkpoints than the `existing` complete ones the directory holds at its
    fullest over `saves` saves: each written beside the kept ones, then the oldest beyond `keep`
    (0: all) removed."""
    n = peak = existing
    for _ in range(saves):
        n += 1
        peak = max(peak, n)
        if keep > 0:
            n = min(n, keep)
    return peak - existing


def check_space(run_dir: Path, parts: dict[str, int], steps: Iterable[int], every: int, total_steps: int,
                keep: int) -> dict:
    """Refuse a run whose checkpoints do not fit the free space of run_dir/checkpoints (statvfs of
    it, or of its nearest existing parent), before anything starts: CheckpointError of one line
    naming the size, the free space, the directory and the keys that change them. `parts`: the
    checkpoint's bytes by part (rlalign.training.trainer.checkpoint_nbytes); `steps`: the steps this
    run will train. Returns the numbers checked."""
    saves = sum(is_due(s, every, total_steps) for s in steps)
    size = sum(parts.values())
    d = checkpoint_dir(run_dir)
    count = held_at_once(len(list_complete(run_dir)), saves, keep)
    need = count * size
    probe = d
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    if need > free:
        what = " + ".join(f"{k} {size_text(v)}" for k, v in parts.items() if v)
        one = size_text(size)
        times = f"{count} checkpoints of {one} at once" if count > 1 else f"one checkpoint of {one}"
        fewer = "checkpoint.keep=1 (fewer at once), " if count > 1 else ""
        raise CheckpointError(
            f"not enough disk for checkpoints: {d} needs {size_text(need)} ({times}: {what}) but its file system has "
            f"{size_text(free)} free; set run.dir=<a directory with room>, {fewer}or checkpoint.enabled=false "
            f"(no checkpoints)")
    return {"checkpoint_bytes": size, "checkpoints_at_once": count, "needed_bytes": need, "free_bytes": free,
            "dir": str(d)}


def _index(tmp: Path) -> dict:
    """files + tensors of meta.json from the ranks' fingerprints and the shards' headers."""
    fps: dict[int, dict] = {}
    for p in tmp.iterdir():
        m = FPS.match(p.name)
        if m:
            fp = read_json(p)
            if not (isinstance(fp, dict) and isinstance(fp.get("tensors"), dict)):
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
    for key, t in tensors.items():
        rank = rank_of_file(t["file"])
        want = fps.get(rank, {}).get("tensors", {}).get(key) if rank is not None else None
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


def _export(tmp: Path, final: Path, step: int) -> CheckpointError | None:
    """checkpoint.export_hf: the model as a Hugging Face directory inside the checkpoint (step_N/hf),
    before it is renamed into place, so that a published checkpoint has it; a failure is returned
    (raised once the checkpoint itself is published)."""
    from rlalign.export import HF_DIR, export_hf

    try:
        export_hf(tmp, tmp / HF_DIR, overwrite=True, what=f"rlalign train: export of step {step}", note=False)
    except (OSError, ValueError, RuntimeError) as e:
        shutil.rmtree(tmp / HF_DIR, ignore_errors=True)
        return CheckpointError(oneline(f"checkpoint of step {step} is complete ({final}), but its Hugging Face "
                                       f"export failed: {cause(e)}; export it with: rlalign export {final} OUT_DIR"))
    return None


def complete(run_dir: Path, step: int, meta: dict, keep: int, export_hf: bool = False) -> Path:
    """Publish a written .tmp checkpoint: index it into meta.json (written last, atomically), with
    export_hf its model as step_N/hf, and rename the directory into place; prune old ones beyond
    `keep`. A failure raises CheckpointError (the step, the path, the cause) after removing the .tmp
    directory; a failed export only after publishing the checkpoint."""
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
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(tmp, step, e) from None
    failed = _export(tmp, final, step) if export_hf else None
    try:
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
    if failed is not None:
        raise failed
    return final
