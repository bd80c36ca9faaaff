"""Where a job's ranks run, decided once from what the Ray cluster has (never from the driver's own
machine): one placement group over the cluster's nodes, and from it the four answers everything
else reads —

    placement = Placement.create(cfg, [("trainer", n), ("generator", m)])
    placement.slots["trainer"][r]    # bundle, actor resources, node (id, address, CPUs), threads
    placement.colocated              # trainer and generator take turns on the same GPUs
    placement.transport              # the weight sync: "ipc" (one node's GPU) or "broadcast"

GPU: a bundle of 1 GPU + 1 CPU per rank (colocated: the two groups share the bundles, 0.5 GPU each);
Ray packs them onto as few nodes as hold them, so one group may span nodes. CPU: a fractional CPU
per rank. A layout the cluster cannot hold is refused before anything starts, in one line that
names what it needs and what each node has.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ray
from omegaconf import DictConfig
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rlalign.cluster import ClusterError
from rlalign.config import shares_gpu

READY_TIMEOUT_S = 60.0  # resources the cluster has but other jobs hold: wait this long, then refuse


class PlacementError(ClusterError):
    pass


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str  # the node's IP address in the cluster (its ranks' rendezvous address)
    cpus: float
    gpus: float

    def describe(self) -> str:
        return f"{self.address} ({self.cpus:g} CPU, {self.gpus:g} GPU)"


@dataclass(frozen=True)
class Slot:
    """One rank's place: its bundle, the resources its actor takes from it, its node, its threads."""

    bundle: int
    resources: dict
    node: Node
    threads: int


def cluster_nodes() -> list[Node]:
    """The cluster's live nodes, as Ray reports them."""
    return [Node(n["NodeID"], n["NodeManagerAddress"], float(n["Resources"].get("CPU", 0)),
                 float(n["Resources"].get("GPU", 0))) for n in ray.nodes() if n.get("Alive")]


def _fits(bundles: list[dict], nodes: list[Node]) -> bool:
    """Whether first-fit (largest bundle first) puts every bundle on some node."""
    free = [{"CPU": n.cpus, "GPU": n.gpus} for n in nodes]
    for b in sorted(bundles, key=lambda b: (-b.get("GPU", 0), -b.get("CPU", 0))):
        spot = next((f for f in free if all(f[k] >= v - 1e-9 for k, v in b.items())), None)
        if spot is None:
            return False
        for k, v in b.items():
            spot[k] -= v
    return True


def _what(groups: list[tuple[str, int]]) -> str:
    return " + ".join(f"{name}.ep_size={n}" for name, n in groups)


class Placement:
    def __init__(self, pg: PlacementGroup, slots: dict[str, list[Slot]], colocated: bool, transport: str):
        self.pg, self.slots, self.colocated, self.transport = pg, slots, colocated, transport

    @classmethod
    def create(cls, cfg: DictConfig, groups: list[tuple[str, int]]) -> Placement:
        """Reserve the job's bundles (refused in one line when the cluster cannot hold them) and
        read where each landed."""
        nodes = cluster_nodes()
        colocated = shares_gpu(cfg)
        bundles, slots = _bundles(str(cfg.device), groups, colocated, [n.cpus for n in nodes])
        if not _fits(bundles, nodes):
            gpus = sum(b.get("GPU", 0) for b in bundles)
            need = (f"{gpus:g} GPUs, one per rank{' (the two groups share them)' if colocated else ''}, with 1 CPU each"
                    if gpus else f"{len(bundles)} ranks of {bundles[0]['CPU']:g} CPU")
            raise PlacementError(f"cannot place {_what(groups)} on this Ray cluster: it needs {need}; its nodes: "
                                 + "; ".join(n.describe() for n in nodes))
        pg = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            remove_placement_group(pg)
            raise PlacementError(f"cannot place {_what(groups)} on this Ray cluster within {READY_TIMEOUT_S:g} s: "
                                 f"its nodes have the resources ({'; '.join(n.describe() for n in nodes)}) but "
                                 f"other jobs hold them (ray status shows which)")
        where = placement_group_table(pg)["bundles_to_node_id"]
        by_id = {n.node_id: n for n in nodes}
        placed = {name: [(b, res, by_id[where[b]]) for b, res in s] for name, s in slots.items()}
        per_node = Counter(node.node_id for s in placed.values() for _, _, node in s)  # ranks on each node
        final = {name: [Slot(b, res, node, max(1, int(node.cpus) // per_node[node.node_id])) for b, res, node in s]
                 for name, s in placed.items()}
        return cls(pg, final, colocated, _transport(final, colocated, groups))

    def describe(self) -> str:
        """'placement: trainer ranks on A,B; generator ranks on C; weight sync: broadcast' (node
        addresses in rank order)."""
        where = "; ".join(f"{name} ranks on {','.join(s.node.address for s in slots)}"
                          for name, slots in self.slots.items())
        return f"placement: {where}; weight sync: {self.transport}"

    def remove(self) -> None:
        remove_placement_group(self.pg)


def _cpu_share(node_cpus: list[float], ranks: int) -> float:
    """The largest CPU share per rank, at most 1, at which `ranks` ranks fit the nodes' CPUs (1 when
    nothing does: the refusal then names the nodes)."""
    fits = [c / k for c in node_cpus if c > 0 for k in range(1, ranks + 1)
            if c / k <= 1 and sum(int(x * k / c + 1e-9) for x in node_cpus) >= ranks]
    return max(fits, default=1.0)


def _bundles(device: str, groups: list[tuple[str, int]], colocated: bool,
             node_cpus: list[float]) -> tuple[list[dict], dict[str, list[tuple[int, dict]]]]:
    """The placement group's bundles and each group's (bundle index, actor resources) per rank."""
    slots: dict[str, list[tuple[int, dict]]] = {}
    bundles: list[dict] = []
    if device.startswith("cuda"):
        if colocated:
            bundles = [{"GPU": 1, "CPU": 1} for _ in range(max(n for _, n in groups))]
            for name, n in groups:
                slots[name] = [(i, {"num_gpus": 0.5, "num_cpus": 0.5}) for i in range(n)]
            return bundles, slots
        for name, n in groups:
            slots[name] = [(len(bundles) + i, {"num_gpus": 1, "num_cpus": 1}) for i in range(n)]
            bundles += [{"GPU": 1, "CPU": 1} for _ in range(n)]
        return bundles, slots
    share = _cpu_share(node_cpus, sum(n for _, n in groups))
    for name, n in groups:
        slots[name] = [(len(bundles) + i, {"num_cpus": share}) for i in range(n)]
        bundles += [{"CPU": share} for _ in range(n)]
    return bundles, slots


def _transport(slots: dict[str, list[Slot]], colocated: bool, groups: list[tuple[str, int]]) -> str:
    """CUDA IPC when the groups share GPUs (NCCL refuses two ranks of one group on one GPU); then every
    generator rank must sit on trainer rank 0's node, which hands out the handles. Else a broadcast
    through a process group of trainer rank 0 + the generator ranks (NCCL on GPU, gloo on CPU)."""
    if not colocated:
        return "broadcast"
    home = slots["trainer"][0].node
    away = sorted({s.node.address for s in slots["generator"] if s.node.node_id != home.node_id})
    if away:
        raise PlacementError(f"{_what(groups)} with placement.colocate=true spans nodes: generator ranks on "
                             f"{', '.join(away)} cannot open CUDA IPC handles of trainer rank 0 on {home.address}; "
                             "use placement.colocate=false, or sizes that one node's GPUs hold")
    return "ipc"
