"""The Generator protocol both engines implement, and the one factory that picks the engine (by
rlalign.generator_world, the one reader of `generator.backend`)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Protocol

from omegaconf import DictConfig

from rlalign.config import ConfigError, EngineConfig, keys_of, model_args, shares_gpu
from rlalign.generator_world import GeneratorWorld, generator_world
from rlalign.model import Transformer
from rlalign.parallel.launch import Lockstep
from rlalign.rollout.native.engine import NativeEngine
from rlalign.rollout.types import Continuations
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout


class Generator(Protocol):
    """A generator rank's engine over the rank's model (the copy weight sync writes)."""

    def generate(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams,
                 episodes: Continuations | None = None) -> list[Rollout]:
        """Rollouts of `prompts` in input order, with the generator's fp32 logprobs. `episodes`: each
        request is a multi-turn episode that `episodes` continues (the native engine only)."""

    def load_weights(self) -> None:
        """Compute with the rank model's current weights from now on."""

    def release_memory(self, weights: bool = True) -> None:
        """Give the engine's device memory back between steps (the KV cache, and with `weights` the
        weights, which a weight sync then writes before the next generate)."""

    def resume_memory(self) -> None:
        """Take the released memory back (before the weight sync writes the weights)."""

    def close(self) -> None:
        """Free everything the engine holds."""

    def resident_bytes(self) -> int:
        """Device memory the engine holds outside torch's allocator, resident now (0: none)."""

    def weights_stale(self) -> bool:
        """Whether the weights were given back since they were last written (then nothing may read them)."""


# the native engine's schedule keys (EngineConfig) and what to set instead under generator.backend=vllm
VLLM_INSTEAD = {
    "generator.max_num_seqs": "set generator.vllm.max_num_seqs",
    "generator.max_num_batched_tokens": "set generator.vllm.max_num_batched_tokens",
    "generator.page_size": "set generator.vllm.block_size",
    "generator.num_pages": "set generator.vllm.kv_cache_memory_bytes (or generator.vllm.gpu_memory_utilization)",
    "generator.cuda_graphs": "vLLM runs rlalign's model eagerly (generator.vllm.enforce_eager=true)",
    "generator.keep_state": "vLLM keeps its KV cache between calls",
    "generator.lookahead": "vLLM schedules its own steps",
}


def native_keys_set(g: DictConfig) -> list[str]:
    """'generator.KEY=VALUE' for each native-engine schedule key that differs from its default."""
    default = EngineConfig()
    return [f"generator.{f.name}={json.dumps(g[f.name])}" for f in fields(EngineConfig)
            if g[f.name] != getattr(default, f.name)]


def check_generator(cfg: DictConfig) -> GeneratorWorld:
    """The generator's world (rlalign.generator_world), once its engine is known to run here:
    errors (vLLM missing, an unsupported layout) come before any process starts."""
    world, g = generator_world(cfg), cfg.generator
    if world.backend == "native":
        return world
    if cfg.task.env:
        raise ConfigError(f"invalid config: task.env={cfg.task.env} with generator.backend=vllm: multi-turn episodes "
                          "run on the native engine only (it continues each episode on its KV pages); use "
                          "generator.backend=native")
    if shares_gpu(cfg):
        raise ConfigError("invalid config: generator.backend=vllm with placement.colocate=true on CUDA: a colocated "
                          "generator gives its GPU memory back while the trainer trains, which only the native engine "
                          "does (vLLM's sleep mode is not wired in); use generator.backend=native or "
                          "placement.colocate=false")
    native = native_keys_set(g)
    if native:
        raise ConfigError(f"invalid config: {native[0]} with generator.backend=vllm: a key of the native engine's "
                          f"schedule, which vLLM does not read; "
                          f"{VLLM_INSTEAD.get(native[0].split('=')[0], 'leave it at its default')}")
    from rlalign.rollout.vllm import check_installed, refuse_shapes

    try:
        check_installed()
        refuse_shapes(model_args(cfg), g.ep_size, bool(g.vllm.stock))
    except (ImportError, ValueError) as e:
        raise ConfigError(f"invalid config: {e}") from None
    if g.ep_size > 1 and str(cfg.device).startswith("cuda"):
        raise ConfigError(f"invalid config: generator.backend=vllm with generator.ep_size={g.ep_size} on CUDA: the "
                          "one generator rank would need that many GPUs for its vLLM workers; not supported yet "
                          "(CPU: any size)")
    return world


def make_generator(cfg: DictConfig, model: Transformer, group=None) -> Generator:
    """The generator rank's engine over `model`; `group`: the generator group (expert parallelism)."""
    if check_generator(cfg).backend == "vllm":
        if group is not None:
            raise ValueError("generator.backend=vllm: one generator rank hosts the vLLM engine (vLLM starts the "
                             f"generator.ep_size workers that own the experts), but this group has {group.size()}")
        from rlalign.rollout.vllm.engine import VllmRankGenerator

        return VllmRankGenerator(cfg, model)
    return NativeEngine(model, keys_of(EngineConfig, cfg.generator), Lockstep(group) if group is not None else None,
                        releasable=releases_memory(cfg) and shares_gpu(cfg))


def releases_memory(cfg: DictConfig) -> bool:
    """Whether the generator gives its memory back while the trainer trains (Generator.release_memory
    after each generate, resume_memory before the weight sync): when the two are colocated. On CUDA
    the native engine then keeps its weights and KV cache in DeviceArenas, so that the memory goes
    back to the device and the captured graphs stay valid; on the CPU it frees its KV cache. (vLLM keeps
    its memory: refused colocated on CUDA by check_generator.)"""
    return bool(cfg.placement.colocate) and generator_world(cfg).backend == "native"
