"""A multi-node Ray cluster on one machine: the head in the root network namespace on a bridge, each
worker node in a network namespace of its own joined to the bridge by a veth pair. A process in a
worker namespace has its own loopback, so a rendezvous at 127.0.0.1 fails across nodes as it does
across machines. Needs root (`ip netns`); everything made here is removed by close().

    with NetnsCluster(nodes=3) as c:      # head 0 CPUs: actors land on the worker nodes
        env = c.driver_env()               # RAY_ADDRESS + the cluster's auth token
        c.kill_raylet(1)                   # kill -9 of node 1's raylet

Each node is stopped through the `ray start --block` process this module started (SIGTERM) and then
its leftover children: Ray's own stop command would end every Ray cluster on the machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procs import cmdline, descendants

RAY = str(Path(sys.executable).parent / "ray")


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    name = f"rlprobe{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"ip netns add failed: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NetnsCluster:
    """A head (root namespace, `head_cpus` CPUs) and `nodes` worker nodes (`node_cpus` each), each in
    its own namespace with address SUBNET.(10 + i)."""

    def __init__(self, nodes: int = 3, node_cpus: int = 1, head_cpus: int = 0, dashboard: bool = False):
        tag = f"{os.getpid() % 100000}"
        self.subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"  # a /24 only this cluster carries
        self.bridge = f"rlbr{tag}"
        self.head_ip = f"{self.subnet}.1"
        self.namespaces = [f"rlns{tag}n{i}" for i in range(nodes)]
        self.node_ips = [f"{self.subnet}.{10 + i}" for i in range(nodes)]
        self.root = tempfile.mkdtemp(prefix="rlmn", dir="/tmp")  # short: Ray's socket paths must fit
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.port, self.dash = _free_port(), _free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self._made: list[tuple[str, str]] = []
        try:
            self._network()
            self._head(head_cpus, dashboard)  # a node started before the head's GCS answers times out
            for i in range(nodes):  # one at a time: on 2 cores concurrent starts time out registering
                self._node(i, node_cpus)
        except BaseException:
            self.close()
            raise

    # --- network ---------------------------------------------------------------------------------------
    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.node_ips)):
            host, peer = f"{self.bridge}h{i}", f"{self.bridge}p{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", host, "type", "veth", "peer", "name", peer)
            self._made.append(("link", host))
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", host, "master", self.bridge)
            _ip("link", "set", host, "up")
            _ip("addr", "add", f"{addr}/24", "dev", peer, ns=ns)
            _ip("link", "set", peer, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_TMPDIR"))}
        return {**env, "RAY_USAGE_STATS_ENABLED": "0", **self.auth, **extra}

    def driver_env(self, **extra) -> dict:
        return self.env(RAY_ADDRESS=f"{self.head_ip}:{self.port}", **extra)

    # --- Ray nodes -------------------------------------------------------------------------------------
    def _start(self, name: str, args: list[str], ns: str | None, hide: tuple[str, ...] = ()) -> subprocess.Popen:
        log_path = os.path.join(self.root, f"{name}.log")
        log = open(log_path, "w")
        self.logs.append(log)
        start = [RAY, "start", *args, "--disable-usage-stats", "--block"]
        if hide:  # the node's own (empty) view of these paths: a mount namespace with a tmpfs on each
            mounts = " && ".join(f"mount -t tmpfs rlhide {path}" for path in hide)
            start = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                     f"{mounts} && exec {' '.join(start)}"]
        cmd = (["ip", "netns", "exec", ns] if ns else []) + start
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        self.procs.append(p)
        t = time.monotonic()
        while "Ray runtime started" not in Path(log_path).read_text():
            if p.poll() is not None or time.monotonic() - t > 120:
                raise RuntimeError(f"Ray node {name} did not start:\n{self.log_tail()}")
            time.sleep(0.3)
        return p

    def _head(self, cpus: int, dashboard: bool) -> None:
        self._start("head", ["--head", f"--node-ip-address={self.head_ip}", f"--port={self.port}",
                             f"--num-cpus={cpus}", f"--temp-dir={os.path.join(self.root, 'ray')}",
                             f"--include-dashboard={str(dashboard).lower()}", f"--dashboard-host={self.head_ip}",
                             f"--dashboard-port={self.dash}", f"--dashboard-agent-listen-port={_free_port()}"], None)

    def _node(self, i: int, cpus: int, hide: tuple[str, ...] = ()) -> subprocess.Popen:
        return self._start(f"node{i}", [f"--address={self.head_ip}:{self.port}",
                                        f"--node-ip-address={self.node_ips[i]}", f"--num-cpus={cpus}"],
                           self.namespaces[i], hide)

    def restart_node(self, i: int, cpus: int = 1, hide: tuple[str, ...] = ()) -> None:
        """Stop node i (its `ray start` process and what it started), then start it again, seeing
        empty directories at the paths in `hide`."""
        self.stop_node(i)
        self.procs[1 + i] = self._node(i, cpus, hide)
        self.procs.pop()

    def stop_node(self, i: int) -> None:
        p = self.procs[1 + i]
        tree = descendants(p.pid)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def status(self) -> str:
        p = subprocess.run([RAY, "status", f"--address={self.head_ip}:{self.port}"], capture_output=True, text=True,
                           env=self.env(), timeout=60)
        return p.stdout + p.stderr

    def wait_nodes(self, n: int, timeout: float = 120.0) -> None:
        """Until `ray status` lists n active nodes."""
        t = time.monotonic()
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Ray node exited ({p.args}):\n{self.log_tail()}")
            out = self.status()
            active = out.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in out else ""
            if active.count("node_") >= n:
                return
            if time.monotonic() - t > timeout:
                raise RuntimeError(f"{n} nodes not up after {timeout:.0f} s:\n{out}\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {f.name}\n{Path(f).read_text()[-chars:]}" for f in sorted(Path(self.root).glob("*.log")))

    def raylet_pid(self, i: int) -> int:
        for pid in descendants(self.procs[1 + i].pid):
            if "raylet" in cmdline(pid).split(" ", 1)[0]:
                return pid
        raise RuntimeError(f"no raylet under node {i}'s ray start")

    def kill_raylet(self, i: int) -> None:
        os.kill(self.raylet_pid(i), signal.SIGKILL)

    # --- teardown --------------------------------------------------------------------------------------
    def close(self) -> None:
        trees = [(p, descendants(p.pid)) for p in self.procs]
        for p, _ in reversed(trees):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # --block: stops the processes it started
        for p, tree in reversed(trees):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for log in self.logs:
            log.close()
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
