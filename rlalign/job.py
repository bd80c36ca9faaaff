"""The driver's view of a run's actor groups on the Ray cluster: each phase of a step is one call that
returns its values; nothing passes between phases through the Job's fields.

    job = Job(cfg)                                   # placement, checks of the nodes, the two groups
    gen = job.generate(batch, step)                  # GenerateResult: rollouts, rows, metrics, need_bytes
    out = job.train(batch, rollouts, adv, step, gen.need_bytes)   # TrainResult
    res = job.sync_weights(step, out.direct_sync)    # SyncResult: weights fingerprint, metrics
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from rlalign.generator_world import generator_world
from rlalign.parallel.launch import shard_range
from rlalign.parallel.weight_sync import SyncOutput
from rlalign.rollout.generator import releases_memory
from rlalign.sequences import Rollout, Sample
from rlalign.training.losses import merge_stat
from rlalign.workers import GeneratorWorker, TrainerWorker

# a shared GPU: what the generator takes back beyond its measured peak (the allocator's rounding)
ALLOCATOR_SLACK_BYTES = 2 << 30


@dataclass
class GenerateResult:
    rollouts: list[Rollout]  # in sample order
    rows: dict  # (sample id, position) -> per-op row fingerprints
    metrics: dict[str, float] = field(default_factory=dict)  # the slowest rank's seconds; GiB
    need_bytes: int = 0  # a shared GPU: what the generator takes back after the trainer's step


@dataclass
class TrainResult:
    logprobs: list[torch.Tensor]  # the trainer's pre-update logprobs, in sample order
    stats: dict[str, float]  # merged in (epoch, minibatch, micro-batch) order: independent of the rank count
    rows: dict
    metrics: dict[str, float] = field(default_factory=dict)
    direct_sync: SyncOutput | None = None  # colocated, one rank per side: the sync's trainer half, taken already


def _max_peak_gib(outs) -> float | None:
    """The largest of a group's per-rank peak allocated GPU memory, GiB (None on the CPU)."""
    peaks = [o.peak_bytes for o in outs if o.peak_bytes is not None]
    return max(peaks) / 2**30 if peaks else None


