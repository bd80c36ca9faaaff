"""The processes of an RL job: one trainer rank or one generator rank each. Plain classes (no Ray
import); actors/group.py hosts them in Ray actors, tests may construct them directly.

Each worker joins its own group's torch.distributed process group (gloo on CPU, NCCL on GPU):
the trainer group and the generator group are separate groups, possibly of different sizes.
Weights cross between them as an unsharded CPU state dict (through Ray's object store), each
side re-sharding for its own EP size; both sides fingerprint the full weights to verify.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from omegaconf import OmegaConf


def _init(cfg_dict: dict, rank: int, world: int, port: int, threads: int):
    from rlalign.factory import apply_kernels

    torch.set_num_threads(max(1, threads))
    cfg = OmegaConf.create(cfg_dict)
    backend = "gloo"
    if cfg.device.startswith("cuda"):
        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        cfg.device = "cuda:0"
        backend = "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.dist.timeout_s),
    )
    apply_kernels(cfg)
    return cfg, (dist.group.WORLD if world > 1 else None)


class TrainerWorker:
    def __init__(self, cfg_dict: dict, rank: int, world: int, port: int, threads: int = 1):
        from rlalign.training.trainer import Trainer

        self.cfg, self.group = _init(cfg_dict, rank, world, port, threads)
        self.rank, self.world = rank, world
        self.trainer = Trainer(self.cfg, self.group)

    def pid(self) -> int:
        return os.getpid()

    def train_step(self, samples: list[tuple], alg_dict: dict) -> tuple[list[list[float]], dict]:
        """samples: (prompt, response, generator_logprobs, advantage) of this rank's share."""
        from rlalign.faults import maybe_fail
        from rlalign.training.trainer import Sample

        maybe_fail("trainer.train_step", self.rank)
        ss = [Sample(p, r, torch.tensor(lp, dtype=torch.float32), a) for p, r, lp, a in samples]
        lps, stats = self.trainer.train_step(ss, OmegaConf.create(alg_dict))
        return [x.tolist() for x in lps], stats

    def full_state(self) -> tuple[dict | None, dict | None]:
        """All ranks take part; rank 0 returns (CPU state dict, its fingerprints)."""
        from rlalign.monitor.fingerprint import state_fingerprints

        full = self.trainer.full_state_dict()
        if self.rank != 0:
            return None, None
        cpu = {k: v.detach().cpu() for k, v in full.items()}
        return cpu, state_fingerprints(cpu)

    def grad_fingerprints(self) -> dict | None:
        from rlalign.monitor.fingerprint import state_fingerprints

        return state_fingerprints(self.trainer.grads) if getattr(self.trainer, "grads", None) else None

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.trainer.checkpoint_state(), checkpoint_id=path)

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        state = self.trainer.checkpoint_state()
        dcp.load(state, checkpoint_id=path)


class GeneratorWorker:
    def __init__(self, cfg_dict: dict, rank: int, world: int, port: int, threads: int = 1):
        from rlalign.factory import model_from_config
        from rlalign.parallel.ep import apply_ep

        self.cfg, self.group = _init(cfg_dict, rank, world, port, threads)
        self.rank, self.world = rank, world
        self.model = model_from_config(self.cfg)
        if self.group is not None:
            apply_ep(self.model, self.group)

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[list[int]], sample_ids: list[int], params: dict) -> list[tuple]:
        from rlalign.faults import maybe_fail
        from rlalign.generation import SamplingParams, generate
        from rlalign.parallel.launch import _any_live

        maybe_fail("generator.generate", self.rank)
        outs = generate(self.model, prompts, sample_ids, SamplingParams(**params),
                        any_live=_any_live(self.group) if self.group is not None else None)
        return [(o.sample_id, o.tokens, o.logprobs.tolist(), o.finish_reason) for o in outs]

    def load_weights(self, full: dict) -> dict | None:
        """Take this rank's shard of the unsharded state; then gather it back and return (rank 0)
        the fingerprints of what the generator group now holds."""
        from rlalign.monitor.fingerprint import state_fingerprints
        from rlalign.parallel.ep import full_state_dict, shard_state_dict

        local = shard_state_dict(full, self.rank, self.world)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n not in local:
                    raise KeyError(f"weight sync: the trainer's state has no tensor {n!r}")
                if tuple(local[n].shape) != tuple(p.shape):
                    raise ValueError(f"weight sync: {n!r} has shape {tuple(local[n].shape)}, generator expects "
                                     f"{tuple(p.shape)}")
                p.copy_(local[n].to(p.dtype))
        back = full_state_dict(self.model, self.group)
        return state_fingerprints({k: v.cpu() for k, v in back.items()}) if self.rank == 0 else None
