"""`rlalign train` on a multi-node Ray cluster: a head (0 CPUs) and three worker nodes of one CPU, each
in its own network namespace (tests/netns_cluster.py), so one node's 127.0.0.1 is not another's.
Trainer EP 2 spans two nodes, the generator sits on the third; the run, through RAY_ADDRESS and
through `ray job submit`, equals the same run on one machine in every metric but time and in its
final weights fingerprint, with 0 mismatched tokens. Twins: a loopback rendezvous fails in this
cluster; a node's raylet killed mid-run ends the run naming that node and rank, and the last
complete checkpoint survives; a node that does not share the run dir, cannot see a user's environment
or loss file that its ranks read, or cannot import rlalign, is named before any work; a layout the
cluster cannot hold is refused in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_cluster import NetnsCluster, netns_unavailable

pytestmark = pytest.mark.slow

WHY = netns_unavailable()
RUN = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=4", "trainer.ep_size=2",
       "generator.ep_size=1", "run.steps=2", "dist.timeout_s=30"]
CLI = [sys.executable, "-m", "rlalign.cli", "train"]


@pytest.fixture(scope="module")
def cluster():
    if WHY is not None:
        pytest.skip(f"no multi-node cluster on this machine: {WHY}")
    with NetnsCluster(nodes=3, node_cpus=1, head_cpus=0, dashboard=True) as c:
        yield c


def _train(run_dir: Path, *over: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *RUN, f"run.dir={run_dir}", *over], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The same run in this process, on its one-machine Ray cluster (tests/conftest.py: no cluster of
    its own to start and stop)."""
    from rlalign.config import load_config
    from rlalign.rl import train

    d = tmp_path_factory.mktemp("one_node")
    train(load_config([*RUN, f"run.dir={d}"]))
    return d


def _placement(stderr: str) -> dict[str, list[str]]:
    m = re.search(r"placement: trainer ranks on (\S+); generator ranks on (\S+);", stderr)
    assert m, stderr[-3000:]
    return {"trainer": m[1].split(","), "generator": m[2].split(",")}


def _assert_same_run(run_dir: Path, one_node: Path, stderr: str, cluster: NetnsCluster) -> None:
    where = _placement(stderr)
    assert len(set(where["trainer"])) == 2 and set(where["trainer"]) <= set(cluster.node_ips), where  # spans 2 nodes
    assert set(where["generator"]).isdisjoint(where["trainer"]), where  # the generator on a third node
    got, want = _metrics(run_dir), _metrics(one_node)
    assert got == want
    assert sum(r["consistency/mismatched_tokens"] for r in got) == 0 and got[-1]["consistency/tokens"] > 0


def test_multinode_train_through_ray_address_equals_one_node(cluster, one_node, tmp_path):
    p = _train(tmp_path, env=cluster.driver_env())
    assert p.returncode == 0, p.stderr[-3000:] + cluster.log_tail()
    _assert_same_run(tmp_path, one_node, p.stderr, cluster)
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["sync/weights_fp"] == json.loads((one_node / "metrics.jsonl").read_text().splitlines()[-1])[
        "sync/weights_fp"]


def test_multinode_train_through_ray_job_submit_equals_one_node(cluster, one_node, tmp_path):
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", f"--address=http://{cluster.head_ip}:{cluster.dash}",
           "--", *CLI, *RUN, f"run.dir={tmp_path}"]
    for _ in range(24):  # the head's job agent registers a little after `ray start` returns
        p = subprocess.run(cmd, capture_output=True, text=True, env=cluster.env(), timeout=400)
        if "No available agent" not in p.stdout + p.stderr:
            break
        time.sleep(5)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    _assert_same_run(tmp_path, one_node, p.stdout + p.stderr, cluster)


PROBE = """
import datetime, os, sys, ray, torch.distributed as dist
ray.init()
nodes = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))
pin = lambda ip: {"resources": {f"node:{ip}": 0.01}}
@ray.remote(num_cpus=0)
class Host:
    def serve(self, host):
        self.store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False)
        return self.store.port
@ray.remote(num_cpus=0)
def join(host, port):
    try:
        s = dist.TCPStore(host, port, None, is_master=False, timeout=datetime.timedelta(seconds=3))
        s.set("k", "v")
        return "joined"
    except Exception as e:
        return f"failed: {type(e).__name__}"
host = Host.options(**pin(nodes[0])).remote()
for addr in ("127.0.0.1", nodes[0]):
    port = ray.get(host.serve.remote(addr))
    print(addr, ray.get(join.options(**pin(nodes[1])).remote(addr, port)))
"""


