"""Checks of the nodes a job's ranks landed on, before any work: each node imports rlalign, and the
run dir is one storage that every node and the driver reach (traces, checkpoints and metrics are
written by the ranks and read by the driver).

    check_shared_dir(run_dir, nodes)   # one line naming the first node that fails, else nothing

A node-pinned Ray task per node reads a token file the driver wrote under the run dir and writes
one back; the driver reads those. Object storage (s3://...) is not a run dir.
"""

from __future__ import annotations

import importlib.util
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlalign.cluster import ClusterError

if TYPE_CHECKING:  # the probe task runs on every node before any rank: it imports no torch
    from rlalign.actors.placement import Node

PROBE_TIMEOUT_S = 120.0
RANK_MODULE = "rlalign.workers"  # what every trainer and generator rank imports


class NodeCheckError(ClusterError):
    pass


def _probe(probe_dir: str, token: str, address: str) -> str | None:
    """On the node: None when the driver's token is there (and the answer written), else why not;
    ModuleNotFoundError when the node lacks the module its ranks run (found, not imported: no torch)."""
    if importlib.util.find_spec(RANK_MODULE) is None:
        raise ModuleNotFoundError(f"No module named {RANK_MODULE!r}")
    here = Path(probe_dir)
    try:
        seen = (here / "driver").read_text()
    except OSError as e:
        return f"cannot read the driver's probe file there ({e.strerror or e})"
    if seen != token:
        return "reads another run's probe file there"
    try:
        (here / f"node-{address}").write_text(token)
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    return None


def check_shared_dir(run_dir: Path, nodes: set[Node]) -> None:
    """Every node in `nodes` imports rlalign and shares `run_dir` with the driver; NodeCheckError
    (one line, naming the node) otherwise."""
    probe_dir = run_dir.resolve() / f".node-probe-{secrets.token_hex(4)}"
    probe_dir.mkdir(parents=True)
    token = secrets.token_hex(16)
    (probe_dir / "driver").write_text(token)
    try:
        task = ray.remote(num_cpus=0, max_retries=0)(_probe)
        nodes = sorted(nodes, key=lambda n: n.address)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                .remote(str(probe_dir), token, n.address) for n in nodes]
        for node, ref in zip(nodes, refs):
            try:
                why = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e
                raise NodeCheckError(f"node {node.address} cannot run rlalign ({type(cause).__name__}: "
                                     f"{str(cause).strip().splitlines()[-1]}): install the project, the same "
                                     "version, on every node") from None
            if why is None and not (probe_dir / f"node-{node.address}").exists():
                why = "writes where the driver does not see it"
            if why is not None:
                raise NodeCheckError(f"run.dir={run_dir} is not shared storage: node {node.address} {why}; put "
                                     "run.dir on a file system that every node and the driver mount at the same "
                                     "path (NFS, Lustre, a shared volume)")
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
