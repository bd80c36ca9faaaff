"""The processes of an RL job: one trainer rank or one generator rank each. Plain classes (no Ray
import): actors/group.py hosts them in Ray actors for `rlalign train`, rlalign/agree.py runs the
same classes on torch.multiprocessing ranks (or in-process at EP 1) for `rlalign agree` — one
generation path (GeneratorWorker.generate) and one scoring path (TrainerWorker.score /
train_step, both on Trainer's micro-batched score_micro_batch), whatever launches them.
Records crossing a process boundary are dataclasses (Rollout, Sample, TrainOutput), never tuples.

Each worker joins its own group's torch.distributed process group (gloo on CPU, NCCL on GPU):
the trainer group and the generator group are separate groups, possibly of different sizes.
Weights cross between them on the device (rlalign.parallel.weight_sync: a second process group of
trainer rank 0 + the generator ranks, bucketed broadcasts, CUDA IPC when colocated), resharded by
each generator rank, verified by fingerprints computed on the device on both sides.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rlalign import kernels
from rlalign.agent import EnvPool, make_driver
from rlalign.checkpoint import AsyncSaver, load_shards
from rlalign.config import shares_gpu
from rlalign.faults import maybe_fail
from rlalign.fingerprint import state_fingerprints
from rlalign.model.build import model_from_config
from rlalign.monitor.taps import attach_taps
from rlalign.monitor.trace import RowNames, Trace, fixed_environment
from rlalign.parallel import weight_sync
from rlalign.parallel.ep import apply_ep, full_state_dict
from rlalign.rollout.generator import make_generator
from rlalign.rollout.types import Continuations
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout, Sample
from rlalign.tasks import Example
from rlalign.tasks.tokenizer import make_tokenizer
from rlalign.training.trainer import Trainer


@dataclass
class GenerateOutput:
    rollouts: list[Rollout]  # this rank's, in input order; logprobs fp32 (the generator's)
    rows: dict = field(default_factory=dict)  # (sample id, position) -> per-op row fingerprints
    peak_bytes: int | None = None  # CUDA: this process's peak allocated memory during the call
    seconds: float = 0.0  # the engine's generate() inside the worker (the rest of the phase: transport, trace)
    held_bytes: int | None = None  # CUDA, released after the call: the device memory this process still holds
    monitor_s: float = 0.0  # the monitor's work in the call (records, their launch, the flush)
    env_wait_s: float = 0.0  # episodes: the engine's time waiting for environments (not overlapped with decoding)


@dataclass
class TrainOutput:
    logprobs: dict[int, torch.Tensor]  # step sample index -> the trainer's pre-update logprobs, fp32
    stats: list[tuple[tuple, dict]]  # ((epoch, minibatch, micro-batch), stats): merged in key order
    rows: dict = field(default_factory=dict)
    peak_bytes: int | None = None
    gc_s: float = 0.0  # this process's time in Python's cyclic garbage collector during the call
    seconds: float = 0.0  # Trainer.train_step inside the worker (the rest of the phase: transport, trace)
    sync: weight_sync.SyncOutput | None = None  # direct colocated sync: the trainer's side, taken after the update
    monitor_s: float = 0.0  # the monitor's work in the call (records, their launch, the flush, the wait colocated)
    checkpoint_wait_s: float = 0.0  # the wait, before the update, for the last save's write (a streamed save)


_GC = {"total_s": 0.0, "since": 0.0, "hooked": False}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["since"] = time.perf_counter()
    else:
        _GC["total_s"] += time.perf_counter() - _GC["since"]


def _gc_settle(own_process: bool) -> None:
    """Time the cyclic collector's pauses (TrainOutput.gc_s); in a process of its own (a Ray
    actor), also move every object alive now (modules, the model, optimizer state) out of the
    collector's reach: a full collection then scans only what was allocated since, not the whole
    heap (measured: 84 ms -> 0 for a trainer's imports on one CPU core)."""
    if not _GC["hooked"]:
        gc.callbacks.append(_gc_timer)
        _GC["hooked"] = True
    if own_process:
        gc.collect()
        gc.freeze()


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str, outside: int = 0) -> int | None:
    """torch's peak allocated bytes on this process's GPU since _reset_peak, plus `outside` (memory
    not from torch's allocator: a generator's arenas); None on the CPU."""
    return torch.cuda.max_memory_allocated() + outside if device.startswith("cuda") else None


