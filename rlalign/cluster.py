"""The Ray cluster a driver runs on: an existing one it attaches to, or a private one it owns.

    initialized = connect(cfg.placement.num_cpus)   # before the first actor
    ...
    disconnect(initialized)

Attach when RAY_ADDRESS names a cluster: set by the user (`RAY_ADDRESS=host:6379 rlalign train`),
or by `ray job submit`, which runs the command as a job driver with RAY_ADDRESS set to the
cluster's GCS address. An attached driver passes no resource arguments (Ray refuses them on an
existing cluster): the cluster's own CPUs and GPUs are used, and the cluster keeps running after;
the job's actors die with the driver (Ray ends a job when its driver exits).

Otherwise start a private single-node cluster (ray.init(address="local")): it ignores any other
cluster on the machine and the session file (/tmp/ray/ray_current_cluster) that `ray start` or a
dead cluster left behind. Nothing of it outlives the driver, even on `kill -9`. Ray alone does not
quite get there: it starts the GCS, raylet and its helpers with PR_SET_PDEATHSIG and the workers
exit with the raylet, but the raylet's two agents (dashboard and runtime-env, ~200 MB) first try to
report the raylet's death to the dead GCS and linger ~60 s. So connect() also starts a watchdog: a
small process in its own session (a Ctrl-C in the terminal does not reach it) that notes the
driver's descendants every second and reads a pipe from the driver; when the pipe closes without
the driver's "done" (the driver died), it ends the descendants it noted (SIGTERM, then SIGKILL).

ray.init() installs a SIGTERM handler in the driver (sys.exit(15)); connect() keeps it from being installed
and holds a SIGTERM that comes during ray.init() until it returns, so that a scheduler's SIGTERM reaches
rlalign's own handler (rlalign.stop) or, without one, ends the process as SIGTERM does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

_WATCHDOG = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
driver, seen = int(sys.argv[1]), {}
def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[1]), rest[19]  # ppid, start time
    except (OSError, IndexError, ValueError):
        return None
while True:  # every second: remember the driver's descendants, until the pipe closes
    if select.select([0], [], [], 1.0)[0]:
        msg = os.read(0, 16)
        if msg == b"done":
            sys.exit(0)
        if not msg:
            break
    children = {}
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid() and (s := stat(p)):
            children.setdefault(s[0], []).append((int(p), s[1]))
    todo = [driver]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            seen[pid] = start
            todo.append(pid)
for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
    end = time.monotonic() + grace
    while time.monotonic() < end:
        left = [pid for pid, start in seen.items() if (s := stat(pid)) and s[1] == start]
        if not left:
            sys.exit(0)
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(0.2)
"""

_watchdog: subprocess.Popen | None = None


class ClusterError(RuntimeError):
    """The Ray cluster cannot host the run as asked (attaching, placement, the nodes' checks): refused
    before any rank started, so its error line names no checkpoint to resume from."""


def address() -> str | None:
    """The cluster to attach to (RAY_ADDRESS), or None for a private one."""
    addr = os.environ.get("RAY_ADDRESS", "").strip()
    if not addr or addr == "local":
        return None
    if addr.startswith(("http://", "https://")):
        raise ClusterError(
            f"RAY_ADDRESS={addr} is a dashboard (Jobs API) address, which a driver cannot attach to; "
            f"submit the run with `ray job submit --address {addr} -- rlalign train ...`, or set RAY_ADDRESS "
            "to the cluster's GCS address (host:port, as `ray start --head` prints it), or unset it for a "
            "private local cluster")
    host, sep, port = addr.removeprefix("ray://").rpartition(":")
    if addr != "auto" and not (sep and host and port.isdigit()):
        raise ClusterError(f"RAY_ADDRESS={addr} is not HOST:PORT: set it to the cluster's GCS address as `ray start "
                           "--head` prints it (e.g. 10.0.0.1:6379), or unset it for a private local cluster")
    return addr


def _probe(addr: str, timeout: float = 5.0) -> None:
    """Fail fast (Ray itself retries for minutes) when nothing listens at RAY_ADDRESS's host:port."""
    import socket

    if addr == "auto":
        return  # Ray finds the cluster this machine's `ray start` joined
    host, _, port = addr.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ClusterError(f"RAY_ADDRESS={addr}: no Ray cluster answers there ({e.strerror or e}); start one "
                           f"(ray start --head --port {port}) or unset RAY_ADDRESS for a private local "
                           "cluster") from None


def connect(num_cpus: float | None = None, num_gpus: int | None = None) -> bool:
    """Make this process a Ray driver; True when this call initialized Ray (the caller then calls
    disconnect). num_cpus/num_gpus size a private cluster only (None: the machine's)."""
    import ray

    if ray.is_initialized():
        return False
    addr = address()
    common = dict(log_to_driver=True, configure_logging=False)
    if addr is not None:
        _probe(addr)
        try:
            with _own_sigterm():
                ray.init(address=addr, **common)
        except ConnectionError as e:
            hint = ("; if the cluster uses token authentication, set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN, "
                    "or the token in ~/.ray/auth_token)" if os.environ.get("RAY_AUTH_MODE") != "token" else
                    "; a token the cluster does not accept fails so too: RAY_AUTH_TOKEN (or ~/.ray/auth_token) must "
                    "be the cluster's")
            raise ClusterError(f"cannot attach to the Ray cluster at RAY_ADDRESS={addr}: {e}{hint}") from None
        return True
    _start_watchdog()
    try:
        with _own_sigterm():
            ray.init(address="local", num_cpus=max(1, int(num_cpus or os.cpu_count() or 1)), num_gpus=num_gpus,
                     include_dashboard=False, **common)
    except BaseException:
        disconnect(True)
        raise
    return True


@contextmanager
def _own_sigterm():
    """ray.init() with the process's own SIGTERM handling: Ray's handler (sys.exit(15) wherever the main
    thread is, which ends the run with exit 15 and no line, or is swallowed inside Ray and the run goes on)
    is not installed; a SIGTERM meanwhile is held and, once the block ends, raised again for the handler
    the process had (rlalign.stop's, or the default: the process ends as SIGTERM ends it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import ray._private.utils as ray_utils

    kept, held = signal.getsignal(signal.SIGTERM), []
    real = getattr(ray_utils, "set_sigterm_handler", None)  # private: a Ray without it installs none here
    signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
    if real is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if real is not None:
            ray_utils.set_sigterm_handler = real
        signal.signal(signal.SIGTERM, kept if kept is not None else signal.SIG_DFL)
        if held:
            signal.raise_signal(signal.SIGTERM)


def disconnect(initialized: bool) -> None:
    """Undo connect: a private cluster stops, an attached one keeps running (this driver leaves it)."""
    import ray

    if not initialized:
        return
    try:
        if ray.is_initialized():
            ray.shutdown()
    finally:
        _stop_watchdog()


def _start_watchdog() -> None:
    global _watchdog
    if not sys.platform.startswith("linux"):
        return
    _watchdog = subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid())],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True, close_fds=True)


def _stop_watchdog() -> None:
    """The cluster stopped normally: the watchdog leaves without ending anything."""
    global _watchdog
    w, _watchdog = _watchdog, None
    if w is None:
        return
    try:
        w.stdin.write(b"done")
        w.stdin.close()
        w.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        w.kill()
        w.wait()
