"""Which Ray cluster `rlalign train` runs on: RAY_ADDRESS's (also under `ray job submit`), else a
private one that ignores other clusters and stale session files and dies with the driver.

The clusters these tests start are stopped by their own `ray start --block` process (SIGTERM), not by
`ray stop`, which would stop every Ray cluster on the machine, other test sessions' included. Each test
points Ray's default temp dir (RAY_TMPDIR) at its own directory, so a session file it leaves there
(/tmp/ray/ray_current_cluster in real life) concerns nobody else.
"""

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

import pytest
from procs import alive, cmdline, descendants

from rlalign import cluster

SMALL = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=4",
         "trainer.ep_size=1"]  # two actors: which cluster a run joins does not depend on the EP size
RAY = str(Path(sys.executable).parent / "ray")
TRAP = "When connecting to an existing cluster, num_cpus and num_gpus must not be provided"


# --- fast: RAY_ADDRESS parsing ------------------------------------------------------------------------
def test_address_from_the_environment(monkeypatch):
    for value, expected in [("", None), ("local", None), ("  ", None), ("10.0.0.5:6379", "10.0.0.5:6379"),
                            ("auto", "auto"), ("ray://head:10001", "ray://head:10001")]:
        monkeypatch.setenv("RAY_ADDRESS", value)
        assert cluster.address() == expected, value
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster.address() is None
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(cluster.ClusterError, match=r"dashboard \(Jobs API\) address.*ray job submit --address"):
        cluster.address()
    for value in ("10.0.0.5", "head:port", "ray://head", ":6379"):  # no port: Ray's own line names no variable
        monkeypatch.setenv("RAY_ADDRESS", value)
        with pytest.raises(cluster.ClusterError, match=f"RAY_ADDRESS={value} is not HOST:PORT"):
            cluster.address()


def test_nothing_listening_at_ray_address_fails_fast():
    port = _free_port()  # a refused TCP connect answers at once (Ray's own retries took > 200 s)
    with pytest.raises(cluster.ClusterError, match=f"RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster answers there"):
        cluster._probe(f"127.0.0.1:{port}")
    with socket.socket() as s:  # twin: something listens
        s.bind(("127.0.0.1", 0))
        s.listen()
        cluster._probe(f"127.0.0.1:{s.getsockname()[1]}")


# --- helpers ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_TMPDIR"))}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", **extra}


