"""The policy model of a config (not exported by rlalign.model: rlalign.config imports
rlalign.model.args, so the package must not import the config back)."""

from __future__ import annotations

from omegaconf import DictConfig

from rlalign.config import model_args
from rlalign.model.hf import load_hf
from rlalign.model.model import Transformer, build_model


def model_from_config(cfg: DictConfig, dtype: str | None = None) -> Transformer:
    """The policy model: a local HF directory when model.path is set, else the named config
    with deterministic random weights (model.init_seed)."""
    dtype = dtype or cfg.model.dtype
    shapes_only = cfg.device == "meta"  # no values (e.g. a checkpoint's size before a run)
    if cfg.model.path and not shapes_only:
        return load_hf(cfg.model.path, dtype=dtype, device=cfg.device)
    return build_model(model_args(cfg), dtype, seed=None if shapes_only else cfg.model.init_seed, device=cfg.device)
