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

Format. Each trainer rank writes safetensors files, the format of DCP's HuggingFaceStorageWriter
(save_distributed=True): `shard-<rank+1>-model-<i>-of-<n>.safetensors`, one per bucket i of the
checkpoint's tensors (keys in order of the rank that writes them, cut into consecutive groups of at
most checkpoint.bucket_mb; a larger tensor alone) holding the bucket's tensors this rank writes (a
tensor held by several ranks is written once, by the holder that evens the ranks' written bytes:
checkpoint_write.writers), no DCP `.metadata` pickle; then a `fingerprints-rank<r>.json`.
rlalign.checkpoint_write writes them (one file per writer thread, one fsync a file, reused host
buffers). meta.json's index records each tensor's file (verify and the export look there); loading
goes through DCP's HuggingFaceStorageReader, which builds DCP's metadata from the safetensors headers
(JSON) and reads tensors with safetensors.safe_open: no pickle.load/torch.load on file contents (a
stray `.metadata` or any other file is never opened). The driver's complete() merges the ranks'
fingerprints with the shard headers into meta.json (written last, atomically) and renames the
directory into place: a crash or a failed write leaves the previous checkpoint the latest one.

Asynchronous saves. AsyncSaver.save() fingerprints this rank's device tensors on their device, then
(checkpoint.staging, checkpoint_write.choose_staging, said in one line) either stages the state: copies
it into host buffers kept across saves (pinned on CUDA) and returns, the trainer free to change its
tensors; or streams it: returns at once and the background thread reads the trainer's own tensors
file by file, so the trainer's next update waits for the write (TrainerWorker.train_step:
wait_tensors; metrics.jsonl records that stall as time/checkpoint_stall_s, the staging copy as
time/checkpoint_staging_s). The background thread writes the files, fingerprints the CPU tensors it
writes, writes the fingerprints and, on rank 0 once every rank reports success (over a gloo group of
the trainer ranks kept for checkpoints, so the training collectives never interleave with the
checkpoint's), complete(): the checkpoint appears
(meta.json, rename) while the RL loop runs on. The next save and the end of the run wait for it
(AsyncSaver.wait raises what went wrong). The files are the bytes a synchronous save_shards writes;
a crash mid-save leaves a .tmp directory, ignored, and the previous checkpoint the newest complete one.
Host memory: staged, the rank's state once more (kept); streamed, none on CPU, a file per writer on a GPU.

Disk space. check_space() runs before Ray starts: the checkpoint's size by part (rlalign.rl.checkpoint_parts:
the trainer state's, checkpoint_nbytes of a trainer built on the meta device; the tokenizer copy; the
HF export), times the checkpoints the run holds at once (checkpoint.keep + the one being
written); a run whose checkpoint directory has less free space is refused in one line.

Progress. A load that lasts more than a few seconds prints rank 0's bytes read, rate and time left
on stderr (checkpoint_files.Progress, from DCP's planner as tensors arrive); a save's progress is
printed by the driver, which watches the .tmp directory (checkpoint_files.SaveWatch).

Tokenizer and Hugging Face export. With publish["tokenizer"] (RUN_DIR/tokenizer, `rlalign train`'s copy of
the run's HF tokenizer) complete() copies its files into the checkpoint (step_N/tokenizer): the checkpoint
exports with them wherever their own directory has gone. With publish["export_hf"] (checkpoint.export_hf)
it writes the model as a HF directory into the checkpoint (step_N/hf, rlalign.export) before renaming it
into place; a failed export leaves the checkpoint complete and is raised after publishing it.

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
import sys
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from rlalign import checkpoint_write as cw
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
    clear_leftovers,
    damaged,
    fitting_index,
    fsync_dir,
    grace_warning,
    list_complete,
    measure_write_rate,
    newest_intact,
    oneline,
    probe_bytes,
    prune,
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
    wait_pruned,
    wait_published,
    write_json_atomic,
)
from rlalign.faults import maybe_fail
from rlalign.fingerprint import state_fingerprints

bucket_files, DEFAULT_BUCKET_BYTES = cw.bucket_files, cw.DEFAULT_BUCKET_BYTES  # the API


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
    """Rank 0 empties `path` of an earlier attempt's leftovers (no rank writes before the layout's
    gather, which rank 0 joins after this)."""
    if rank == 0:
        if path.is_dir():
            for p in path.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        path.mkdir(parents=True, exist_ok=True)


def _failed(e: BaseException, path: Path, step: int | None, rank: int) -> CheckpointError:
    """This rank's write failed: rank 0 removes the .tmp."""
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return _write_error(path, step, e, rank)


def _outcome(group, ok: bool) -> list[bool]:
    """Every rank's outcome of its write, by rank (all ranks of `group` call it)."""
    if not _dist_on():
        return [ok]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, ok, group=group)
    return everyone