class _WeightSync:
    """Either side's part of rlalign.parallel.weight_sync: the plan and the cross-group."""

    def _sync_model(self):
        raise NotImplementedError

    def prepare_weight_sync(self, bucket_bytes: int, host_world: int = 0,
                            host: str | None = None) -> tuple[list | None, int | None]:
        """The plan of this rank's model; (rank 0) its tensor specs for the driver to compare with the
        other side's, and with host_world > 0 (trainer rank 0) the port of the sync group's store,
        served here and reached at `host` (this node's address)."""
        self._plan = weight_sync.make_plan(weight_sync.tensor_specs(self._sync_model(), self.world), bucket_bytes)
        self._sync, self._kept, port = None, [], None
        self._sent_from, self._sources = None, None  # direct: the addresses handed out / the views opened
        if host_world and self.rank == 0:
            self._store = weight_sync.SyncGroup.host_store(host, host_world, self.cfg.dist.timeout_s)
            port = self._store.port
        return (self._plan.specs(), port) if self.rank == 0 else (None, None)

    def join_weight_sync(self, host: str, port: int, sync_rank: int, sync_world: int) -> None:
        """Join the trainer-rank-0 + generator-ranks process group (both sides at once; sync_rank -1:
        a trainer rank other than 0, which stays out)."""
        if sync_rank < 0:
            return
        backend = "nccl" if self.cfg.device.startswith("cuda") else "gloo"
        store = getattr(self, "_store", None) if sync_rank == 0 else None
        self._sync = weight_sync.SyncGroup(backend, host, port, sync_rank, sync_world,
                                           self.cfg.dist.timeout_s, store)


def record_train_step(tr: Trace, t: Trainer, lps: dict, moments: bool) -> None:
    """A trainer rank's records of one step: its logprobs, then gradients, AdamW moments (`moments`:
    at the steps monitor.optim_every picks) and weights, in one launch (Trace.record_many)."""
    tr.record("train.logprobs", torch.cat(list(lps.values())) if lps else torch.zeros(0))
    if t.invariant:  # names independent of the EP size: comparable across trainer EP sizes
        tr.record_many([(RowNames(f"state/{name}", first) if first is not None else f"state/{name}", x)
                        for name, x, first in t.topology_record_groups(moments)])
        return
    items: list = [(f"grad/{n}", t.grads[n]) for n in sorted(t.grads)]
    for n, m in t.master.items():
        st = t.opt.state.get(m, {}) if moments else {}
        items += [(f"optim/{n}/{key}", st[key]) for key in ("exp_avg", "exp_avg_sq") if key in st]
    params = dict(t.model.named_parameters())
    tr.record_many(items + [(f"weights/{n}", params[n]) for n in sorted(params)])


class _Monitored:
    """Trace stream + tap recorder (monitor.* config) + injected faults (rlalign.faults) of one worker."""

    role = "worker"

    def _setup_monitor(self, model) -> None:
        self.trace = None
        self.recorder = attach_taps(model, self.role)
        self.faults = self.recorder.faults

    def open_trace(self, start_step: int) -> None:


        level = self.cfg.monitor.fingerprints
        if level == "off":
            return
        path = Path(self.cfg.run.dir) / "traces" / f"{self.role}-rank{self.rank}.jsonl"
        self.trace = Trace(path, self.role, self.rank, fixed_environment(self.cfg), start_step)
        self.recorder.trace = self.trace
        self.recorder.rows = self.recorder.layers = level == "layers"

    def record_rows(self) -> None:
        """Every op's per-token row fingerprints from now on, without a trace (rlalign agree with
        monitor.fingerprints=layers): generate() returns them, pop_rows() hands over the trainer's."""
        self.recorder.rows = True

    def pop_rows(self) -> dict:
        """{(sample id, position): {op: row fingerprint}} recorded since the last call."""
        return self.recorder.pop_table()

    def close_trace(self) -> None:
        """Write the records still on their way back from the device and close the stream."""
        if self.trace is not None:
            self.trace.close()
            self.trace = self.recorder.trace = None


