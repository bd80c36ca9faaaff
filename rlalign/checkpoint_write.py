"""One trainer rank's checkpoint files, written at the disk's speed (rlalign.checkpoint calls it).

Writers (layout, writers). A tensor held by one rank (an expert's weights and AdamW state at EP > 1, a
dense unit's master and AdamW state with trainer.shard_dense) is written by that rank. A tensor held by
several ranks (replicated: the dense weights, and their masters and AdamW state unless
trainer.shard_dense shards them) is written once, by one of its holders chosen so that the ranks'
written bytes are as even as possible, as torch.distributed.checkpoint's default save planner balances
replicated items: each rank starts with the bytes of the tensors only it holds; then the replicated
keys, largest first (ties by key), each go to the holder with the fewest bytes so far (ties to the
lowest rank). Every rank computes the same writers from the layout it gathers (one all_gather_object
of every rank's keys and sizes). Nothing looks for a tensor at its writer: meta.json indexes every
tensor by the file that holds it (from the files' headers), DCP's reader finds it from the headers,
and so every checkpoint loads whichever rank wrote what, at any EP size.

Files. Each rank writes the files torch.distributed.checkpoint's HuggingFaceStorageWriter
(save_distributed=True) would, and its HuggingFaceStorageReader loads: for each bucket i of n that holds
tensors this rank writes, `shard-<rank+1>-model-<i>-of-<n>.safetensors`: the header's length (8 bytes,
little-endian), the JSON header (DCP's __metadata__: DCP_SHARDING_INFO, DCP_VERSION, format; the tensors
in safetensors' order, by dtype then name; spaces to a multiple of 8 bytes) and the tensors' bytes,
exactly what safetensors.torch.save makes of them (tests/test_checkpoint_write.py). They are written
here because DCP's writer builds each file as a Python bytes object (safetensors.torch.save: two fresh
copies of the file, page faults included) and writes one file at a time, and safetensors' save_file
reports a full disk without an errno.

How a file is written: opened once, the header, the tensors' bytes in os.write calls of up to 64 MiB
(which release the GIL), one fsync, closed. The files go to `writers` threads (WRITERS), so that the
copies into the page cache and the disk's writeback overlap; nothing is flushed tensor by tensor.

Staging (Staging). `staged`: the rank's tensors are copied into host buffers kept across saves (one
flat buffer a file, laid out in the file's order, so its tensor bytes are one contiguous range; pinned
on CUDA), and the trainer may change its tensors once that copy is done. `streamed`: no copy of the
whole state; a CPU tensor is written where it lies, a device tensor through one reusable buffer of a
file per writer (pinned); the trainer waits for the write. checkpoint.staging=auto stages when the
host has room: the rank's state within half of MemAvailable (/proc/meminfo).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from rlalign.checkpoint_files import ST_DTYPE, shard_name, size_text

WRITERS = 4  # files written at once by one rank
CHUNK = 64 << 20  # bytes per os.write
# safetensors' order of the tensors in a file: dtype (its enum, descending), then name. The larger
# elements first, so that every tensor starts at a multiple of its element size.
_DTYPE_ORDER = {d: i for i, d in enumerate(["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"])}
# DCP's safetensors metadata (torch.distributed.checkpoint._hf_utils: CUSTOM_METADATA_KEY, DCP_VERSION_KEY, ...)
_DCP_META = {"sharding": "DCP_SHARDING_INFO", "version": ("DCP_VERSION", "1.0"), "format": ("format", "pt")}
DEFAULT_BUCKET_BYTES = 512 << 20  # checkpoint.bucket_mb's default


def bucket_files(layout: dict[str, tuple[int, int]], bucket_bytes: int) -> dict[str, int]:
    """{key: file index 1..n} of the checkpoint's tensors from {key: (the rank that writes it, bytes)}
    (layout): keys ordered by (rank, key), cut into consecutive groups of at most bucket_bytes (a tensor
    larger than that: a group of its own). Every rank computes the same map from the same layout."""
    out: dict[str, int] = {}
    index, filled = 1, 0
    for key, (_, nbytes) in sorted(layout.items(), key=lambda kv: (kv[1][0], kv[0])):
        if filled and filled + nbytes > bucket_bytes:
            index, filled = index + 1, 0
        out[key] = index
        filled += nbytes
    return out


def writers(held: dict[str, tuple[list[int], int]]) -> dict[str, tuple[int, int]]:
    """{key: (the rank that writes it, bytes)} from {key: (the ranks holding it, bytes)}: a key of one
    holder to that holder; the others, largest first (ties by key), each to the holder with the fewest
    bytes so far (ties to the lowest rank), counting every rank's own keys first (module docstring)."""
    load = {r: 0 for ranks, _ in held.values() for r in ranks}
    out: dict[str, tuple[int, int]] = {}
    for k, (ranks, nbytes) in held.items():
        if len(ranks) == 1:
            out[k] = (ranks[0], nbytes)
            load[ranks[0]] += nbytes
    for k in sorted((k for k in held if k not in out), key=lambda k: (-held[k][1], k)):
        ranks, nbytes = held[k]
        w = min(ranks, key=lambda r: (load[r], r))
        out[k] = (w, nbytes)
        load[w] += nbytes
    return dict(sorted(out.items()))


