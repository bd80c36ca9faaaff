"""Process groups without Ray: join one (gloo on CPU, NCCL on GPU), or run a function on `world`
ranks (torch.multiprocessing, forked from a server that holds the imports) that each join one — how
`rlalign agree` and the GPU tests run the workers of rlalign/workers.py without Ray.

A rank that raises or dies makes the launcher stop the others at once and raise an error naming
that rank; collectives carry a timeout (dist.timeout_s) so nothing waits forever.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# run_workers forks every rank on this machine: its group meets at the address this machine's name
# resolves to, the one Gloo opens its sockets on by default
LOCAL_HOST = socket.gethostname()


class WorkerError(RuntimeError):
    pass


def shard_range(n: int, world: int, rank: int) -> range:
    """Contiguous, near-equal split of n items; the first n % world ranks get one more."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (1 if rank < extra else 0))


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a group whose ranks are other processes, served by this one on a
    port the OS picks (store.port) and holds from the start: no other job can take the port between
    choosing it and binding it (a port probed free, released and bound later by rank 0 can be, and
    then a rank may join another job's store). The server listens on every interface; the ranks
    reach it at `host`, this node's address. Keep it alive as long as the group: the ranks use it
    for communicators (NCCL's, lazily) and subgroups."""
    return dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def interface_of(ip: str) -> str | None:
    """The name of this machine's network interface that holds IPv4 address `ip` (None: none does)."""
    import fcntl
    import socket
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                addr = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(addr[20:24]) == ip:
                return name
    return None


def use_interface(node_ip: str) -> None:
    """Gloo and NCCL open their sockets on the interface of `node_ip` (the address this node is known
    by in the cluster), unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME already say which: by default
    they take the address the hostname resolves to, often the loopback one (/etc/hosts), which peers on
    other nodes cannot reach."""
    name = interface_of(node_ip)
    if name is None:
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, name)


def check_local_world(world: int, device: str, what: str) -> None:
    """run_workers' `world` ranks fit this machine: one GPU each on CUDA."""
    if world < 1:
        raise ValueError(f"{what}={world}: must be >= 1")
    if device.startswith("cuda"):
        n = torch.cuda.device_count()
        if world > n:
            raise ValueError(f"{what}={world} needs {world} GPUs (one rank each); this machine has {n}")


def init_group(device: str, rank: int, world: int, host: str, port: int, timeout_s: float, local_gpu: int) -> None:
    """Join a process group through the store at host:port (host_store, served by rank 0's node): gloo
    on CPU, NCCL on GPU (this process on GPU local_gpu), with a collective timeout so a dead peer
    fails the others instead of hanging them."""
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(local_gpu)
        backend = "nccl"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _entry(rank, world, port, device, timeout_s, threads, fn, args, q, env):
    status, payload = "error", ""
    try:
        os.environ.clear()  # the caller's environment now, not the fork server's at its start
        os.environ.update(env)
        torch.set_num_threads(threads)
        status = "join-error"
        init_group(device, rank, world, LOCAL_HOST, port, timeout_s, local_gpu=rank)
        status = "error"
        # plain pickle: tensors travel as bytes, not as shared-memory handles that die with this process
        status, payload = "ok", pickle.dumps(fn(rank, world, dist.group.WORLD, *args))
        dist.destroy_process_group()
    except BaseException:
        payload = traceback.format_exc()
    q.put((rank, status, payload))
    q.close()
    q.join_thread()  # the message is out before the process ends
    sys.stdout.flush()
    os._exit(0 if status == "ok" else 1)


def _blame(world: int, silent: dict[int, int], errors: dict[int, str]) -> WorkerError:
    """The root cause: a rank that died without a word (killed, crashed; silent maps it to its exit
    code) before one that raised (its peers' errors are usually 'connection closed' echoes); else
    the first error."""
    if silent:
        r = min(silent)
        others = "; ".join(f"rank {k}: {v.strip().splitlines()[-1]}" for k, v in sorted(errors.items()))
        return WorkerError(f"rank {r} of {world} died (exit code {silent[r]}) without a result"
                           + (f" (then {others})" if others else ""))
    r = next(iter(errors))
    return WorkerError(f"rank {r} of {world} failed: {errors[r].strip().splitlines()[-1]}\n{errors[r]}")


# a join can fail when Gloo's full-mesh connect loses a race (a peer's socket closed during the
# handshake, under load): nothing of fn has run yet, so the launch is tried again on a fresh store
JOIN_ATTEMPTS = 3


def run_workers(world: int, fn: Callable, args: tuple, device: str = "cpu", timeout_s: float = 60.0) -> list:
    """fn(rank, world, group, *args) on `world` spawned ranks; returns results in rank order.
    fn must be importable (module level) and return picklable data (dataclasses, tensors).
    The ranks fork from a server process that imported torch and rlalign's workers once (started on
    the first call, before any CUDA use: a fresh process per rank paid ~1 s of imports on every
    call); each rank runs with the caller's environment of this call (os.environ), as a spawned one would.
    A launch whose ranks could not connect (join_lost_race) is tried again, up to JOIN_ATTEMPTS."""
    for attempt in range(1, JOIN_ATTEMPTS + 1):
        results, errors, silent = _launch(world, fn, args, device, timeout_s)
        if len(results) == world:
            return [results[r] for r in range(world)]
        if not (join_lost_race(errors, results, silent) and attempt < JOIN_ATTEMPTS):
            raise _blame(world, silent, {r: text for r, (_, text) in errors.items()})
        r, (_, text) = next(iter(errors.items()))
        print(f"rank {r} of {world} could not join its group ({text.strip().splitlines()[-1][:200]}); "
              f"launching again on a fresh store (attempt {attempt + 1} of {JOIN_ATTEMPTS})", file=sys.stderr)
    raise AssertionError("unreachable")


def join_lost_race(errors: dict[int, tuple[str, str]], results: dict, silent: dict[int, int]) -> bool:
    """Every failure was in joining the group (no rank ran fn, none died without a word) and at
    least one is Gloo's full-mesh connect cut short, not a timeout (a peer that never came)."""
    if results or silent or not errors or any(status != "join-error" for status, _ in errors.values()):
        return False
    return any("connectFullMesh" in text and "timed out" not in text.lower() for _, text in errors.values())


def _launch(world: int, fn: Callable, args: tuple, device: str, timeout_s: float):
    """One launch of the ranks, ended: ({rank: result}, {rank: (status, traceback)}, {rank: exit
    code} of the ranks that died without a word before the launcher stopped the others)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rlalign.workers"])
    q = ctx.Queue()
    store = host_store(LOCAL_HOST, timeout_s)  # lives until the ranks are done (this frame)
    port = store.port
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, device, timeout_s, threads, fn, args, q, dict(os.environ)),
                    daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, tuple[str, str]] = {}
    failed_at = None
    try:
        while len(results) + len(errors) < world:
            if failed_at is not None and time.monotonic() - failed_at > 1.0:
                break  # waited long enough for the other ranks' last words
            try:
                rank, status, payload = q.get(timeout=0.1)
                if status == "ok":
                    results[rank] = pickle.loads(payload)  # from our own child process
                else:
                    errors[rank] = (status, payload)
                    failed_at = failed_at or time.monotonic()
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
                if dead and failed_at is None:
                    failed_at = time.monotonic()
        silent = {r: p.exitcode for r, p in enumerate(procs)
                  if not p.is_alive() and p.exitcode not in (0, 1) and r not in errors}
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world:
                p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results, errors, silent


class Lockstep:
    """The generator ranks of one expert-parallel group step together: every MoE layer's all-to-all
    needs every rank, so a rank with nothing left runs empty steps while others work. Before each
    step the ranks agree, through an all-reduce of host integers on a gloo group (it waits for no
    device work, so a lookahead step stays queued behind the running one), on the most rows any
    rank's step holds (0: every rank is done, unless one waits for an episode's environment) and
    whether every rank's step is decode-only (then the fixed-capacity all-to-all at a bound from those
    rows, which a CUDA graph can capture).

    Over NCCL the gloo group is a new group of the same ranks: every rank of the default group must
    construct the Lockstep together (the generator's ranks form their own world)."""

    def __init__(self, group):
        self.group = group
        if dist.get_backend(group) != "gloo":
            self.group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")

    def agree(self, rows: int, decode_only: bool, waiting: bool = False) -> tuple[int, bool, bool]:
        """(the most rows of any rank's next step, whether every rank's next step is decode-only, whether
        any rank is `waiting`: an episode of its waits for its environment, so the group goes on
        stepping even when no rank has rows)."""
        t = torch.tensor([rows, int(not decode_only), int(waiting)], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]), not bool(t[1]), bool(t[2])

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank."""
        t = torch.tensor([int(flag)], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t[0])
