"""Config -> runtime objects: the kernel mode, the model, the sampling parameters (the native
engine's settings: rlalign.rollout.generator). Shared by every entry point."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from rlalign import kernels
from rlalign.config import SamplingConfig, keys_of, model_args
from rlalign.model import Transformer, build_model, load_hf
from rlalign.rollout.types import SamplingParams


def apply_kernels(cfg: DictConfig) -> None:
    kernels.set_mode(cfg.kernels.mode, cfg.kernels.backend)
    if cfg.kernels.mode == "deterministic" and cfg.device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)  # embedding/index_add backward w/o atomics
        # ... without its NaN fill of every torch.empty (~4,300 fill launches in a training step on the
        # H200): the kernels write every element they return, and the monitor compares bits anyway
        torch.utils.deterministic.fill_uninitialized_memory = False


def model_from_config(cfg: DictConfig, dtype: str | None = None) -> Transformer:
    """The policy model: a local HF directory when model.path is set, else the named config
    with deterministic random weights (model.init_seed)."""
    dtype = dtype or cfg.model.dtype
    shapes_only = cfg.device == "meta"  # no values (e.g. a checkpoint's size before a run)
    if cfg.model.path and not shapes_only:
        return load_hf(cfg.model.path, dtype=dtype, device=cfg.device)
    return build_model(model_args(cfg), dtype, seed=None if shapes_only else cfg.model.init_seed, device=cfg.device)


def sampling_params(cfg: DictConfig, eos_token_id: int | None = None, seed: int = 0,
                    max_new_tokens: int | None = None) -> SamplingParams:
    """The generator's sampling (generator.* keys) for completions of `max_new_tokens` (the workload's:
    task.max_new_tokens in train, agree.max_new_tokens in agree; None only where no sequence is drawn,
    e.g. the trainer's logprob_kwargs()); its logprob_kwargs() are what the trainer scores with too."""
    length = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    p = SamplingParams(**vars(keys_of(SamplingConfig, cfg.generator)), **length, eos_token_id=eos_token_id, seed=seed)
    p.validate()
    return p
