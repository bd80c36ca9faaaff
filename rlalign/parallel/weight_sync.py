"""Weight sync on the device: the trainer group (EP n) -> the generator group (EP m), bucketed,
resharded on the receiving side, verified by fingerprints computed on the device on both sides.

Who talks to whom. A second process group, independent of each side's own EP group, holds
trainer rank 0 and every generator rank (sync rank 0 = trainer rank 0, sync rank 1 + g =
generator rank g). It is built from torch.distributed's pieces (its own TCPStore hosted by
trainer rank 0, a PrefixStore, ProcessGroupGloo on CPU / ProcessGroupNCCL on CUDA), so it lives
beside the default group each actor already joined. Why rank 0 only, not every trainer rank:
the trainer ranks hold replicated dense weights and disjoint expert shards, so whatever the
trainer EP size the bytes to move are the full model once; rank 0 collects the expert shards
inside the trainer group (one gather per expert tensor, the trainer's own NCCL links) and is the
one sender, so one extra communicator per job instead of n, and the bits sent are exactly those
the checkpoint and `full_state` see. A broadcast's cost is the bytes over the slowest link,
whatever the number of receivers.

What moves. A `SyncPlan` packs the parameters (unsharded shapes, model order) into buckets of at
most `bucket_bytes` per dtype; a tensor larger than that gets a bucket of its own. Per bucket:
rank 0 fills a flat byte buffer (dense weights copied, expert weights gathered straight into
their slice of it), broadcasts it; each generator rank copies its EP shard (experts split on
dim 0 into m parts) into its parameters. Colocated on CUDA (trainer rank 0 and generator rank 0
on one GPU, where NCCL refuses two ranks) rank 0 keeps the filled buckets and hands CUDA IPC
handles (torch.multiprocessing.reductions.reduce_tensor) to generator rank 0 through Ray, which
copies from them device to device and broadcasts to its peers over the generator group (the
trainer then holds one copy of the weights in buckets until the generator has read them). With one
rank per side (trainer EP 1, generator EP 1 on one GPU) nothing is packed at all: the generator
opens CUDA IPC views of the trainer's parameters once (send_direct / open_direct; again only if a
parameter moves) and each sync copies every parameter from them on the device (receive_direct).

How it is checked. `partial_fingerprints`: every tensor's share of its fingerprint
(rlalign.kernels.fingerprint: the bytes as words mixed with their index in the unsharded tensor,
two sums mod 2**32; a word never straddles two dim-0 rows, so an expert shard is a whole number
of words). A rank hashes what it holds with global indices, so the shards' sums add up to the
full tensor's at any EP size; `merge` adds them and finalizes with the full dtype and shape: the
value is the tensor's fingerprint, the same as a trace's or a checkpoint's of that tensor, on any
device. One kernel launch per side reads each byte once; 8 bytes per tensor leave the device. One
changed word changes the sum (each word's mix is a bijection). The trainer hashes the weights it
sent (rank 0 its dense tensors, every rank its expert shard); every generator rank hashes the
parameters it now holds (its dense copies too); `check` compares and raises SyncError naming the
first tensor (and rank) that differs.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from rlalign import kernels
from rlalign.fingerprint import combined
from rlalign.kernels import fingerprint as fpk
from rlalign.parallel.ep import is_expert_param

_ALIGN = 256  # bytes: every tensor starts at an aligned offset of its bucket


class SyncError(RuntimeError):
    """The generator's weights after a sync are not the trainer's (the message names the tensor)."""


# --- the plan ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]  # unsharded
    offset: int  # bytes into the bucket
    nbytes: int
    expert: bool  # split on dim 0 over EP ranks


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    nbytes: int
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class SyncPlan:
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def specs(self) -> list[tuple[str, str, tuple[int, ...], bool]]:
        """(name, dtype, unsharded shape, is expert) of every tensor in plan order: what the two sides
        compare once, and what the driver merges fingerprint shares with."""
        return [(e.name, str(b.dtype), e.shape, e.expert) for b in self.buckets for e in b.entries]


def tensor_specs(model: torch.nn.Module, ep_world: int) -> list[tuple[str, torch.dtype, tuple[int, ...], bool]]:
    """(name, dtype, unsharded shape, is expert) of a model's parameters, in model order."""
    out = []
    for n, p in model.named_parameters():
        expert = is_expert_param(n)
        shape = tuple(p.shape)
        if expert and ep_world > 1:
            shape = (shape[0] * ep_world, *shape[1:])
        out.append((n, p.dtype, shape, expert))
    return out