class Job:
    def __init__(self, cfg: DictConfig, phase: Callable[[str], None] = lambda what: None):
        """Ray, the placement and the two groups; `phase` hears each start-up phase as it begins. One that
        fails gives back what it took (the groups, the placement, a private cluster) before it raises."""
        import ray

        from rlalign import cluster

        self.cfg = cfg
        self.trainers = self.generators = self.placement = None
        addr = cluster.address()
        if not ray.is_initialized():
            phase(f"attaching to the Ray cluster at {addr}" if addr else "starting Ray (a private local cluster)")
        self.own_ray = cluster.connect(cfg.placement.num_cpus)  # RAY_ADDRESS's cluster, else a private one
        try:
            self._start(cfg, addr, phase)
        except BaseException:
            with contextlib.suppress(Exception):  # the start-up's error is the one to raise, not a release's
                self._release()
            raise

    def _start(self, cfg: DictConfig, addr: str | None, phase: Callable[[str], None]) -> None:
        from rlalign.actors.group import ActorGroup, start_groups
        from rlalign.actors.placement import Placement
        from rlalign.actors.probe import check_nodes, rank_inputs, ship
        from rlalign.actors.weight_sync import WeightSync

        n, m = cfg.trainer.ep_size, generator_world(cfg).ranks
        self.placement = Placement.create(cfg, [("trainer", n), ("generator", m)])  # from the cluster's nodes
        # where each rank landed: on a cluster it attached to, or when the ranks span nodes
        if addr or len({s.node.node_id for g in self.placement.slots.values() for s in g}) > 1:
            print(f"rlalign train: {self.placement.describe()}", file=sys.stderr, flush=True)
        inputs = rank_inputs(cfg)  # absolute paths: the ranks' working directory is not ours
        hosts: dict = {}  # node -> the groups of the ranks it hosts
        for group, slots in self.placement.slots.items():
            for slot in slots:
                hosts.setdefault(slot.node, set()).add(group)
        check_nodes(Path(cfg.run.dir), hosts, inputs)
        cfg_dict = ship(OmegaConf.to_container(cfg, resolve=True), inputs)
        cfg_dict["run"]["dir"] = str(Path(cfg.run.dir).resolve())
        self.algorithm = cfg_dict["algorithm"]  # each train_step's, as the ranks read it (algorithm.loss shipped)
        # both groups' processes start (and import) at once; their models are built one group after the other
        # where they share GPUs (placement.colocate: the peaks of two builds would add), else at once too
        self.trainers = ActorGroup("trainer", TrainerWorker, n, cfg_dict, self.placement, start=False)
        self.generators = ActorGroup("generator", GeneratorWorker, m, cfg_dict, self.placement, start=False)
        phase(f"starting {n} trainer rank{'s' if n > 1 else ''} (EP {n}), each building its model shard")
        if cfg.placement.colocate:
            start_groups([self.trainers])
        phase(f"starting {m} generator rank{'s' if m > 1 else ''} (EP {m}, {generator_world(cfg).backend} engine)")
        start_groups([self.generators] if cfg.placement.colocate else [self.trainers, self.generators])
        self.weight_sync = WeightSync(self.trainers, self.generators, self.placement, cfg.sync.bucket_mb << 20)
        # colocated the generator gives its memory back after generating (until the weight sync); its
        # weights too unless a mismatch dump may read them (deterministic kernels, on_mismatch=raise)
        self.generator_releases = releases_memory(cfg)
        self.generator_releases_weights = not (cfg.kernels.mode == "deterministic"
                                               and cfg.monitor.on_mismatch == "raise")
        # the step whose update the trainer group was last asked for: until then it holds the state of the
        # step before (a stop signal during a step's generation may checkpoint that state at once, rl.py)
        self.trainer_step: int | None = None

    def open_traces(self, start_step: int) -> None:
        self.trainers.call("open_trace", start_step)
        self.generators.call("open_trace", start_step)

    def generate(self, prompts: list[list[int]], sample_ids: list[int], params, step: int,
                 examples: list | None = None) -> GenerateResult:
        """The generator group's rollouts in sample order (each rank a contiguous share); `examples`
        (task.env): each prompt's task row, whose episode's environment lives on the prompt's rank."""
        m = self.generators.world
        parts = [list(shard_range(len(prompts), m, r)) for r in range(m)]
        outs = self.generators.call("generate", per_rank=[
            ([prompts[i] for i in p], [sample_ids[i] for i in p], params, step, self.generator_releases,
             self.generator_releases_weights, [examples[i] for i in p] if examples is not None else None)
            for p in parts])
        metrics = {"time/generate_engine_s": max(o.seconds for o in outs),
                   "time/generate_monitor_s": max(o.monitor_s for o in outs)}
        if examples is not None:
            metrics["time/env_wait_s"] = max(o.env_wait_s for o in outs)
        peak = _max_peak_gib(outs)
        if peak is not None:
            metrics["memory/generator_peak_gib"] = peak
        held = [o.held_bytes for o in outs if o.held_bytes is not None]
        if held:  # what the generator still holds while the trainer trains
            metrics["memory/generator_released_gib"] = max(held) / 2**30
        need = 0
        if self.generator_releases and outs[0].peak_bytes is not None:
            need = max(o.peak_bytes for o in outs) + ALLOCATOR_SLACK_BYTES
        return GenerateResult([r for o in outs for r in o.rollouts], {k: v for o in outs for k, v in o.rows.items()},
                              metrics, need)

    def train(self, samples: list[Sample], step: int, leave_free: int = 0) -> TrainResult:
        """One update of the trainer group on the whole step (each rank runs its share of the fixed
        micro-batch partition); `leave_free`: bytes a shared GPU keeps for the generator."""
        self.trainer_step = step
        outs = self.trainers.call("train_step", samples, self.algorithm, step, leave_free)
        lps = {i: lp for o in outs for i, lp in o.logprobs.items()}
        stats: dict[str, float] = {}
        for _, st in sorted((rec for o in outs for rec in o.stats), key=lambda rec: rec[0]):
            for k, v in st.items():
                stats[k] = v if k.endswith("_last") else merge_stat(k, stats.get(k), v)
        metrics = {"time/train_trainer_s": max(o.seconds for o in outs),
                   "time/train_monitor_s": max(o.monitor_s for o in outs),
                   "time/trainer_gc_s": max((o.gc_s for o in outs), default=0.0),
                   "time/checkpoint_stall_s": max(o.checkpoint_wait_s for o in outs)}
        peak = _max_peak_gib(outs)
        if peak is not None:
            metrics["memory/trainer_peak_gib"] = peak
        rows = {k: v for o in outs for k, v in o.rows.items()}
        return TrainResult([lps[i] for i in range(len(samples))], stats, rows, metrics,
                           outs[0].sync if len(outs) == 1 else None)

    def sync_weights(self, step: int, direct_sync: SyncOutput | None = None):
        """The trainer's weights into the generator group, checked by fingerprints (SyncResult)."""
        return self.weight_sync.run(step, direct_sync)

    def save_checkpoint(self, path: str, publish: dict, wait: bool) -> tuple[float, list[str]]:
        """Every trainer rank writes its part (in the background unless `wait`); rank 0 publishes. Returns
        the ranks' longest staging copy (seconds) and the lines their savers said."""
        outs = self.trainers.call("save", path, publish, wait)
        return max(o[0] for o in outs), [line for o in outs for line in o[1]]

    def wait_checkpoint(self) -> None:
        """Until the checkpoint in flight is complete (CheckpointError if it could not be written)."""
        self.trainers.call("wait_checkpoint")

    def load_checkpoint(self, path: str) -> None:
        self.trainers.call("load", path)

    def generator_state(self) -> dict:
        """The generator's unsharded weights, on the CPU (what a mismatch dump saves)."""
        return self.generators.call("full_state")[0]

    def close_traces(self, timeout_s: float | None = None) -> None:
        """Every worker writes the trace records still on their way back from its device and closes
        its stream. timeout_s (best effort, before the actors are killed after a failure): a worker
        that died or does not answer in time is left; its stream ends where its process did."""
        import ray

        groups = [g for g in (getattr(self, "trainers", None), getattr(self, "generators", None)) if g is not None]
        if timeout_s is None:
            for g in groups:
                g.call("close_trace")
            return
        refs = [ref for g in groups for ref in g.submit("close_trace")]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:  # the run is failing already; this error is not its cause
                pass

    def close(self, trace_timeout_s: float = 30.0) -> None:
        self.close_traces(timeout_s=trace_timeout_s)
        self._release()

    def _release(self) -> None:
        """The groups killed, the placement removed, a private cluster stopped."""
        from rlalign import cluster

        for g in (self.trainers, self.generators):
            if g is not None:
                g.kill()
        if self.placement is not None:
            self.placement.remove()
        cluster.disconnect(self.own_ray)
