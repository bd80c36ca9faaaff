"""Structured, validated configuration: Hydra YAML (configs/) composed onto these dataclasses.

`load_config(["kernels.mode=default", "trainer.ep_size=2"])` composes configs/config.yaml with
its groups (model, task, algorithm, kernels, logger) and the overrides. A key that the schema
doesn't know fails with the valid keys listed; values are type-checked by OmegaConf.
"""

from __future__ import annotations

import datetime
import difflib
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlalign.model.args import ModelArgs

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

if not OmegaConf.has_resolver("now"):
    OmegaConf.register_new_resolver("now", lambda fmt: datetime.datetime.now().strftime(fmt), use_cache=True)


@dataclass
class ModelConfig(ModelArgs):
    name: str = "tiny-moe"
    path: str | None = None  # a local HF Qwen3MoeForCausalLM directory; replaces the fields above
    dtype: str = "bfloat16"
    init_seed: int = 0


@dataclass
class KernelsConfig:
    mode: str = "deterministic"  # deterministic | default
    backend: str = "torch"  # torch | triton | auto


@dataclass
class GeneratorConfig:
    ep_size: int = 1
    backend: str = "native"
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    batch_size: int = 0  # sequences per generate call per rank; 0 = all at once


@dataclass
class TrainerConfig:
    ep_size: int = 1
    micro_batch_size: int = 8  # sequences per micro-batch; 0 = all at once
    layout: str = "packed"  # packed | padded
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    master_dtype: str = "float32"


@dataclass
class AgreeConfig:
    num_prompts: int = 96
    prompt_min_len: int = 4
    prompt_max_len: int = 16
    shuffle: bool = True


@dataclass
class RunConfig:
    steps: int = 30
    dir: str = "runs/${now:%Y%m%d-%H%M%S}"


@dataclass
class DistConfig:
    timeout_s: float = 60.0  # collective timeout: a dead rank fails the others fast
    master_port: int = 0  # 0 = pick a free port


@dataclass
class Config:
    seed: int = 0
    device: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    agree: AgreeConfig = field(default_factory=AgreeConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)


class ConfigError(ValueError):
    pass


def _valid_keys(schema: DictConfig, dotted: str) -> tuple[str, list[str]]:
    """The deepest existing parent of `dotted` and its keys."""
    parts = dotted.split(".")
    node, parent = schema, []
    for p in parts[:-1]:
        if isinstance(node, DictConfig) and p in node and isinstance(node[p], DictConfig):
            node, parent = node[p], parent + [p]
        else:
            break
    return ".".join(parent), sorted(node.keys()) if isinstance(node, DictConfig) else []


def _unknown_key_error(schema: DictConfig, key: str, origin: str) -> ConfigError:
    parent, keys = _valid_keys(schema, key)
    close = difflib.get_close_matches(key.split(".")[-1], keys, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = f"under {parent!r}" if parent else "at the top level"
    return ConfigError(f"unknown config key {key!r} in {origin}{hint}; valid keys {where}: {', '.join(keys)}")


def _check_keys(schema: DictConfig, cfg: DictConfig, origin: str, prefix: str = "") -> None:
    for k in cfg.keys():
        full = f"{prefix}{k}"
        if k not in schema:
            raise _unknown_key_error(OmegaConf.structured(Config), full, origin)
        sub = cfg[k] if not OmegaConf.is_missing(cfg, k) else None
        if isinstance(sub, DictConfig) and isinstance(schema[k], DictConfig):
            _check_keys(schema[k], sub, origin, full + ".")


def load_config(overrides: list[str] | None = None, config_dir: str | Path | None = None) -> DictConfig:
    """Compose configs/config.yaml + overrides onto the Config schema; errors name the key."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    schema = OmegaConf.structured(Config)
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not of the form key=value")
        if key in ("model", "task", "algorithm", "kernels", "logger") or key.startswith("hydra"):
            continue  # group selection
        if OmegaConf.select(schema, key, default="__missing__") == "__missing__" and not _is_free_key(key):
            raise _unknown_key_error(schema, key, "the command line")
    cdir = str(Path(config_dir or CONFIG_DIR).resolve())
    try:
        with initialize_config_dir(config_dir=cdir, version_base="1.3"):
            raw = compose(config_name="config", overrides=overrides)
    except (ConfigCompositionException, HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot compose the config from {cdir}: {e}") from None
    _check_keys(schema, raw, f"{cdir}/config.yaml and its groups")
    try:
        cfg = OmegaConf.merge(schema, raw)
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config value: {e}".splitlines()[0] + f" (key {e.full_key!r})") from None
    validate(cfg)
    return cfg


def _is_free_key(key: str) -> bool:
    """Keys under free-form maps (e.g. task.kwargs.*) are not in the schema."""
    return ".kwargs." in f".{key}."


def validate(cfg: DictConfig) -> None:
    """Cross-field checks that must fail before any process starts."""
    problems = []
    if cfg.kernels.mode not in ("deterministic", "default"):
        problems.append(f"kernels.mode={cfg.kernels.mode!r}: expected deterministic or default")
    if cfg.kernels.backend not in ("torch", "triton", "auto"):
        problems.append(f"kernels.backend={cfg.kernels.backend!r}: expected torch, triton or auto")
    if cfg.model.dtype not in ("bfloat16", "float32"):
        problems.append(f"model.dtype={cfg.model.dtype!r}: expected bfloat16 or float32")
    if cfg.trainer.layout not in ("packed", "padded"):
        problems.append(f"trainer.layout={cfg.trainer.layout!r}: expected packed or padded")
    if cfg.generator.backend != "native":
        problems.append(f"generator.backend={cfg.generator.backend!r}: only 'native' is available")
    num_experts = _num_experts(cfg)
    for side in ("trainer", "generator"):
        ep = cfg[side].ep_size
        if ep < 1:
            problems.append(f"{side}.ep_size={ep}: must be >= 1")
        elif num_experts and num_experts % ep:
            problems.append(
                f"{side}.ep_size={ep} does not divide the model's num_experts={num_experts} "
                f"(model {cfg.model.path or cfg.model.name}); pick a divisor of {num_experts}"
            )
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))


def _num_experts(cfg: DictConfig) -> int:
    if cfg.model.path:
        from rlalign.model.hf import read_args

        return read_args(cfg.model.path)[0].num_experts
    return cfg.model.num_experts


def model_args(cfg: DictConfig) -> ModelArgs:
    names = {f for f in ModelArgs.__dataclass_fields__}
    d = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k in names}
    return ModelArgs.from_dict(d, where=f"model ({cfg.model.name})")