def make_plan(specs: list[tuple[str, torch.dtype, tuple[int, ...], bool]], bucket_bytes: int) -> SyncPlan:
    """Buckets per dtype (first appearance order), tensors in the given order, each bucket at most
    bucket_bytes unless one tensor alone is larger. A pure function of its arguments."""
    if bucket_bytes < 1:
        raise ValueError(f"sync bucket size {bucket_bytes} bytes: must be >= 1")
    by_dtype: dict[torch.dtype, list] = {}
    for s in specs:
        by_dtype.setdefault(s[1], []).append(s)
    buckets = []
    for dtype, group in by_dtype.items():
        entries: list[Entry] = []
        off = 0
        for name, _, shape, expert in group:
            nbytes = _numel(shape) * dtype.itemsize
            start = -(-off // _ALIGN) * _ALIGN
            if entries and start + nbytes > bucket_bytes:
                buckets.append(Bucket(dtype, off, tuple(entries)))
                entries, start = [], 0
            entries.append(Entry(name, shape, start, nbytes, expert))
            off = start + nbytes
        if entries:
            buckets.append(Bucket(dtype, off, tuple(entries)))
    return SyncPlan(tuple(buckets))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _view(buf: torch.Tensor, bucket: Bucket, e: Entry) -> torch.Tensor:
    return buf[e.offset : e.offset + e.nbytes].view(bucket.dtype).view(e.shape)


def _shard(full: torch.Tensor, e: Entry, rank: int, world: int) -> torch.Tensor:
    if not e.expert or world == 1:
        return full
    k = full.shape[0] // world
    return full[rank * k : (rank + 1) * k]


# --- fingerprints on the device -------------------------------------------------------------------
def partial_fingerprints(model: torch.nn.Module, plan: SyncPlan, rank: int, world: int,
                         dense: bool = True) -> list[int]:
    """This rank's shares (plan order; raw sums, rlalign.kernels.fingerprint.add_raw adds them) of
    the fingerprints of the tensors it holds: its expert shard (rows from rank x its row count),
    and the dense tensors when `dense` (else 0 for them). One launch; one read back."""
    params = dict(model.named_parameters())
    parts, at = [], []
    entries = [e for b in plan.buckets for e in b.entries]
    for i, e in enumerate(entries):
        p = params.get(e.name)
        if p is None:
            raise SyncError(f"weight sync: this rank's model has no parameter {e.name!r}")
        if e.expert:
            parts.append(fpk.Part(p, first_row=rank * p.shape[0] if world > 1 else 0, name=e.name))
        elif dense:
            parts.append(fpk.Part(p, name=e.name))
        else:
            continue
        at.append(i)
    out = [0] * len(entries)
    if parts:
        sums = kernels.fingerprint_sums(parts).cpu().numpy().view("uint32")
        for i, v in zip(at, fpk.raw_values(sums)):
            out[i] = v
    return out


def merge(specs: list[tuple], shares: list[list[int]], side: str, dense_on_all: bool) -> dict[str, str]:
    """Full-tensor fingerprints from every rank's shares: expert shares added over ranks; a dense
    tensor is rank 0's (dense_on_all: every rank hashed its copy, and all must agree; a rank with
    a bad copy is named)."""
    out = {}
    for i, (name, dtype, shape, expert) in enumerate(specs):
        vals = [s[i] for s in shares]
        dt = getattr(torch, str(dtype).removeprefix("torch."))
        if expert:
            out[name] = fpk.hex64(fpk.finalize(fpk.add_raw(vals), dt, shape))
            continue
        for r, v in enumerate(vals if dense_on_all else vals[:1]):
            if v != vals[0]:
                got, want = (fpk.hex64(fpk.finalize(x, dt, shape)) for x in (v, vals[0]))
                raise SyncError(f"weight sync: {side} rank {r} holds tensor {name!r} with fingerprint {got}, "
                                f"rank 0 {want}")
        out[name] = fpk.hex64(fpk.finalize(vals[0], dt, shape))
    return out


def check(trainer_fps: dict[str, str], generator_fps: dict[str, str]) -> str:
    """The combined fingerprint of the synced weights, or SyncError naming the first tensor whose
    fingerprint differs between the trainer and the generator."""
    for k in trainer_fps:
        if trainer_fps[k] != generator_fps.get(k):
            raise SyncError(f"weight sync: tensor {k!r} differs between trainer and generator after re-sharding "
                            f"(device fingerprints: trainer {trainer_fps[k]}, generator {generator_fps.get(k)})")
    extra = sorted(set(generator_fps) - set(trainer_fps))
    if extra:
        raise SyncError(f"weight sync: the generator holds tensor {extra[0]!r}, which the trainer did not send")
    return combined(trainer_fps)


def check_specs(trainer: list, generator: list) -> None:
    """Both sides' plans must list the same tensors (names, dtypes, unsharded shapes, order)."""
    for a, b in zip(trainer, generator):
        if tuple(a) != tuple(b):
            raise SyncError(f"weight sync: the trainer's tensor {tuple(a)} meets the generator's {tuple(b)} "
                            f"(not the same model?)")
    if len(trainer) != len(generator):
        longer, side = (trainer, "trainer") if len(trainer) > len(generator) else (generator, "generator")
        raise SyncError(f"weight sync: only the {side} has tensor {tuple(longer[min(len(trainer), len(generator))])}")


# --- the cross-group ------------------------------------------------------------------------------
class SyncGroup:
    """trainer rank 0 (sync rank 0) + every generator rank (sync rank 1 + g), beside the default
    group: its own TCPStore, hosted by sync rank 0 (create it first with `host_store`)."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float,
                 store: dist.TCPStore | None = None):
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        self.store, self.rank, self.world, self.backend = store, rank, world, backend
        prefix = dist.PrefixStore("rlalign/weight_sync", store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, rank, world, timeout)

    @staticmethod
    def host_store(host: str, world: int, timeout_s: float) -> dist.TCPStore:
        """Sync rank 0's store on a free port (store.port), not waiting for the others yet."""
        return dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast(self, t: torch.Tensor, root: int = 0):
        """Started, not waited for: the returned work's wait() orders the current stream after it."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self.pg.broadcast([t], opts)


@dataclass
class SyncOutput:
    """One rank's part of a sync: its fingerprint shares (plan order) and what it moved."""

    shares: list[int]
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    ipc: list | None = None  # colocated: trainer rank 0's CUDA IPC handles of the buckets (direct: parameters)
    device_uuid: str | None = None
    direct: bool = False  # send_direct's: the generator copies from the trainer's parameters themselves
    resume_seconds: float = 0.0  # a generator rank: mapping its released memory back before the copy
    call_seconds: float = 0.0  # a generator rank: its whole receive_weights (the rest of the sync: Ray, driver)


def device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def send(model: torch.nn.Module, plan: SyncPlan, rank: int, world: int, group, sync: SyncGroup | None,
         ipc: bool = False) -> tuple[SyncOutput, list[torch.Tensor]]:
    """A trainer rank's side (all trainer ranks call it together): rank 0 fills each bucket
    (expert shards gathered from the trainer group into it) and broadcasts it over `sync`, or,
    with ipc, keeps the buckets and returns their CUDA IPC handles (the caller holds the returned
    buffers until the generator has copied them)."""
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    root = dist.get_global_rank(group, 0) if group is not None else 0
    kept: list[torch.Tensor] = []
    works = []  # a bucket's broadcast runs while the next one is filled; two buckets alive at most
    with torch.no_grad():
        for b in plan.buckets:
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device) if rank == 0 else None
            for e in b.entries:
                p = params[e.name].detach()
                if e.expert and world > 1:
                    parts = list(_view(buf, b, e).chunk(world, 0)) if rank == 0 else None
                    dist.gather(p.contiguous(), parts, dst=root, group=group)
                elif rank == 0:
                    _view(buf, b, e).copy_(p)
            if rank == 0:
                if ipc:
                    kept.append(buf)
                else:
                    works.append(sync.broadcast(buf))
                    if len(works) > 1:
                        works.pop(0).wait()
    for w in works:
        w.wait()
    shares = partial_fingerprints(model, plan, rank, world, dense=rank == 0)
    out = SyncOutput(shares, plan.nbytes if rank == 0 else 0, len(plan.buckets) if rank == 0 else 0)
    if ipc and rank == 0:
        _sync_device(device)  # the buckets are written before the generator reads them
        out.ipc = [reduce_tensor(buf) for buf in kept]
        out.device_uuid = device_uuid(device)
    out.seconds = time.perf_counter() - t0
    return out, kept