def _init(cfg_dict: dict, rank: int, world: int, threads: int, local_gpu: int | None):
    """Config and kernels of one rank that has joined its group (or runs alone): on CUDA this
    process computes on GPU `local_gpu` (under Ray: 0, the actor's CUDA_VISIBLE_DEVICES; a
    launcher's rank r: r)."""
    if threads:
        torch.set_num_threads(max(1, threads))
    cfg = OmegaConf.create(cfg_dict)
    if cfg.device.startswith("cuda") and local_gpu is not None:
        cfg.device = f"cuda:{local_gpu}"
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    return cfg


class TrainerWorker(_Monitored, _WeightSync):
    role = "trainer"

    def __init__(self, cfg_dict: dict, rank: int, world: int, group=None, threads: int = 0,
                 local_gpu: int | None = None, own_process: bool = False):
        """One trainer rank of `world` in `group` (its EP group; None alone). `own_process`: a process
        of its own (a Ray actor), whose live objects may be frozen out of the garbage collector."""
        self.cfg, self.group = _init(cfg_dict, rank, world, threads, local_gpu), group
        self.rank, self.world = rank, world
        self.trainer = Trainer(self.cfg, self.group)
        self._said: list[str] = []  # the saver's lines, handed to the driver with save()'s answer
        staging = self.cfg.checkpoint.staging if self.cfg.checkpoint.async_save else "sync"
        self.saver = AsyncSaver(staging, say=self._said.append)
        self._setup_monitor(self.trainer.model)
        self._own_process, self._steps = own_process, 0
        self._colocated = shares_gpu(self.cfg)  # each gives back what the other needs next
        _gc_settle(self._own_process)

    def pid(self) -> int:
        return os.getpid()

    def score(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The trainer's logprobs of this rank's samples, no update (`rlalign agree`)."""
        maybe_fail("trainer.score", self.rank)
        return self.trainer.score(samples)

    def train_step(self, samples: list[Sample], alg_dict: dict, step: int, leave_free: int = 0) -> TrainOutput:
        """One RL update; `samples` is the whole step (Trainer.train_step runs this rank's share).
        Returns this rank's pre-update logprobs, stat records and (monitor.fingerprints=layers)
        per-token row fingerprints. Colocated on CUDA: if the device then has less than `leave_free`
        bytes free (what the generator takes back for the weight sync and its next generate), this
        process's allocator gives its cached blocks back."""
        maybe_fail("trainer.train_step", self.rank)
        waited = self.saver.wait_tensors()  # a streamed checkpoint in flight reads the tensors this step changes
        gc0 = _GC["total_s"]
        if self.trace is not None:
            self.trace.step = step
            self.trace.fence()  # the step changes the tensors the last step's records read
        _reset_peak(self.cfg.device)
        t0 = time.perf_counter()
        lps, stats = self.trainer.train_step(samples, OmegaConf.create(alg_dict))
        seconds = time.perf_counter() - t0
        sync = self._send_direct(handles=False) if getattr(self, "_sent_from", None) is not None else None
        t1 = time.perf_counter()
        if self.trace is not None:
            record_train_step(self.trace, self.trainer, lps, step % self.cfg.monitor.optim_every == 0)
            self.trace.flush()  # the fingerprints run on the device; their records are written at a later flush
            if self._colocated:  # on a shared GPU they would hold up the weight sync: finished in this phase
                self.trace.fence()
                torch.cuda.current_stream().synchronize()
        monitor_s = time.perf_counter() - t1
        self._steps += 1
        if self._steps == 1:  # the optimizer state and the kernels' caches exist now
            _gc_settle(self._own_process)
        if self._colocated and torch.cuda.mem_get_info()[0] < leave_free:
            torch.cuda.empty_cache()  # the generator maps its weights and KV cache back for the weight sync
        return TrainOutput(lps, stats, self.recorder.pop_table(), _peak(self.cfg.device), _GC["total_s"] - gc0,
                           seconds, sync, monitor_s, waited)

    def full_state(self, fingerprints: bool = True) -> tuple[dict | None, dict | None]:
        """All ranks take part; rank 0 returns (CPU state dict, its host fingerprints or None)."""
        full = self.trainer.full_state_dict()
        if self.rank != 0:
            return None, None
        fps = state_fingerprints(full) if fingerprints else None  # on the device: the same values as of the copies
        return {k: v.detach().cpu() for k, v in full.items()}, fps

    def _sync_model(self):
        return self.trainer.model

    def send_weights(self, ipc: bool = False, direct: bool = False) -> weight_sync.SyncOutput:
        """All trainer ranks: the weights to the generator group (rlalign.parallel.weight_sync.send);
        with ipc (colocated on CUDA) rank 0 keeps the buckets until free_sync_buckets(); direct (colocated,
        one rank per side): nothing is packed, the generator reads the parameters (weight_sync.send_direct)."""
        if direct:
            return self._send_direct(handles=True)
        out, self._kept = weight_sync.send(self.trainer.model, self._plan, self.rank, self.world, self.group,
                                           self._sync, ipc)
        return out

    def _send_direct(self, handles: bool) -> weight_sync.SyncOutput | None:
        """weight_sync.send_direct: the parameters' IPC handles when `handles` and a parameter moved
        since they were last handed out (None without `handles`: then the driver asks send_weights)."""
        where = tuple(p.data_ptr() for p in self.trainer.model.parameters())
        if where != self._sent_from and not handles:
            return None
        out = weight_sync.send_direct(self.trainer.model, self._plan, handles=where != self._sent_from)
        self._sent_from = where
        return out

    def free_sync_buckets(self) -> None:
        self._kept = []
        if self._colocated:  # the sync's buckets: room for the generator's next generate
            torch.cuda.empty_cache()

    def save(self, path: str, publish: dict | None = None, wait: bool = True) -> tuple[float, list[str]]:
        """This rank's part of a checkpoint (safetensors shards + fingerprints; rlalign.checkpoint), staged
        into host memory or streamed, written in the background (wait=False: returns before the write; the
        next train_step waits for a streamed one); with `publish` rank 0 completes the checkpoint once all
        ranks have written. Returns the seconds spent staging and the lines the saver said (its choice)."""
        if self.trace is not None:  # the trace holds every record up to the checkpoint a resume starts from
            self.trace.drain()
        self.saver.save(self.trainer.checkpoint_state(), path, self.rank, self.group, publish,
                        self.cfg.checkpoint.bucket_mb << 20)
        if wait:
            self.saver.wait()
        said, self._said[:] = list(self._said), []
        return self.saver.staging_s, said

    def wait_checkpoint(self) -> None:
        """Wait for the checkpoint in flight; raises CheckpointError if it could not be written."""
        self.saver.wait()

    def load(self, path: str) -> None:
        """Verify the checkpoint (files, then every tensor's fingerprint), then load it in place;
        nothing from the checkpoint directory is unpickled."""
        if self.trace is not None:
            self.trace.fence()
        self.saver.wait()
        load_shards(self.trainer.checkpoint_state(), path, self.rank, self.group)


class GeneratorWorker(_Monitored, _WeightSync):
    role = "generator"

    def __init__(self, cfg_dict: dict, rank: int, world: int, group=None, threads: int = 0,
                 local_gpu: int | None = None, own_process: bool = False):
        """One generator rank of `world` in `group` (its EP group; None alone); as TrainerWorker."""
        self.cfg, self.group = _init(cfg_dict, rank, world, threads, local_gpu), group
        self.rank, self.world = rank, world
        maybe_fail("generator.start", rank)
        self.model = model_from_config(self.cfg)
        if self.group is not None:
            apply_ep(self.model, self.group)
        self._setup_monitor(self.model)
        self.generator = make_generator(self.cfg, self.model, self.group)  # self.model: the copy weight sync writes
        self._released = False
        t = self.cfg.task  # episodes (task.env): the driver tokenizes observations with the run's tokenizer
        self.tok = make_tokenizer(t.tokenizer, self.cfg.model.path, t.chat) if t.env else None
        self.env_pool = EnvPool(t.env_workers) if t.env else None  # its threads serve every step's episodes
        _gc_settle(own_process)

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams,
                 step: int = 0, release: bool = False, release_weights: bool = True,
                 examples: list[Example] | None = None, episodes: Continuations | None = None) -> GenerateOutput:
        """Rollouts of this rank's prompts and their per-token row fingerprints; with `examples` (task.env:
        each prompt's task row), episodes whose environments live in this process; with `episodes`,
        episodes that it continues (a replay's recorded ones: rlalign.agent.recorded).
        `release`: then the engine gives its device memory back (the KV cache; the weights too with
        `release_weights`) until the next weight sync."""
        maybe_fail("generator.generate", self.rank)
        if self.trace is not None:
            self.trace.step = step
        params = dataclasses.replace(params, seed=params.seed + self.faults.seed_offset)
        _reset_peak(self.cfg.device)
        t0 = time.perf_counter()
        driver = None
        if examples is not None:
            driver = make_driver(self.cfg, self.tok, examples, prompts, sample_ids, f"step {step}", self.env_pool)
            try:
                outs = driver.finish(self.generator.generate(prompts, sample_ids, params, episodes=driver))
            finally:
                driver.close()
        else:
            outs = self.generator.generate(prompts, sample_ids, params, episodes=episodes)
        t1 = time.perf_counter()
        seconds = t1 - t0
        if self.trace is not None:
            flat = [t for o in outs for t in o.tokens]
            self.trace.record("gen.tokens", torch.tensor(flat, dtype=torch.long))
            self.trace.record("gen.logprobs", torch.cat([o.logprobs for o in outs]) if outs else torch.zeros(0))
            self.trace.flush()
        peak = _peak(self.cfg.device, self.generator.resident_bytes())
        out = GenerateOutput(outs, self.recorder.pop_table(), peak, seconds, monitor_s=time.perf_counter() - t1,
                             env_wait_s=driver.wait_s if driver is not None else 0.0)
        if release:
            self.generator.release_memory(release_weights)
            self._released = True
            if self.cfg.device.startswith("cuda"):
                out.held_bytes = torch.cuda.memory_reserved() + self.generator.resident_bytes()
        return out

    def _sync_model(self):
        return self.model

    def receive_weights(self, step: int = -1, ipc: list | None = None, ipc_uuid: str | None = None,
                        direct: bool = False) -> weight_sync.SyncOutput:
        """All generator ranks: the trainer's weights, this rank's EP shard kept on the device
        (rlalign.parallel.weight_sync.receive); fingerprint shares of everything it now holds."""
        t0 = time.perf_counter()
        if self.trace is not None:
            self.trace.fence()  # the weights the last sync's records read are overwritten
        t1 = time.perf_counter()
        if self._released:
            self.generator.resume_memory()
            self._released = False
        resumed = time.perf_counter() - t1
        if direct:
            if ipc is not None:  # the trainer's parameters (first sync, or they moved)
                self._sources = weight_sync.open_direct(self.model, ipc, ipc_uuid)
            out = weight_sync.receive_direct(self.model, self._plan, self._sources)
        else:
            out = weight_sync.receive(self.model, self._plan, self.rank, self.world, self.group, self._sync, ipc,
                                      ipc_uuid)
        self.generator.load_weights()
        self._trace_weights(step, out.shares)
        out.resume_seconds, out.call_seconds = resumed, time.perf_counter() - t0
        return out

    def full_state(self) -> dict | None:
        """All ranks take part; rank 0 returns the unsharded weights it holds, on the CPU."""
        if self.generator.weights_stale():
            raise RuntimeError("the generator's weights were given back to the device after generating "
                               "(placement.colocate on CUDA) and not written since")
        full = full_state_dict(self.model, self.group)
        return {k: v.detach().cpu() for k, v in full.items()} if self.rank == 0 else None

    def _trace_weights(self, step: int, shares: list[int]) -> None:
        """The weights just synced into the trace: with one generator rank the sync's own fingerprints
        of them (`shares`: whole tensors; finalized on the host when the records are written, at the
        next flush: nothing of it in the sync), else each rank's tensors hashed again (its expert shards)."""
        if self.trace is None:
            return
        self.trace.step = step
        if self.world == 1:
            specs = self._plan.specs()

            def fps() -> list[str]:
                merged = weight_sync.merge(specs, [shares], "generator", dense_on_all=True)
                return [merged[n] for n in sorted(merged)]

            self.trace.record_known(sorted((f"weights/{name}", shape, getattr(torch, dtype.removeprefix("torch.")))
                                           for name, dtype, shape, _ in specs), fps)
            return  # written at the next flush (the next generate's): nothing left on the device
        self.trace.record_state("weights", dict(self.model.named_parameters()))
        self.trace.flush()