def layout(state: dict[str, torch.Tensor], rank: int, group) -> dict[str, tuple[int, int]]:
    """{key: (the rank that writes it, bytes)} over every rank of `group` (all call it): every rank's
    keys and sizes gathered, then writers()."""
    mine = {k: v.numel() * v.element_size() for k, v in state.items()}
    if not (dist.is_available() and dist.is_initialized()):
        return {k: (rank, n) for k, n in mine.items()}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (rank, mine), group=group)
    held: dict[str, tuple[list[int], int]] = {}
    for r, part in sorted(everyone, key=lambda x: x[0]):
        for k, n in part.items():
            held.setdefault(k, ([], n))[0].append(r)
    return writers(held)


def file_order(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The keys in the order safetensors lays a file's tensors out."""
    return sorted(tensors, key=lambda k: (_DTYPE_ORDER[ST_DTYPE[tensors[k].dtype]], k))


def header(tensors: dict[str, torch.Tensor]) -> bytes:
    """The length prefix and JSON header of a safetensors file of `tensors` with DCP's metadata
    (no-copy: shapes and dtypes only)."""
    meta = {_DCP_META["sharding"]: json.dumps({k: {"saved_offsets": [0] * t.dim()} for k, t in tensors.items()}),
            _DCP_META["version"][0]: _DCP_META["version"][1], _DCP_META["format"][0]: _DCP_META["format"][1]}
    entries: dict[str, object] = {"__metadata__": meta}
    offset = 0
    for k in file_order(tensors):
        t = tensors[k]
        n = t.numel() * t.element_size()
        entries[k] = {"dtype": ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy when it is contiguous."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview) -> int:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done : done + CHUNK])
    return done


def write_file(path: Path, head: bytes, parts: list[memoryview]) -> None:
    """`head`, then `parts`, into a new file at `path`; fsync once at the end (raises OSError, e.g. ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(head))
        for p in parts:
            _write_all(fd, p)
        os.fsync(fd)
    finally:
        os.close(fd)


def plan_files(keys: dict[str, int], state: dict[str, torch.Tensor], rank: int, layout: dict[str, tuple[int, int]]
               ) -> dict[str, dict[str, torch.Tensor]]:
    """{file name: {key: tensor}} of the tensors this rank writes (those `layout` gives it), by
    bucket (`keys`: {key: bucket index 1..n}, rlalign.checkpoint.bucket_files)."""
    of = max(keys.values(), default=1)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in state.items():
        if layout[k][0] == rank:
            out.setdefault(shard_name(rank, keys[k], of), {})[k] = t
    return dict(sorted(out.items()))


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except OSError:
        return None
    return None


def choose_staging(mode: str, nbytes: int, available: int | None) -> tuple[bool, str]:
    """(stage the whole state?, the one line that says so) for checkpoint.staging = auto | host | stream, or
    sync (checkpoint.async_save=false: training waits for every save, so there is nothing to stage for)."""
    if mode == "sync":
        return False, (f"checkpoint staging: none (checkpoint.async_save=false): this rank's {size_text(nbytes)} "
                       f"is written before training goes on")
    room = available is not None and 2 * nbytes <= available
    staged = mode == "host" or (mode == "auto" and room)
    have = f"{size_text(available)} available" if available is not None else "host memory unknown"
    if staged:
        return True, (f"checkpoint staging: this rank's {size_text(nbytes)} is copied into host buffers kept "
                      f"across saves ({have}); training goes on while the files are written")
    why = "checkpoint.staging=stream" if mode == "stream" else f"not within half of the host's {have}"
    return False, (f"checkpoint staging: this rank's {size_text(nbytes)} is written from the trainer's tensors "
                   f"({why}): each save stalls the next update until its files are written "
                   f"(checkpoint.staging=host stages it anyway)")


def _flat(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)


def _views(flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host tensors of `tensors`' shapes and dtypes laid out in file order in `flat` (no gaps)."""
    out, offset = {}, 0
    for k in file_order(tensors):
        t = tensors[k]
        n = t.numel() * t.element_size()
        out[k] = flat[offset : offset + n].view(t.dtype).view(t.shape)
        offset += n
    return out


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Staging:
    """Host buffers of one rank's checkpoint, kept across saves (pinned when the state is on a GPU):
    `staged`: a flat buffer per file (reallocated only when the files' shapes change); streamed device
    tensors: one buffer of the largest file per writer."""

    def __init__(self):
        self._files: dict[str, tuple[tuple, torch.Tensor]] = {}
        self._spare: list[torch.Tensor] = []

    @property
    def held_bytes(self) -> int:
        return sum(f.numel() for _, f in self._files.values()) + sum(b.numel() for b in self._spare)

    def stage(self, files: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of `files`' tensors in the kept buffers (blocking: on return they hold the bits)."""
        out, devices = {}, set()
        for name, tensors in files.items():
            shape = tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors.items())
            kept = self._files.get(name)
            if kept is None or kept[0] != shape:
                pinned = any(t.is_cuda for t in tensors.values())
                kept = self._files[name] = (shape, _flat(_nbytes(tensors), pinned))
            views = _views(kept[1], tensors)
            with torch.no_grad():
                for k, t in tensors.items():
                    views[k].copy_(t, non_blocking=t.is_cuda)
                    if t.is_cuda:
                        devices.add(t.device)
            out[name] = views
        self.drop(keep=set(files))
        for d in devices:
            torch.cuda.synchronize(d)
        return out

    def drop(self, keep: set[str] = frozenset()) -> None:
        """Let go of the staged buffers of files not in `keep` (all: a streamed save needs none)."""
        for name in set(self._files) - set(keep):
            del self._files[name]

    def spares(self, files: dict[str, dict[str, torch.Tensor]], writers: int) -> queue.Queue:
        """`writers` pinned buffers of the largest file with a device tensor (streamed saves), kept."""
        need = max((_nbytes(t) for t in files.values() if any(x.is_cuda for x in t.values())), default=0)
        q: queue.Queue = queue.Queue()
        if need == 0:
            return q
        if len(self._spare) < writers or any(b.numel() < need for b in self._spare):
            self._spare = [_flat(need, True) for _ in range(writers)]
        for b in self._spare:
            q.put(b)
        return q


def _write_one(path: Path, tensors: dict[str, torch.Tensor], spares: queue.Queue, failed: threading.Event) -> None:
    """One file, unless another has failed; a device tensor goes through a spare host buffer (blocking
    copies)."""
    if failed.is_set():
        return
    buf = spares.get() if any(t.is_cuda for t in tensors.values()) else None
    try:
        if buf is not None:
            views = _views(buf, tensors)
            with torch.no_grad():
                for k, t in tensors.items():
                    views[k].copy_(t)
            tensors = views
        write_file(path, header(tensors), [_bytes_of(tensors[k]) for k in file_order(tensors)])
    except BaseException:
        failed.set()
        raise
    finally:
        if buf is not None:
            spares.put(buf)


def write_files(directory: Path, files: dict[str, dict[str, torch.Tensor]], spares: queue.Queue | None = None,
                writers: int = WRITERS) -> None:
    """Every file of `files` ({name: {key: tensor}}) into `directory`, `writers` at a time; the first
    error is raised once every writer has stopped (the files not begun by then are not begun)."""
    spares = spares if spares is not None else queue.Queue()
    n, failed = max(1, min(writers, len(files))), threading.Event()
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="rlalign-checkpoint-write") as pool:
        futures = [pool.submit(_write_one, directory / name, t, spares, failed) for name, t in files.items()]
    for f in futures:
        e = f.exception()
        if e is not None:
            if isinstance(e, OSError) and e.filename is None:
                e.filename = str(directory)
            raise e