def receive(model: torch.nn.Module, plan: SyncPlan, rank: int, world: int, group, sync: SyncGroup | None,
            ipc: list | None = None, ipc_uuid: str | None = None,
            tamper: Callable[[int, torch.Tensor], None] | None = None) -> SyncOutput:
    """A generator rank's side (all generator ranks call it together): each bucket arrives (a
    broadcast over `sync`; colocated: rank 0 opens trainer rank 0's IPC handles and broadcasts over
    the generator group), this rank copies its EP shard into its parameters; then it hashes every
    parameter it holds. `tamper(bucket index, buffer)`: tests only (corrupt a received bucket)."""
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    colocated = ipc is not None or (sync is None)
    if colocated and rank == 0:
        mine = device_uuid(device)
        if ipc is None or mine != ipc_uuid:
            raise SyncError(f"weight sync (colocated): generator rank 0 is on GPU {mine}, trainer rank 0's buckets on "
                            f"{ipc_uuid}; CUDA IPC needs the same GPU (placement.colocate puts rank 0 of both groups "
                            f"on bundle 0)")
    root = dist.get_global_rank(group, 0) if group is not None else 0

    def post(i: int):  # bucket i's receive buffer and its broadcast, started
        buf = torch.empty(plan.buckets[i].nbytes, dtype=torch.uint8, device=device)
        return buf, sync.broadcast(buf)

    with torch.no_grad():
        nxt = post(0) if not colocated and plan.buckets else None
        for i, b in enumerate(plan.buckets):
            if not colocated:  # two buckets in flight: bucket i + 1 arrives while bucket i is copied
                (buf, work), nxt = nxt, post(i + 1) if i + 1 < len(plan.buckets) else None
                work.wait()
            elif rank == 0:
                fn, args = ipc[i]
                buf = fn(*args)
                if world > 1:
                    buf = buf.clone()
                    dist.broadcast(buf, src=root, group=group)
            else:
                buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
                dist.broadcast(buf, src=root, group=group)
            if tamper is not None:
                tamper(i, buf)
            for e in b.entries:
                p = params.get(e.name)
                if p is None:
                    raise SyncError(f"weight sync: the generator has no parameter {e.name!r}")
                p.copy_(_shard(_view(buf, b, e), e, rank, world))
            del buf
    shares = partial_fingerprints(model, plan, rank, world, dense=True)
    return SyncOutput(shares, plan.nbytes, len(plan.buckets), time.perf_counter() - t0)


