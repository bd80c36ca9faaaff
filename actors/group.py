"""Ray hosting: a group of worker actors that form one torch.distributed process group.

    pg = Placement.create(cfg, [("trainer", 2), ("generator", 1)])
    trainers = ActorGroup("trainer", TrainerWorker, 2, cfg_dict, pg)
    losses = trainers.call("train_step", per_rank=[(shard0, alg), (shard1, alg)])

`call` waits on every rank; the first rank to fail kills the whole group and raises an error that
names the group, the rank and the actor's own error, so a crash never leaves the others hanging
in a collective. `call_together` does the same for calls of several groups that meet in one
collective (the weight sync's process group spans the trainer and the generator group).
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlalign.parallel.launch import host_store


class ActorFailed(RuntimeError):
    pass


class Placement:
    """One placement group for all actors of a job. CPU: fractional CPUs so the trainer and the
    generator fit on a laptop. GPU: a bundle per GPU; colocated groups share the bundles (0.5 GPU
    each) and so take turns on the same devices."""

    def __init__(self, pg: PlacementGroup, slots: dict[str, list[tuple[int, dict]]]):
        self.pg, self.slots = pg, slots

    @classmethod
    def create(cls, device: str, groups: list[tuple[str, int]], colocate: bool = False,
               num_cpus: float | None = None) -> Placement:
        total_cpus = float(num_cpus or ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        n_actors = sum(n for _, n in groups)
        slots: dict[str, list[tuple[int, dict]]] = {}
        bundles: list[dict] = []
        if device.startswith("cuda"):
            if colocate:
                width = max(n for _, n in groups)
                bundles = [{"GPU": 1, "CPU": 1} for _ in range(width)]
                for name, n in groups:
                    slots[name] = [(i, {"num_gpus": 0.5, "num_cpus": 0.5}) for i in range(n)]
            else:
                for name, n in groups:
                    slots[name] = [(len(bundles) + i, {"num_gpus": 1, "num_cpus": 1}) for i in range(n)]
                    bundles += [{"GPU": 1, "CPU": 1} for _ in range(n)]
        else:
            share = min(1.0, total_cpus / n_actors)
            for name, n in groups:
                slots[name] = [(len(bundles) + i, {"num_cpus": share}) for i in range(n)]
                bundles += [{"CPU": share} for _ in range(n)]
        pg = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=60)
        if not ready:
            remove_placement_group(pg)
            raise RuntimeError(f"cannot place {n_actors} actors ({bundles}) on this Ray cluster: "
                               f"{ray.cluster_resources()}")
        return cls(pg, slots)

    def remove(self) -> None:
        remove_placement_group(self.pg)


class ActorGroup:
    def __init__(self, name: str, worker_cls, world: int, cfg_dict: dict, placement: Placement, threads: int = 1):
        self.name, self.world = name, world
        self.store = host_store(float(cfg_dict["dist"]["timeout_s"]))  # the group's rendezvous, job-long
        port = self.store.port
        remote_cls = ray.remote(worker_cls)
        fault = os.environ.get("RLALIGN_FAULT")  # fault injection (rlalign.faults): reaches actors on any cluster
        env = {"runtime_env": {"env_vars": {"RLALIGN_FAULT": fault}}} if fault else {}
        self.actors = []
        for rank, (bundle, slot) in enumerate(placement.slots[name]):
            strategy = PlacementGroupSchedulingStrategy(placement_group=placement.pg,
                                                        placement_group_bundle_index=bundle)
            self.actors.append(
                remote_cls.options(scheduling_strategy=strategy, max_restarts=0, **slot, **env).remote(
                    cfg_dict, rank, world, port, threads
                )
            )

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
            raise ActorFailed(f"{group.name} rank {rank} of {group.world} failed in {method}(): "
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