def _train(run_dir, *over, env, timeout=300):
    p = subprocess.Popen([sys.executable, "-m", "rlalign.cli", "train", *SMALL, f"run.dir={run_dir}", *over],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out, err = p.communicate(timeout=timeout)
    return p.pid, p.returncode, out, err


class Head:
    """`ray start --head --block` with its own temp dir, ports and auth token; stop() ends it."""

    def __init__(self, num_cpus=2, dashboard=False):
        self.root = tempfile.mkdtemp(prefix="rlc", dir="/tmp")  # short: Ray's socket paths must fit
        self.temp = os.path.join(self.root, "ray")  # Ray's default temp dir when RAY_TMPDIR=root
        self.port, self.dash, agent = _free_port(), _free_port(), _free_port()
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        args = [RAY, "start", "--head", f"--num-cpus={num_cpus}", f"--port={self.port}", f"--temp-dir={self.temp}",
                f"--include-dashboard={str(dashboard).lower()}", f"--dashboard-port={self.dash}",
                "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent}", "--disable-usage-stats",
                "--block"]
        self.log = open(os.path.join(self.root, "head.log"), "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=_env(**self.auth),
                                     start_new_session=True)
        self.address = f"127.0.0.1:{self.port}"
        t = time.monotonic()
        while not os.path.exists(os.path.join(self.temp, "ray_current_cluster")):
            assert self.proc.poll() is None, Path(self.root, "head.log").read_text()[-3000:]
            assert time.monotonic() - t < 120, "ray start --head did not come up"
            time.sleep(0.5)
        self.session = Path(os.path.realpath(os.path.join(self.temp, "session_latest")))

    def status(self) -> subprocess.CompletedProcess:
        return subprocess.run([RAY, "status", f"--address={self.address}"], capture_output=True, text=True,
                              env=_env(**self.auth), timeout=60)

    def drivers(self) -> set[str]:
        return {p.name for p in (self.session / "logs").glob("python-core-driver-*.log")}

    def stop(self) -> None:
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # --block: stops the processes it started
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in alive(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head(num_cpus=2, dashboard=True)
    try:
        yield h
    finally:
        h.stop()


# --- slow: real clusters ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_address_attaches_with_the_clusters_own_resources_and_leaves_it_running(head, tmp_path):
    before = head.drivers()
    # placement.num_cpus=8 sizes a private cluster only: on this 2-CPU cluster 3 actors of 1 CPU would not fit
    pid, rc, out, err = _train(tmp_path, "run.steps=1", "trainer.ep_size=2", "placement.num_cpus=8",
                               env=_env(RAY_ADDRESS=head.address, **head.auth))
    assert rc == 0, err[-3000:]
    assert [ln for ln in head.drivers() - before if ln.endswith(f"_{pid}.log")], "the driver was not on this cluster"
    t = time.monotonic()
    while True:  # the cluster is up, and the job's actors leave it (its status lags a few seconds)
        assert head.proc.poll() is None
        st = head.status()
        assert st.returncode == 0, st.stdout + st.stderr
        if "0.0/2.0 CPU" in st.stdout or time.monotonic() - t > 30:
            break
        time.sleep(2)
    assert "0.0/2.0 CPU" in st.stdout, st.stdout


# a driver as `rlalign train` starts one (rl.Job: cluster.connect(placement.num_cpus), None by default),
# with one task on the cluster it got, then the end of the run's disconnect
PRIVATE = """
import ray
from rlalign import cluster
initialized = cluster.connect(None)
assert initialized and ray.get(ray.remote(lambda: 7).remote()) == 7
cluster.disconnect(initialized)
"""


def _private_driver(env) -> tuple[int, int, str]:
    p = subprocess.Popen([sys.executable, "-c", PRIVATE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    out, err = p.communicate(timeout=120)
    return p.pid, p.returncode, err


@pytest.mark.slow
def test_private_run_ignores_a_running_cluster_found_through_the_session_file(head):
    env = _env(RAY_TMPDIR=head.root)  # Ray's default lookup now finds head's ray_current_cluster
    p = subprocess.run([sys.executable, "-c", "import ray; ray.init(num_cpus=1, include_dashboard=False)"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0 and TRAP in p.stderr  # twin: the trap is live for a plain ray.init(num_cpus=...)
    before = head.drivers()
    pid, rc, err = _private_driver(env)
    assert rc == 0, err[-3000:]
    assert not [ln for ln in head.drivers() - before if ln.endswith(f"_{pid}.log")]  # not on head's cluster
    assert head.status().returncode == 0


@pytest.mark.slow
def test_ray_job_submit_runs_train_on_that_cluster(head, tmp_path):
    cmd = [RAY, "job", "submit", f"--address=http://127.0.0.1:{head.dash}", "--",
           sys.executable, "-m", "rlalign.cli", "train", *SMALL, "run.steps=1", f"run.dir={tmp_path}"]
    for _ in range(12):  # the head's job agent registers a little after `ray start` returns
        p = subprocess.run(cmd, capture_output=True, text=True, env=_env(**head.auth), timeout=400)
        if "No available agent" not in p.stdout + p.stderr:
            break
        time.sleep(5)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "succeeded" in p.stdout + p.stderr and '"steps": 1' in p.stdout
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert head.status().returncode == 0


@pytest.mark.slow
def test_private_run_ignores_a_stale_session_file():
    root = tempfile.mkdtemp(prefix="rls", dir="/tmp")
    try:
        os.makedirs(os.path.join(root, "ray"))
        Path(root, "ray", "ray_current_cluster").write_text(f"127.0.0.1:{_free_port()}")  # a dead cluster's
        env = _env(RAY_TMPDIR=root)
        p = subprocess.run([sys.executable, "-c", "import ray; ray.init(num_cpus=1, include_dashboard=False)"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode != 0 and TRAP in p.stderr  # twin: what the file does to a plain ray.init
        pid, rc, err = _private_driver(env)
        assert rc == 0, err[-3000:]
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_kill_9_of_the_driver_leaves_no_ray_process(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "rlalign.cli", "train", *SMALL, "run.steps=500", f"run.dir={tmp_path}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    try:
        t = time.monotonic()
        while not (tmp_path / "metrics.jsonl").exists():  # actors up, a step done
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() - t < 240
            time.sleep(0.5)
        time.sleep(1.5)  # the watchdog notes descendants once a second
        tree = descendants(p.pid)
        names = " ".join(cmdline(c) for c in tree)
        assert "raylet" in names and "ray::DashboardAgent" in names and "ray::TrainerWorker" in names, names
    finally:
        p.kill()
        p.wait()
    t = time.monotonic()
    while alive(tree) and time.monotonic() - t < 20:  # Ray alone leaves its agents ~60 s
        time.sleep(0.5)
    assert not alive(tree), [(c, cmdline(c)[:80]) for c in alive(tree)]


DRIVER = """
import sys, time
import ray
from rlalign import cluster
if sys.argv[1] == "off":
    cluster._start_watchdog = lambda: None
cluster.connect(1)
ray.get(ray.remote(lambda: 0).remote())
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_kill_9_twin_without_the_watchdog_ray_leaves_its_agents(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", DRIVER, "off"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, env=_env())
    try:
        assert p.stdout.readline().strip() == "ready"
        tree = descendants(p.pid)
    finally:
        p.kill()
        p.wait()
    try:
        time.sleep(10)
        left = " ".join(cmdline(c) for c in alive(tree))
        assert "ray::DashboardAgent" in left or "ray::RuntimeEnvAgent" in left, left
    finally:
        for pid in alive(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