# --- colocated, one rank per side: straight from the trainer's parameters --------------------------
def send_direct(model: torch.nn.Module, plan: SyncPlan, handles: bool) -> SyncOutput:
    """Trainer EP 1 and generator EP 1 on one GPU: nothing is packed; the generator copies every
    parameter straight from the trainer's (receive_direct, through CUDA IPC views of them that it
    opens once). Returns the trainer's fingerprint shares (their read-back also orders the step's
    updates before the generator's reads) and, with `handles`, the parameters' IPC handles in plan
    order (needed once, and again only if a parameter moved)."""
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    shares = partial_fingerprints(model, plan, 0, 1, dense=True)
    device = next(iter(params.values())).device
    out = SyncOutput(shares, plan.nbytes, 0, direct=True, device_uuid=device_uuid(device))
    if handles:
        out.ipc = [reduce_tensor(params[e.name].detach()) for b in plan.buckets for e in b.entries]
    out.seconds = time.perf_counter() - t0
    return out


def open_direct(model: torch.nn.Module, ipc: list, ipc_uuid: str | None) -> list[torch.Tensor]:
    """The generator's views of the trainer's parameters (plan order) from send_direct's handles."""
    mine = device_uuid(next(model.parameters()).device)
    if mine != ipc_uuid:
        raise SyncError(f"weight sync (colocated): the generator is on GPU {mine}, the trainer's parameters on "
                        f"{ipc_uuid}; CUDA IPC needs the same GPU")
    return [fn(*args) for fn, args in ipc]


def receive_direct(model: torch.nn.Module, plan: SyncPlan, sources: list[torch.Tensor]) -> SyncOutput:
    """The generator's side of send_direct: each parameter copied on the device from the trainer's,
    then every parameter hashed."""
    t0 = time.perf_counter()
    params = dict(model.named_parameters())
    entries = [e for b in plan.buckets for e in b.entries]
    if len(sources) != len(entries):
        raise SyncError(f"weight sync (colocated): {len(sources)} trainer parameters for {len(entries)} in the plan")
    with torch.no_grad():
        for e, src in zip(entries, sources):
            p = params.get(e.name)
            if p is None or tuple(p.shape) != tuple(src.shape) or p.dtype != src.dtype:
                raise SyncError(f"weight sync (colocated): the generator's {e.name!r} "
                                f"({None if p is None else (tuple(p.shape), p.dtype)}) cannot take the trainer's "
                                f"{(tuple(src.shape), src.dtype)}")
            p.copy_(src)
    shares = partial_fingerprints(model, plan, 0, 1, dense=True)
    return SyncOutput(shares, plan.nbytes, 0, time.perf_counter() - t0, direct=True)
