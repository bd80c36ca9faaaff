"""Ray hosting: a group of worker actors that form one torch.distributed process group, meeting
at rank 0's node (its address from Ray, a port chosen there).

    placement = Placement.create(cfg, [("trainer", 2), ("generator", 1)])   # actors/placement.py
    trainers = ActorGroup("trainer", TrainerWorker, 2, cfg_dict, placement)
    losses = trainers.call("train_step", per_rank=[(shard0, alg), (shard1, alg)])

`call` waits on every rank; the first rank to fail kills the whole group and raises an error that
names the group, the rank and the actor's own error, so a crash never leaves the others hanging
in a collective. `call_together` does the same for calls of several groups that meet in one
collective (the weight sync's process group spans the trainer and the generator group).
"""

from __future__ import annotations

import os

import ray
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlalign.actors.placement import Placement
from rlalign.parallel.launch import host_store, init_group, use_interface


class ActorFailed(RuntimeError):
    pass


def hosted(worker_cls: type) -> type:
    """`worker_cls` (a rank of rlalign.workers) started in two phases, as a Ray actor: construct
    (nothing but the arguments), then rank 0 serves the group's rendezvous store on its own node
    (`rendezvous`), then every rank joins the group there and builds its worker (`start`)."""

    class Hosted(worker_cls):
        def __init__(self, cfg_dict: dict, rank: int, world: int, threads: int):
            self._args = (cfg_dict, rank, world, threads)
            self._group_store = None  # rank 0: serves the group as long as it lives

        def rendezvous(self) -> tuple[str, int]:
            """Rank 0: the group's store, served on this node; (this node's address, its port)."""
            host = ray.util.get_node_ip_address()
            self._group_store = host_store(host, float(self._args[0]["dist"]["timeout_s"]))
            return host, self._group_store.port

        def start(self, host: str, port: int) -> None:
            cfg_dict, rank, world, threads = self._args
            use_interface(ray.util.get_node_ip_address())
            device, timeout_s = str(cfg_dict["device"]), float(cfg_dict["dist"]["timeout_s"])
            init_group(device, rank, world, host, port, timeout_s, local_gpu=0)  # Ray: this actor's GPU is 0
            worker_cls.__init__(self, cfg_dict, rank, world, group=dist.group.WORLD if world > 1 else None,
                                threads=threads, local_gpu=0, own_process=True)

        def node(self) -> str:
            return ray.util.get_node_ip_address()

    Hosted.__name__ = Hosted.__qualname__ = worker_cls.__name__  # Ray names the actor's process after it
    return Hosted


class ActorGroup:
    """`world` ranks of a worker class, one Ray actor each, placed by `placement`'s slots for `name`;
    they form one torch.distributed group that meets at rank 0's node."""

    def __init__(self, name: str, worker_cls, world: int, cfg_dict: dict, placement: Placement, start: bool = True):
        """The ranks' actors (their processes start and import at once); `start`: also wait for `start()`."""
        self.name, self.world = name, world
        self.slots = placement.slots[name]
        remote_cls = ray.remote(hosted(worker_cls))
        fault = os.environ.get("RLALIGN_FAULT")  # fault injection (rlalign.faults): reaches actors on any cluster
        env = {"runtime_env": {"env_vars": {"RLALIGN_FAULT": fault}}} if fault else {}
        self.actors = []
        for rank, slot in enumerate(self.slots):
            strategy = PlacementGroupSchedulingStrategy(placement_group=placement.pg,
                                                        placement_group_bundle_index=slot.bundle)
            self.actors.append(remote_cls.options(scheduling_strategy=strategy, max_restarts=0, **slot.resources,
                                                  **env).remote(cfg_dict, rank, world, slot.threads))
        if start:
            start_groups([self])

    def call_rank0(self, method: str, *args) -> list:
        """method on rank 0 alone (errors as call's)."""
        return call_together([(self, method, [getattr(self.actors[0], method).remote(*args)])])[0]

    def submit(self, method: str, *args, per_rank: list[tuple] | None = None) -> list:
        """method on every rank (same args, or per_rank[r]), not waited for: pass to call_together."""
        return [getattr(a, method).remote(*(per_rank[r] if per_rank is not None else args))
                for r, a in enumerate(self.actors)]

    def call(self, method: str, *args, per_rank: list[tuple] | None = None) -> list:
        """method on every rank (same args, or per_rank[r]); results in rank order."""
        return call_together([(self, method, self.submit(method, *args, per_rank=per_rank))])[0]

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass


def start_groups(groups: list[ActorGroup]) -> None:
    """Each group's rendezvous (the store on its rank 0's node), then every rank of every group joins its group
    and builds its worker, the groups at once; a failure kills them all (call_together)."""
    addresses = call_together([(g, "rendezvous", [g.actors[0].rendezvous.remote()]) for g in groups])
    for g, (address,) in zip(groups, addresses):
        g.address = address
    call_together([(g, "start", g.submit("start", *g.address)) for g in groups])


def call_together(calls: list[tuple[ActorGroup, str, list]]) -> list[list]:
    """Wait for submitted calls of one or more groups (e.g. both sides of a collective that spans
    them); results per call in rank order. The first rank to fail kills every group involved (its
    peers would wait in the collective) and raises ActorFailed naming its group, rank and error."""
    index = {ref: (c, r) for c, (_, _, refs) in enumerate(calls) for r, ref in enumerate(refs)}
    pending, results = list(index), {}
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ref = done[0]
        try:
            results[index[ref]] = ray.get(ref)
        except (ray.exceptions.RayError, Exception) as e:
            errors = {index[ref]: e}
            # the peers of a dead rank fail too ("connection closed" in a collective), sometimes
            # before Ray reports the death: collect the others' outcome briefly, then blame the root
            late, _ = ray.wait(pending, num_returns=len(pending), timeout=3.0)
            for other in late:
                try:
                    ray.get(other)
                except (ray.exceptions.RayError, Exception) as e2:
                    errors[index[other]] = e2
            for group, _, _ in calls:
                group.kill()
            c, rank = _root_cause(errors)
            group, method, _ = calls[c]
            who = (lambda k: f"{calls[k][0].name} rank") if len(calls) > 1 else (lambda k: "rank")  # noqa: E731
            others = "; ".join(f"{who(k)} {r}: {clip(_actor_error(x), 160)}"
                               for (k, r), x in sorted(errors.items()) if (k, r) != (c, rank))
            raise ActorFailed(f"{group.name} rank {rank} of {group.world} (node {group.slots[rank].node.address}) "
                              f"failed in {method}(): "
                              f"{_actor_error(errors[(c, rank)])}" + (f" (then {others})" if others else "")) from None
    return [[results[(c, r)] for r in range(len(refs))] for c, (_, _, refs) in enumerate(calls)]


def _root_cause(errors: dict[tuple[int, int], BaseException]) -> tuple[int, int]:
    """(call, rank) of a process that died (RayActorError) before one whose task raised; else the lowest."""
    dead = [r for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)]
    return min(dead) if dead else min(errors)


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters at a word boundary, marked with '...' when cut."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 4]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + " ..."


def _actor_error(e: BaseException) -> str:
    """The actor's own exception, not Ray's wrapping of it."""
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__
