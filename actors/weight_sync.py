"""The driver's half of the weight sync: it opens the channel once and runs each sync; the ranks do
the moving through rlalign.parallel.weight_sync (send / receive, both sides' fingerprints).

    sync = WeightSync(trainers, generators, placement, bucket_bytes)
    result = sync.run(step)                    # SyncResult: combined fingerprint + metrics

The transport is the placement's answer: "broadcast" (a process group of trainer rank 0 + every
generator rank, meeting at trainer rank 0's node: NCCL on GPU, gloo on CPU) or "ipc" (colocated on
one node's GPUs: CUDA IPC handles through Ray; with one rank per side the generator copies straight
from the trainer's parameters, whose fingerprints the trainer took right after its update).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlalign.actors.group import ActorGroup, call_together
from rlalign.actors.placement import Placement
from rlalign.parallel import weight_sync


@dataclass
class SyncResult:
    weights_fp: str  # the fingerprint of every weight the generator now holds (both sides agreed on it)
    metrics: dict[str, float] = field(default_factory=dict)  # sync/bytes, sync/buckets, time/sync_*_s


class WeightSync:
    def __init__(self, trainers: ActorGroup, generators: ActorGroup, placement: Placement, bucket_bytes: int):
        self.trainers, self.generators = trainers, generators
        self.ipc = placement.transport == "ipc"
        self.direct = self.ipc and trainers.world == 1 and generators.world == 1
        self.host = placement.slots["trainer"][0].node.address  # the sync group meets at trainer rank 0's node
        self.bucket_bytes = bucket_bytes
        self.specs = None  # the synced tensors, once the channel is open

    def open(self) -> None:
        """Plans on both sides (compared), then the trainer-rank-0 + generator-ranks process group
        (not with IPC)."""
        n, m = self.trainers.world, self.generators.world
        (t_specs, port), *_ = self.trainers.call("prepare_weight_sync", self.bucket_bytes, 0 if self.ipc else 1 + m,
                                                 self.host)
        (g_specs, _), *_ = self.generators.call("prepare_weight_sync", self.bucket_bytes)
        weight_sync.check_specs(t_specs, g_specs)
        if not self.ipc:
            call_together([
                (self.trainers, "join_weight_sync", self.trainers.submit(
                    "join_weight_sync", per_rank=[(self.host, port, 0 if r == 0 else -1, 1 + m) for r in range(n)])),
                (self.generators, "join_weight_sync", self.generators.submit(
                    "join_weight_sync", per_rank=[(self.host, port, 1 + g, 1 + m) for g in range(m)])),
            ])
        self.specs = t_specs

    def run(self, step: int, trainer_side: weight_sync.SyncOutput | None = None) -> SyncResult:
        """The trainer's weights into the generator group; both sides' fingerprints compared (SyncError
        names the first tensor that differs). `trainer_side`: the direct sync's trainer half, when the
        trainer's step already took it (TrainOutput.sync)."""
        if self.specs is None:
            self.open()
        if self.ipc:
            t_outs = ([trainer_side] if self.direct and trainer_side is not None
                      else self.trainers.call("send_weights", True, self.direct))
            g_outs = self.generators.call("receive_weights", step, t_outs[0].ipc, t_outs[0].device_uuid, self.direct)
            if not self.direct:
                self.trainers.call("free_sync_buckets")
        else:
            t_outs, g_outs = call_together([(self.trainers, "send_weights", self.trainers.submit("send_weights")),
                                            (self.generators, "receive_weights",
                                             self.generators.submit("receive_weights", step))])
        fps = weight_sync.merge(self.specs, [o.shares for o in t_outs], "trainer", dense_on_all=False)
        gen = weight_sync.merge(self.specs, [o.shares for o in g_outs], "generator", dense_on_all=True)
        metrics = {"sync/bytes": t_outs[0].bytes, "sync/buckets": t_outs[0].buckets,
                   "time/sync_trainer_s": max(o.seconds for o in t_outs),
                   "time/sync_generator_s": max(o.seconds for o in g_outs),
                   "time/sync_resume_s": max(o.resume_seconds for o in g_outs),
                   "time/sync_generator_call_s": max(o.call_seconds for o in g_outs)}
        return SyncResult(weight_sync.check(fps, gen), metrics)
