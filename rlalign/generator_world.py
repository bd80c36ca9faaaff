"""The generator's world: which engine and how many generator ranks, decided in one place from the
config (at the config layer, so that the rollout factory, the driver, agree and the monitor's run
comparison all ask here)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class GeneratorWorld:
    backend: str  # "native" | "vllm"
    ranks: int  # generator ranks (actors, trace streams), each hosting one engine


def generator_world(cfg: DictConfig | dict) -> GeneratorWorld:
    """The engine and the number of generator ranks: native, generator.ep_size ranks; vLLM, one rank
    hosting the engine, which starts the generator.ep_size workers that own the experts. The one
    reader of `generator.backend` (tests/test_layers.py); `cfg` may also be a saved config's dict (a
    segment's, rlalign.rundir; one from before the key: native). Whether the engine can run is
    rlalign.rollout.generator.check_generator's question."""
    g = cfg["generator"]
    backend = g.get("backend") or "native"
    return GeneratorWorld(backend, 1 if backend == "vllm" else int(g["ep_size"]))
