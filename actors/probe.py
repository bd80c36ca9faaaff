"""Checks of the nodes a job's ranks landed on, before any work: each node imports rlalign, the
run dir is one storage that every node and the driver reach (traces, checkpoints and metrics are
written by the ranks and read by the driver), and each node sees what the ranks read: model.path,
task.env's and algorithm.loss's file or module, task.tokenizer (for task.env's observations).

    inputs = rank_inputs(cfg)                     # {key: RankInput}: paths absolute against this directory
    check_nodes(run_dir, nodes, inputs)           # one line naming the first node that fails, else nothing

A node-pinned Ray task per node reads a token file the driver wrote under the run dir and writes
one back, and looks for each input; the driver reads those. Object storage (s3://...) is not a run dir.
A rank's working directory is its node's, not the driver's: the ranks get the inputs' absolute paths
(RankInput.shipped). A rank imports a module from its node's packages and PYTHONPATH and from the
driver's working directory, which Ray puts on every worker's sys.path: as its path reads on the node.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlalign.cluster import ClusterError

if TYPE_CHECKING:  # the probe task runs on every node before any rank: it imports no torch
    from rlalign.actors.placement import Node

PROBE_TIMEOUT_S = 120.0
RANK_MODULE = "rlalign.workers"  # what every trainer and generator rank imports


class NodeCheckError(ClusterError):
    pass


@dataclass(frozen=True)
class RankInput:
    """A file, directory or module the ranks read, named by its config key: `target` is the path
    (absolute) or the module's name, `shipped` the config value the ranks get, `groups` the actor
    groups whose ranks read it."""
    kind: str  # "path" | "module"
    target: str
    shipped: str
    groups: tuple[str, ...] = ("trainer", "generator")


def _spec_input(spec: str, group: str) -> RankInput | None:
    """'pkg.module:Name' (a module) or 'path/to/file.py:Name' (a file, made absolute), read by the ranks
    of `group`; None for a built-in's bare name."""
    mod, sep, attr = spec.rpartition(":")
    if not sep or not mod:
        return None
    if not mod.endswith(".py"):
        return RankInput("module", mod, spec, (group,))
    path = str(Path(mod).expanduser().resolve())
    return RankInput("path", path, f"{path}:{attr}", (group,))


def rank_inputs(cfg: Any) -> dict[str, RankInput]:
    """What the ranks read besides the run dir, by config key (module docstring)."""
    out: dict[str, RankInput | None] = {}
    if cfg.model.path:
        path = str(Path(cfg.model.path).expanduser().resolve())
        out["model.path"] = RankInput("path", path, path)
    if cfg.task.env:  # the generator ranks run the episodes and tokenize their observations
        out["task.env"] = _spec_input(cfg.task.env, "generator")
        if cfg.task.tokenizer and cfg.task.tokenizer != "char":
            path = str(Path(cfg.task.tokenizer).expanduser().resolve())
            out["task.tokenizer"] = RankInput("path", path, path, ("generator",))
    if cfg.algorithm.loss:
        out["algorithm.loss"] = _spec_input(cfg.algorithm.loss, "trainer")
    return {k: v for k, v in out.items() if v is not None}


def ship(cfg_dict: dict, inputs: dict[str, RankInput]) -> dict:
    """cfg_dict (the ranks' config) with each input's shipped value."""
    for key, inp in inputs.items():
        group, name = key.split(".")
        cfg_dict[group][name] = inp.shipped
    return cfg_dict


def _missing(inputs: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """On the node: the first input it does not see, as (key, why), else None."""
    from rlalign.tasks.reward_fn import module_found  # no torch
    for key, (kind, target) in inputs.items():
        if kind == "path" and not os.path.exists(target):
            return key, f"does not see {target}"
        if kind == "module" and not module_found(target):  # the rule the rank's import follows
            return key, f"has no module named {target.split('.')[0]!r}"
    return None


def _probe(probe_dir: str, token: str, address: str, inputs: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """On the node: None when the driver's token is there (and the answer written) and every input is
    seen, else (what, why): what is 'run.dir' or an input's key. ModuleNotFoundError when the node
    lacks the module its ranks run (found, not imported: no torch)."""
    if importlib.util.find_spec(RANK_MODULE) is None:
        raise ModuleNotFoundError(f"No module named {RANK_MODULE!r}")
    here = Path(probe_dir)
    try:
        seen = (here / "driver").read_text()
    except OSError as e:
        return "run.dir", f"cannot read the driver's probe file there ({e.strerror or e})"
    if seen != token:
        return "run.dir", "reads another run's probe file there"
    try:
        (here / f"node-{address}").write_text(token)
    except OSError as e:
        return "run.dir", f"cannot write there ({e.strerror or e})"
    return _missing(inputs)


def _refusal(what: str, why: str, run_dir: Path, inputs: dict[str, RankInput], address: str) -> NodeCheckError:
    if what == "run.dir":
        return NodeCheckError(f"run.dir={run_dir} is not shared storage: node {address} {why}; put run.dir on a "
                              "file system that every node and the driver mount at the same path (NFS, Lustre, a "
                              "shared volume)")
    inp = inputs[what]
    if inp.kind == "module":
        cwd = os.getcwd()  # Ray puts the driver's working directory on every rank's sys.path
        return NodeCheckError(f"{what}={inp.shipped}: node {address} {why} (a rank imports from its node's packages "
                              f"and PYTHONPATH and from the driver's working directory {cwd} as that node sees it); "
                              "install it on every node, or run from a directory that every node mounts at the same "
                              "path")
    return NodeCheckError(f"{what}={inp.shipped}: node {address} {why}; put it on a file system that every node "
                          "and the driver mount at the same path (NFS, Lustre, a shared volume)")


def _wanted(inputs: dict[str, RankInput], groups: set[str]) -> dict[str, tuple[str, str]]:
    """What a node hosting ranks of `groups` must see: {key: (kind, target)}."""
    return {k: (v.kind, v.target) for k, v in inputs.items() if groups & set(v.groups)}


def check_nodes(run_dir: Path, nodes: dict[Node, set[str]], inputs: dict[str, RankInput]) -> None:
    """Every node in `nodes` (each with the groups of the ranks it hosts) imports rlalign, shares `run_dir`
    with the driver and sees each input that those groups read; NodeCheckError (one line, naming the node
    and what it lacks) otherwise."""
    probe_dir = run_dir.resolve() / f".node-probe-{secrets.token_hex(4)}"
    probe_dir.mkdir(parents=True)
    token = secrets.token_hex(16)
    (probe_dir / "driver").write_text(token)
    try:
        task = ray.remote(num_cpus=0, max_retries=0)(_probe)
        order = sorted(nodes, key=lambda n: n.address)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
                .remote(str(probe_dir), token, n.address, _wanted(inputs, nodes[n])) for n in order]
        for node, ref in zip(order, refs):
            try:
                failed = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None) or e
                raise NodeCheckError(f"node {node.address} cannot run rlalign ({type(cause).__name__}: "
                                     f"{str(cause).strip().splitlines()[-1]}): install the project, the same "
                                     "version, on every node") from None
            if failed is None and not (probe_dir / f"node-{node.address}").exists():
                failed = "run.dir", "writes where the driver does not see it"
            if failed is not None:
                raise _refusal(*failed, run_dir, inputs, node.address)
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