def _check_outcome(ok: list[bool], path: Path, step: int | None, rank: int) -> None:
    """CheckpointError on the ranks whose own write succeeded when another rank's failed (rank 0
    removes the .tmp): only a whole checkpoint is published."""
    if not all(ok):
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        bad = [r for r, v in enumerate(ok) if not v]
        raise CheckpointError(f"checkpoint of step {step} not written: rank(s) {bad} failed{_previous(path, step)}")


def _write_fingerprints(path: Path, step: int | None, rank: int, fps: dict[str, str]) -> None:
    try:
        write_json_atomic(path / f"fingerprints-rank{rank:05d}.json", {"rank": rank, "tensors": fps})
    except OSError as e:
        raise _write_error(path, step, e, rank) from None


def _files(state: dict[str, torch.Tensor], rank: int, group, bucket_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """{file name: {key: tensor}} this rank writes (all ranks of `group` call it: the layout is gathered)."""
    held = cw.layout(state, rank, group)
    return cw.plan_files(bucket_files(held, bucket_bytes), state, rank, held)


def _fingerprints_now(state: dict[str, torch.Tensor], files: dict[str, dict[str, torch.Tensor]]) -> dict[str, str]:
    """The fingerprints taken when a save starts: every device tensor's (one launch on the device) and
    those of the CPU tensors this rank does not write; the CPU tensors it writes are fingerprinted
    from what is written, beside the write."""
    written = {k for f in files.values() for k in f}
    now = {k: t for k, t in state.items() if t.device.type != "cpu" or k not in written}
    return state_fingerprints(now) if now else {}


def _write(files: dict[str, dict[str, torch.Tensor]], fps: dict[str, str], path: Path, spares=None,
           writers: int = cw.WRITERS) -> dict[str, str]:
    """The files (rlalign.checkpoint_write), and beside them the fingerprints of the CPU tensors not in
    `fps`: every fingerprint of this rank, by key."""
    later = {k: t for f in files.values() for k, t in f.items() if k not in fps}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlalign-checkpoint-fingerprint") as pool:
        got = pool.submit(state_fingerprints, later) if later else None
        cw.write_files(path, files, spares, writers)
        return dict(sorted({**fps, **(got.result() if got is not None else {})}.items()))


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
        files = _files(state, rank, group, bucket_bytes)
        fps = _fingerprints_now(state, files)
    except OSError as e:
        raise _write_error(path, step, e, rank) from None
    try:
        fps = _write(files, fps, path)
        ok = _outcome(group, True)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        _outcome(group, False)
        raise _failed(e, path, step, rank) from None
    _check_outcome(ok, path, step, rank)
    _write_fingerprints(path, step, rank, fps)


class AsyncSaver:
    """One trainer rank's checkpoint writer in the background (module docstring). All trainer
    ranks call save() together; at most one save is in flight (save() first waits for the last).
    A staged save (checkpoint_write.choose_staging) holds copies: the trainer's tensors may change as
    soon as save() returns; a streamed one reads them: they must not change before wait_tensors()."""

    def __init__(self, staging: str = "auto", writers: int = cw.WRITERS, say=None):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlalign-checkpoint")
        self._pending: Future | None = None
        self._live = False  # the save in flight reads the trainer's tensors
        self._group = None
        self.staging, self.writers, self.buffers = staging, writers, cw.Staging()
        self.say = say if say is not None else (lambda line: print(f"rlalign: {line}", file=sys.stderr, flush=True))
        self._said: bool | None = None
        self.staging_s = 0.0  # the last save's copy into the host buffers (0 when streamed)

    def _gloo_group(self, group):
        """A gloo group of the trainer ranks for the checkpoint's collectives, created once (a
        collective over the default group: every trainer rank is in save())."""
        if not _dist_on():
            return None
        if self._group is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else None
            self._group = dist.new_group(ranks=ranks, backend="gloo")
        return self._group

    def _choose(self, state: dict[str, torch.Tensor], rank: int) -> bool:
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        available = cw.host_memory_available()  # the buffers this saver holds count as available
        available = available + self.buffers.held_bytes if available is not None else None
        staged, line = cw.choose_staging(self.staging, nbytes, available)
        if rank == 0 and staged != self._said:  # once, and again if the choice changes
            self.say(line)
            self._said = staged
        return staged

    def save(self, state: dict[str, torch.Tensor], path: str | Path, rank: int = 0, group=None,
             publish: dict | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Fingerprint this rank's device tensors, stage the state when staged (staging_s), and start
        writing; returns before the write. publish = {"run_dir", "step", "meta", "keep"}: rank 0 then
        completes the checkpoint itself (complete()) once every rank has written its part; the RNG
        states meta.json records are taken now."""
        self.wait()
        path = Path(path)
        step = step_of(path)
        pg = self._gloo_group(group)
        try:
            _prepare_dir(path, rank)
            files = _files(state, rank, pg, bucket_bytes)
            fps = _fingerprints_now(state, files)  # on the tensors' device
        except OSError as e:
            raise _write_error(path, step, e, rank) from None
        staged = self._choose(state, rank)
        t0 = time.perf_counter()
        spares = None
        if staged:
            files = self.buffers.stage(files)
        else:
            self.buffers.drop()
            spares = self.buffers.spares(files, self.writers)
        self.staging_s = time.perf_counter() - t0 if staged else 0.0
        if publish is not None:
            publish = {**publish, "meta": {**_rng_meta(), **publish["meta"]}}
        self._live = not staged
        self._pending = self._pool.submit(self._finish, files, fps, path, step, rank, pg, publish, spares)

    def _finish(self, files: dict, fps: dict[str, str], path: Path, step: int | None, rank: int, pg,
                publish: dict | None, spares) -> Path | None:
        error = None
        try:
            maybe_fail("checkpoint.write", rank)
            fps = _write(files, fps, path, spares, self.writers)
        except BaseException as e:
            error = _failed(e, path, step, rank)
        del files
        if error is None:
            try:
                _write_fingerprints(path, step, rank, fps)
            except CheckpointError as e:
                error = e
        ok = _outcome(pg, error is None)  # every rank's, so rank 0 publishes only a whole checkpoint
        if error is not None:
            raise error
        _check_outcome(ok, path, step, rank)
        if publish is not None and rank == 0:
            return complete(Path(publish["run_dir"]), publish["step"], publish["meta"], publish["keep"],
                            publish.get("export_hf", False), publish.get("tokenizer"))
        return None

    def wait_tensors(self) -> float:
        """Before the trainer changes the tensors of the last save: wait for its write if it reads them
        (streamed; a staged save's failure, once it has happened, is raised here too). Seconds waited."""
        t0 = time.perf_counter()
        if self._pending is not None and (self._live or self._pending.done()):
            self.wait()
        return time.perf_counter() - t0

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any): the published checkpoint's path (rank 0 with
        publish), else None; raises its CheckpointError."""
        pending, self._pending, self._live = self._pending, None, False
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
    index = fitting_index(path, meta, state, rank)
    buf = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in state.items()}
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
    checkpoint's bytes by part (rlalign.rl.checkpoint_parts); `steps`: the steps this
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
    except Exception as e:  # whatever the export met, the checkpoint is published
        shutil.rmtree(tmp / HF_DIR, ignore_errors=True)
        return CheckpointError(oneline(f"checkpoint of step {step} is complete ({final}), but its Hugging Face "
                                       f"export failed: {cause(e)}; export it with: rlalign export {final} OUT_DIR"))
    return None


def _rng_meta() -> dict:
    """This process's Python and torch RNG states, as meta.json records them."""
    v, state, gauss = random.getstate()
    return {"python_rng": [v, list(state), gauss], "torch_rng": torch.get_rng_state().tolist()}


def complete(run_dir: Path, step: int, meta: dict, keep: int, export_hf: bool = False, tokenizer=None) -> Path:
    """Publish a written .tmp checkpoint: the files of `tokenizer` (RUN_DIR/tokenizer) as step_N/tokenizer, its
    index into meta.json (written last, atomically), with export_hf its model as step_N/hf; rename it into
    place and prune old ones beyond `keep`. A failure raises CheckpointError (the step, the path, the cause)
    after removing the .tmp directory; a failed export only after publishing the checkpoint."""
    from rlalign.export import TOKENIZER_DIR, keep_tokenizer

    tmp = tmp_path(run_dir, step)
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    try:
        index = _index(tmp)
    except Damage as d:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(oneline(f"checkpoint of step {step} not written: {tmp}: {d.file}: {d.what}"
                                       f"{_previous(tmp, step)}")) from None
    meta = {**_rng_meta(), **meta, "format": FORMAT, "step": step, **index}
    old = final.with_name(final.name + ".old")
    try:
        keep_tokenizer(tokenizer, tmp / TOKENIZER_DIR)
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
            prune(p)
    if failed is not None:
        raise failed
    return final