def test_multinode_loopback_rendezvous_fails_node_address_joins(cluster):
    """The negative twin of every group's rendezvous: a store served on one node and met at 127.0.0.1
    from another fails there; met at the serving node's address it joins."""
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=cluster.driver_env(),
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = dict(ln.split(" ", 1) for ln in p.stdout.strip().splitlines())
    assert lines["127.0.0.1"].startswith("failed"), lines
    assert lines[cluster.node_ips[0]] == "joined", lines


PLACE = """
import ray
from omegaconf import OmegaConf
from rlalign.actors.placement import Placement, PlacementError
from rlalign.config import load_config
ray.init()
try:
    Placement.create(load_config(["device=cuda", "trainer.ep_size=2"]), [("trainer", 2), ("generator", 1)])
except PlacementError as e:
    print(e)
"""


def test_multinode_unplaceable_ep_size_is_refused_naming_each_node(cluster):
    p = subprocess.run([sys.executable, "-c", PLACE], capture_output=True, text=True, env=cluster.driver_env(),
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    line = p.stdout.strip()
    assert line.startswith("cannot place trainer.ep_size=2 + generator.ep_size=1 on this Ray cluster: it needs 3 GPUs")
    for ip in cluster.node_ips:
        assert f"{ip} (1 CPU, 0 GPU)" in line, line


def test_multinode_killed_raylet_names_node_and_rank_and_keeps_the_last_checkpoint(cluster, tmp_path):
    from rlalign import checkpoint as ckpt

    p = subprocess.Popen([*CLI, *RUN, f"run.dir={tmp_path}", "run.steps=200", "checkpoint.every=1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.driver_env())
    try:
        t = time.monotonic()
        while len(ckpt.list_complete(tmp_path)) < 2:
            assert p.poll() is None, p.stderr.read()[-3000:]
            assert time.monotonic() - t < 240
            time.sleep(0.3)
        victim = 2  # the third node: a trainer or the generator rank lives on each
        cluster.kill_raylet(victim)
        out, err = p.communicate(timeout=240)
    finally:
        p.kill()
    assert p.returncode not in (0, None)
    last = err.strip().splitlines()[-1]
    assert re.search(rf"(trainer|generator) rank \d of \d \(node {re.escape(cluster.node_ips[victim])}\)", last), last
    kept = ckpt.list_complete(tmp_path)
    assert kept and str(kept[-1]) in last, last
    ckpt.read_meta(kept[-1])  # complete and readable: a resume starts from it


def test_multinode_run_dir_not_shared_or_project_missing_is_named_before_work(cluster, tmp_path_factory):
    """Node 2 restarted (after the raylet test) with its own empty view of the run dir's parent, then
    of the project's package: the run stops before any actor, in one line naming the node."""
    shared = tmp_path_factory.mktemp("private_view")
    cluster.restart_node(2, hide=(str(shared),))
    p = _train(shared / "run", env=cluster.driver_env())
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert f"run.dir={shared / 'run'} is not shared storage: node {cluster.node_ips[2]} cannot read" in last, last
    assert last.endswith("(NFS, Lustre, a shared volume)"), last  # no resume command: a rerun meets the same refusal
    assert not (shared / "run" / "metrics.jsonl").exists()
    # the run dir shared, a user's environment (the generator's) and loss (the trainer's) in the hidden
    # directory: whichever group node 2 hosts, its file is named, before work
    (shared / "my_env.py").write_text("from rlalign.agent.envs import GuessEnv as MyEnv\n")
    (shared / "my_loss.py").write_text("from rlalign.training.losses import gspo_loss as loss\n")
    p = _train(tmp_path_factory.mktemp("env_hidden"), "task=guess", f"task.env={shared / 'my_env.py'}:MyEnv",
               "algorithm=gspo", f"algorithm.loss={shared / 'my_loss.py'}:loss", env=cluster.driver_env())
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and re.search(rf"(task\.env|algorithm\.loss)={re.escape(str(shared))}/my_(env|loss)"
                                           rf"\.py:\w+: node {re.escape(cluster.node_ips[2])} does not see "
                                           rf"{re.escape(str(shared))}/my_\w+\.py; put it on a file system", last), last

    import rlalign

    cluster.restart_node(2, hide=(str(Path(rlalign.__file__).parent),))
    p = _train(tmp_path_factory.mktemp("missing"), env=cluster.driver_env())
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and f"node {cluster.node_ips[2]} cannot run rlalign" in last, last
