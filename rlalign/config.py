"""Structured, validated configuration: Hydra YAML (configs/) composed onto these dataclasses.

`load_config(["kernels.mode=default", "trainer.ep_size=2"])` composes configs/config.yaml with
its groups (model, task, algorithm, kernels, logger) and the overrides; a ConfigSource adds a
user's directory of options and experiments (rlalign/config_search.py). A key that the schema
doesn't know fails with the valid keys listed, in the user's files too; values are type-checked by
OmegaConf.

The dataclasses below are the one place where defaults live: configs/config.yaml holds only the
defaults list (which group option is chosen), and a group file (configs/GROUP/OPTION.yaml) holds
only what its option changes from these defaults (tests/test_config.py checks both). A string
field with a fixed set of values is declared with `choice(default, SomeLiteral)`; validate()
checks all of them in one loop (OmegaConf 2.3 cannot type a field as a Literal).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlalign import values
from rlalign.config_search import (
    ConfigError,
    ConfigSource,
    check_experiment_defaults,
    check_group_overrides,
    compose_from,
    config_file,
    group_options,
    search_dirs,
)
from rlalign.config_task import AlgorithmConfig, TaskConfig, algorithm_problems, choice, did_you_mean, task_problems
from rlalign.config_task import IcePopConfig as IcePopConfig  # re-exported: the schema's names all live here
from rlalign.config_task import LossName as LossName
from rlalign.config_task import OldLogprobs as OldLogprobs
from rlalign.config_task import TISConfig as TISConfig
from rlalign.model.args import ModelArgs, read_args
from rlalign.stop import STOP_SIGNALS

# rlalign's own configs: the repository's configs/ in a checkout, rlalign/configs/ in an installed
# wheel (pyproject.toml's package-dir ships configs/ there)
_PACKAGE = Path(__file__).resolve().parent
CONFIG_DIR = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"

if not OmegaConf.has_resolver("now"):
    OmegaConf.register_new_resolver("now", lambda fmt: datetime.datetime.now().strftime(fmt), use_cache=True)

# The allowed values of the fields declared with choice() (one Literal per field).
Dtype = Literal["bfloat16", "float32"]
KernelMode = Literal["deterministic", "default"]
KernelBackend = Literal["torch", "triton", "auto"]
GeneratorBackend = Literal["native", "vllm"]
Layout = Literal["packed", "padded"]
WandbMode = Literal["online", "offline", "disabled"]
WANDB_ENV_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what W&B takes in $WANDB_MODE
OnMismatch = Literal["raise", "warn"]
Fingerprints = Literal["off", "default", "layers"]  # default: weights, grads, logprobs; layers: + per-layer hidden


@dataclass
class ModelConfig(ModelArgs):
    # ModelArgs' defaults are the tiny-moe model's (configs/model/tiny-moe.yaml changes nothing)
    eos_token_id: int | None = 1
    name: str = "tiny-moe"
    path: str | None = None  # a local HF Qwen3MoeForCausalLM directory; replaces the fields above
    dtype: str = choice("bfloat16", Dtype)
    init_seed: int = 0


@dataclass
class KernelsConfig:
    mode: str = choice("deterministic", KernelMode)
    backend: str = choice("torch", KernelBackend)


@dataclass
class VllmEngineConfig:
    """generator.backend=vllm: vLLM's engine options (passed to vllm.LLM under these names); the
    bits never depend on them (rlalign/rollout/vllm)."""

    max_num_seqs: int = 64  # sequences in flight
    max_num_batched_tokens: int = 2048  # tokens per step; below the prompt length: chunked prefill
    block_size: int = 16  # tokens per KV page
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.1  # GPU: fraction of device memory; CPU: fraction of host memory
    kv_cache_memory_bytes: int | None = None  # KV cache size; None: from gpu_memory_utilization
    enforce_eager: bool = True  # rlalign's model has host syncs (MoE counts): no CUDA graphs / compile
    stock: bool = False  # negative twin: vLLM's own model, attention and sampler (does not agree)


# the temperatures the sampler takes: 1 / fp32(temperature) a normal fp32 number (temperature <= 2**126), and
# logits of up to 2**16 in size finite once multiplied by it (temperature >= 2**-111)
TEMPERATURE_RANGE = (2.0 ** -111, 2.0 ** 126)


@dataclass
class SamplingConfig:
    """generator.* keys of the distribution tokens are drawn from (and that the trainer scores them under).
    A completion's length is the workload's: task.max_new_tokens (train) or agree.max_new_tokens."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def validate_sampling(self, vocab_size: int | None = None, where: str = "generator.") -> None:
        """Values the sampler can draw from; `where` leads each field's name (a config's keys, or a request's)."""
        wrong = values.type_problems(self, SamplingConfig)
        if wrong:
            raise ValueError(f"{where}{wrong[0]}")
        if not self.greedy and not 0 < self.temperature < math.inf:
            raise ValueError(
                f"{where}temperature={self.temperature}: sampling needs a temperature > 0 and < inf "
                "(set generator.greedy=true for argmax decoding)"
            )
        lo, hi = TEMPERATURE_RANGE
        if not self.greedy and not lo <= self.temperature <= hi:
            raise ValueError(
                f"{where}temperature={self.temperature}: outside [{lo:.3g}, {hi:.3g}] (2**-111 to 2**126), where "
                "1 / temperature is a normal fp32 number and logits up to 2**16 in size stay finite once multiplied "
                "by it (set generator.greedy=true for argmax decoding)"
            )
        if self.top_k < 0:
            raise ValueError(f"{where}top_k={self.top_k}: must be >= 0 (0 disables it)")
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"{where}top_k={self.top_k}: more than the model's {vocab_size} token ids (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{where}top_p={self.top_p}: must be in (0, 1]")
        if self.top_p < sys.float_info.min:
            raise ValueError(f"{where}top_p={self.top_p}: must be in (0, 1] and a normal double (at least "
                             f"{sys.float_info.min:.17g}), as the Triton top-p filter takes")


@dataclass
class EngineConfig:
    """generator.* keys of the native engine's schedule (rlalign.rollout.native); none changes a token or a bit."""

    max_num_seqs: int = 0  # sequences in flight per generator rank; 0 = all of the rank's requests
    max_num_batched_tokens: int = 8192  # rows per step (decode rows, then prompt chunks); 0 = no limit
    page_size: int = 16  # tokens per KV page
    num_pages: int = 0  # KV pages per rank; 0 = enough for max_num_seqs sequences at their longest
    cuda_graphs: bool = True  # CUDA: decode steps and small mixed steps replay graphs per batch-size bucket
    # the KV cache, block table and captured decode graphs kept by the engine between generate() calls (reused
    # while they fit; an RL run calls generate() once per step); false: freed after each call
    keep_state: bool = True
    lookahead: bool = True  # the next step is enqueued before this one's tokens are read back

    def validate_schedule(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "num_pages"):
            if getattr(self, key) < 0:
                raise ValueError(f"generator.{key}={getattr(self, key)}: must be >= 0 (0 = automatic)")
        if self.page_size < 1:
            raise ValueError(f"generator.page_size={self.page_size}: must be >= 1")
        if self.max_num_batched_tokens and self.max_num_seqs and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"generator.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"generator.max_num_seqs={self.max_num_seqs}: every decoding sequence needs one row per step"
            )


@dataclass
class GeneratorConfig(EngineConfig, SamplingConfig):
    ep_size: int = 1
    backend: str = choice("native", GeneratorBackend)  # read only by rlalign.generator_world
    vllm: VllmEngineConfig = field(default_factory=VllmEngineConfig)


@dataclass
class TrainerConfig:
    ep_size: int = 2
    micro_batch_size: int = 32  # sequences per micro-batch; 0 = all at once
    layout: str = choice("packed", Layout)
    lr: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    separate_scoring_pass: bool = False  # score with no grad before training (else: the 1st forward)
    # gradients summed in one tree over global micro-batches: the same bits at every trainer EP
    # size (false: per rank, then over ranks in rank order; the same bits run to run only)
    topology_invariant: bool = True
    # ZeRO-1/2 style: the dense (non-expert) fp32 masters, AdamW moments and, once the grad norm is
    # taken, gradients split across the trainer ranks in units of rows of at most shard_unit_numel
    # elements (a multiple of 64; the units and so the bits never depend on the number of ranks);
    # updated weights all-gathered. Same bits as false (rlalign/training/trainer.py)
    shard_dense: bool = False
    shard_unit_numel: int = 4 * 1024 * 1024


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "rlalign"
    name: str | None = None
    mode: str | None = choice(None, WandbMode)  # None: $WANDB_MODE, else offline without an API key
    sample_table_every: int = 5
    num_samples: int = 8


@dataclass
class LoggerConfig:
    console: bool = True
    jsonl: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    enabled: bool = True  # false: no checkpoint is written, not even the run's last (benchmarks of large models)
    every: int | None = None  # steps between checkpoints; 0: at the end only; null: checkpoint.checkpoint_every
    resume: str = "never"  # never | auto | a checkpoint directory
    keep: int = 2
    async_save: bool = True  # written in the background; the next update, the next save and the run's end wait
    bucket_mb: int = 512  # files of at most this size
    # auto: the state copied into host buffers (training goes on) when it fits in half the free RAM; else streamed
    staging: str = choice("auto", Literal["auto", "host", "stream"])
    export_hf: bool = False  # also the model as a Hugging Face directory in each checkpoint (step_N/hf; rlalign export)


@dataclass
class SyncConfig:
    """Weight sync (rlalign.parallel.weight_sync: NCCL/gloo/CUDA IPC, fingerprints on the device)."""

    bucket_mb: int = 256  # flat buffers of at most this size per dtype (a larger tensor: its own)


@dataclass
class PlacementConfig:
    # GPUs: trainer and generator share GPUs by time; the generator gives its memory back while the
    # trainer trains (rlalign.rollout.generator.releases_memory)
    colocate: bool = False
    num_cpus: float | None = None  # the local Ray cluster's CPUs (None: all)


@dataclass
class MonitorConfig:
    on_mismatch: str = choice("raise", OnMismatch)  # deterministic mode only
    # What each step fingerprints (rlalign/monitor/trace.py; one definition on every device):
    #   off      no traces (the weight sync still checks its fingerprints)
    #   default  every trainer rank: the logprobs, then gradients, AdamW moments (at the steps
    #            optim_every picks) and weights (per dense unit, per global expert); the generator:
    #            tokens, logprobs, the synced weights. One kernel launch per step and side reads each
    #            byte once, read back without waiting: ~ bytes read / HBM bandwidth (bench-moe-large:
    #            weights + gradients 31 GB, ~7 ms on an H200; the two moments another 42 GB)
    #   layers   also every op's output per token on both sides (names a mismatch's first op; costly)
    fingerprints: str = choice("default", Fingerprints)
    # The AdamW moments (exp_avg, exp_avg_sq: two fp32 copies of the model, 4/7 of the state the trace
    # reads) are fingerprinted at steps 0, N, 2N, ... (1: every step, the fullest trace). A moment that
    # diverges changes the next update, so the weights show it from the next step on (when the change
    # survives the rounding to the weights' dtype) and the moments' own records at the next multiple of
    # N; runs compare record by record only at the same N.
    optim_every: int = 10
    worst_tokens: int = 10


@dataclass
class GateConfig:
    candidate: list[str] = field(default_factory=lambda: ["generator.ep_size=2"])  # baseline's other path
    replay_step: int | None = None  # replay: resume after this step (None: run.steps // 2 - 1)


@dataclass
class AgreeConfig:
    num_prompts: int = 96
    max_new_tokens: int = 48  # the completion length of `rlalign agree`
    prompt_min_len: int = 4
    prompt_max_len: int = 16
    shuffle: bool = True
    replay: str | None = None  # a mismatch dump (run_dir/mismatch-stepN): its weights, prompts and sampling


@dataclass
class RunConfig:
    steps: int = 50
    dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    overwrite: bool = False  # a run that run.dir holds: deleted first (else refused: rlalign.rundir.claim_run_dir)
    # rlalign/stop.py: these signals finish the step in flight and its checkpoint, then exit 128+N;
    # past stop_grace_s seconds (or on a second signal) the step is abandoned
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    stop_grace_s: float = 20.0


@dataclass
class DistConfig:
    timeout_s: float = 60.0  # collective timeout: a dead rank fails the others fast


@dataclass
class Config:
    seed: int = 0
    device: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    agree: AgreeConfig = field(default_factory=AgreeConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)


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


# keys that left the schema -> where their setting lives now
MOVED_KEYS = {"generator.max_new_tokens": "a completion's length is task.max_new_tokens in `rlalign train` and "
              "`rlalign gate` (a task option sets its own: repeat 5, add and reverse 8) and agree.max_new_tokens in "
              "`rlalign agree`"}


def _unknown_key_error(schema: DictConfig, key: str, origin: str) -> ConfigError:
    if key in MOVED_KEYS:
        return ConfigError(f"{key} (in {origin}) is no longer a config key: {MOVED_KEYS[key]}")
    parent, keys = _valid_keys(schema, key)
    hint = did_you_mean(key.split(".")[-1], keys)
    where = f"under {parent!r}" if parent else "at the top level"
    return ConfigError(f"unknown config key {key!r} in {origin}{hint}; valid keys {where}: {', '.join(keys)}")


def load_config(overrides: list[str] | None = None, config_dir: str | Path | None = None,
                source: ConfigSource | None = None) -> DictConfig:
    """Compose the primary config (configs/config.yaml, or source.name) + overrides onto the Config
    schema over the search path: config_dir (rlalign's own configs/ unless a test gives another),
    then source.user_dir and hydra.searchpath=[...]'s directories. Errors name the key, the option or
    the file."""
    source = source or ConfigSource()
    dirs, overrides = search_dirs(Path(config_dir or CONFIG_DIR), source, list(overrides or []))
    # free-form maps (task.kwargs.*) take new keys: force-add them
    overrides = [("++" + o) if _is_free_key(o.split("=", 1)[0]) and not o.startswith("+") else o for o in overrides]
    schema = OmegaConf.structured(Config)
    groups = group_options(dirs)
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not of the form key=value")
        if key in groups or key.startswith("hydra"):
            continue  # group selection
        if OmegaConf.select(schema, key, default="__missing__") == "__missing__" and not _is_free_key(key):
            raise _unknown_key_error(schema, key, "the command line")
    check_group_overrides(dirs, overrides)
    check_experiment_defaults(dirs, source.name)
    ConfigStore.instance().store(name="rlalign_schema", node=Config)  # config.yaml's first default
    try:
        cfg = compose_from(dirs, source.name, overrides)
    except (ConfigCompositionException, HydraException, OmegaConfBaseException) as e:
        raise _composition_error(e, schema, dirs) from None
    validate(cfg)
    return cfg


def chosen_options(source: ConfigSource | None = None) -> dict[str, str]:
    """{group: option} of the primary config's defaults (what --help marks as the default)."""
    source = source or ConfigSource()
    dirs, _ = search_dirs(CONFIG_DIR, source, [])
    ConfigStore.instance().store(name="rlalign_schema", node=Config)
    choices = compose_from(dirs, source.name, [], return_hydra_config=True).hydra.runtime.choices
    return {g: str(o) for g, o in choices.items() if not g.startswith("hydra/") and o is not None}


def _composition_error(e: Exception, schema: DictConfig, dirs: list[Path]) -> ConfigError:
    """One line for Hydra's and OmegaConf's composition errors, naming the file they come from."""
    line = _command_line_error(e, schema, dirs)
    if line is not None:
        return line
    text = f"{e}\n{e.__cause__ or ''}"
    origin = re.search(r"In '([^']+)'", text)
    where = str(config_file(dirs, origin[1]) or origin[1]) if origin else "the command line"
    key = re.search(r"full_key: (\S+)", text)
    if key and re.search(r"Key '[^']+' not in '", text):
        return _unknown_key_error(schema, key[1], where)
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if key and origin and len(lines) > 1:  # "In 'model/x': ValidationError raised ...", then OmegaConf's line
        return ConfigError(f"{where}: {key[1]}: {lines[1]}")
    cause = str(e.__cause__ or "").strip().splitlines()
    detail = f" ({cause[0].strip()})" if cause else ""
    return ConfigError(f"cannot compose the config from {', '.join(map(str, dirs))}: {'; '.join(lines)}{detail}")


GRAMMAR = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"


def _command_line_error(e: Exception, schema: DictConfig, dirs: list[Path]) -> ConfigError | None:
    """One line naming the override for Hydra's errors of a command-line override (a value that does not
    parse, or is of the wrong type; a section set like a group; a group chosen twice), else None."""
    if isinstance(e, OverrideParseException):
        msg = e.message.splitlines()[0]
        return ConfigError(f"{e.override}: Hydra's override grammar cannot parse it ({msg}); in the shell, quote a "
                           f"value that holds '=', ',', spaces or brackets, e.g. key='[\"a=1\"]' ({GRAMMAR})")
    merging = re.fullmatch(r"Error merging override (\S+)", str(e))
    if merging:
        override = merging[1]
        key = override.split("=", 1)[0].lstrip("+~")
        if isinstance(OmegaConf.select(schema, key, default=None), DictConfig):
            return ConfigError(f"{override}: {key} is a section of keys, not a config group: set its keys as "
                               f"{key}.KEY=VALUE (--cfg job lists them); the groups: {', '.join(group_options(dirs))}")
        cause = str(e.__cause__ or "").strip().splitlines()
        return ConfigError(f"{override}: {cause[0].strip() if cause else 'cannot be set'} (the command line)")
    twice = re.fullmatch(r"(\S+) appears more than once in the final defaults list", str(e))
    if twice:
        g = twice[1]
        return ConfigError(f"{g} is chosen twice: the primary config chooses an option of {g} already, so write "
                           f"{g}=OPTION to replace it (+{g}=OPTION adds a second choice)")
    return None


def _is_free_key(key: str) -> bool:
    """Keys under free-form maps (e.g. task.kwargs.*) are not in the schema."""
    return ".kwargs." in f".{key}"


def validate(cfg: DictConfig) -> None:
    """Cross-field checks that must fail before any process starts."""
    problems = []
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            problems.append(f"{key}={value!r}: expected {_or(allowed)}{did_you_mean(value, allowed)}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(cfg.device)):
        problems.append(f"device={cfg.device!r}: expected cpu, cuda or cuda:N")
    args = model_args(cfg) if cfg.model.path else cfg.model
    num_experts, vocab_size = args.num_experts, args.vocab_size
    for side in ("trainer", "generator"):
        ep = cfg[side].ep_size
        if ep < 1:
            problems.append(f"{side}.ep_size={ep}: must be >= 1")
        elif num_experts and num_experts % ep:
            problems.append(
                f"{side}.ep_size={ep} does not divide the model's num_experts={num_experts} "
                f"(model {cfg.model.path or cfg.model.name}); pick a divisor of {num_experts}"
            )
    problems += _trainer_problems(cfg) + algorithm_problems(cfg.algorithm) + task_problems(cfg.task)
    if cfg.task.num_prompts < 1 or cfg.task.samples_per_prompt < 1:
        problems.append("task.num_prompts and task.samples_per_prompt must be >= 1")
    elif cfg.task.samples_per_prompt == 1 and cfg.algorithm.loss is None:
        problems.append(f"task.samples_per_prompt=1: a sample's advantage is its reward minus its group's mean, 0 in a "
                        f"group of one, so algorithm.name={cfg.algorithm.name} would never update the policy; use >= 2")
    if cfg.algorithm.num_minibatches > cfg.task.num_prompts * cfg.task.samples_per_prompt:
        problems.append(f"algorithm.num_minibatches={cfg.algorithm.num_minibatches}: more minibatches than the "
                        f"step's {cfg.task.num_prompts * cfg.task.samples_per_prompt} sequences")
    if cfg.monitor.optim_every < 1:
        problems.append(f"monitor.optim_every={cfg.monitor.optim_every}: must be >= 1 (1: the AdamW moments "
                        f"every step)")
    if cfg.sync.bucket_mb < 1:
        problems.append(f"sync.bucket_mb={cfg.sync.bucket_mb}: must be >= 1")
    if cfg.run.steps < 1:
        problems.append(f"run.steps={cfg.run.steps}: must be >= 1")
    if not str(cfg.run.dir).strip():
        problems.append("run.dir='': must name a directory (it holds the run's metrics, traces and checkpoints)")
    if cfg.placement.num_cpus is not None and not cfg.placement.num_cpus >= 1:
        problems.append(f"placement.num_cpus={cfg.placement.num_cpus}: the local Ray cluster's CPUs, >= 1 (null: "
                        "all of this machine's)")
    if not -(1 << 63) <= cfg.seed < 1 << 63:  # the sampling noise's and torch's generators' seed
        problems.append(f"seed={cfg.seed}: must be a signed 64-bit integer")
    bad = [s for s in cfg.run.stop_signals if s not in STOP_SIGNALS]
    if bad:
        problems.append(f"run.stop_signals={list(cfg.run.stop_signals)}: {bad} not among {list(STOP_SIGNALS)}")
    if cfg.run.overwrite and cfg.checkpoint.resume != "never":
        problems.append(f"run.overwrite=true deletes the run that checkpoint.resume={cfg.checkpoint.resume} would "
                        f"continue: set one of them")
    for check in (lambda: keys_of(SamplingConfig, cfg.generator).validate_sampling(vocab_size),
                  keys_of(EngineConfig, cfg.generator).validate_schedule):
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    problems += _vllm_problems(cfg)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))


def _ranges(cfg: DictConfig) -> list[str]:
    """Numbers outside their meaning's range (each would otherwise run and mean something else:
    a negative micro_batch_size trained with one odd partition, a negative lr ascends)."""
    t, a = cfg.trainer, cfg.algorithm
    checks = [
        ("trainer.micro_batch_size", t.micro_batch_size, t.micro_batch_size >= 0, ">= 0 (0 = all at once)"),
        ("trainer.lr", t.lr, 0 <= t.lr < math.inf, "finite and >= 0"),
        ("trainer.eps", t.eps, 0 < t.eps < math.inf, "finite and > 0"),
        ("trainer.weight_decay", t.weight_decay, 0 <= t.weight_decay < math.inf, "finite and >= 0"),
        ("trainer.grad_clip", t.grad_clip, t.grad_clip >= 0, ">= 0 (0 = no clipping)"),
        ("trainer.betas", list(t.betas), len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas),
         "two values in [0, 1)"),
        ("algorithm.clip_low", a.clip_low, 0 <= a.clip_low < 1, "in [0, 1)"),
        ("algorithm.clip_high", a.clip_high, a.clip_high >= 0, ">= 0"),
        ("algorithm.kl_coef", a.kl_coef, 0 <= a.kl_coef < math.inf, "finite and >= 0 (0 = off)"),
        ("algorithm.tis.cap", a.tis.cap, a.tis.cap > 0, "> 0"),
        ("algorithm.icepop.low", a.icepop.low, 0 <= a.icepop.low < a.icepop.high, "in [0, algorithm.icepop.high)"),
        ("checkpoint.every", cfg.checkpoint.every, cfg.checkpoint.every is None or cfg.checkpoint.every >= 0,
         ">= 0 (0 = at the end only; null = sized to the run)"),
        ("agree.max_new_tokens", cfg.agree.max_new_tokens, cfg.agree.max_new_tokens >= 1, ">= 1"),
        ("checkpoint.keep", cfg.checkpoint.keep, cfg.checkpoint.keep >= 0, ">= 0 (0 = keep all)"),
        ("checkpoint.bucket_mb", cfg.checkpoint.bucket_mb, cfg.checkpoint.bucket_mb >= 1, ">= 1"),
        ("dist.timeout_s", cfg.dist.timeout_s, cfg.dist.timeout_s > 0, "> 0"),
        ("logger.wandb.num_samples", cfg.logger.wandb.num_samples, cfg.logger.wandb.num_samples >= 0, ">= 0"),
        ("run.stop_grace_s", cfg.run.stop_grace_s, cfg.run.stop_grace_s >= 0, ">= 0 (0 = stop at once)"),
        ("logger.wandb.sample_table_every", cfg.logger.wandb.sample_table_every,
         cfg.logger.wandb.sample_table_every >= 1, ">= 1"),
        ("logger.wandb.project", repr(project := cfg.logger.wandb.project), len(project) <= 128 and not
         set(project) & set("/\\#?%:"), "a W&B project name: at most 128 characters, none of / \\ # ? % :"),
        ("$WANDB_MODE", env_mode := os.environ.get("WANDB_MODE", ""), not cfg.logger.wandb.enabled or env_mode in
         ("", *WANDB_ENV_MODES), f"unset or one of {', '.join(WANDB_ENV_MODES)} (W&B reads it even beside "
         "logger.wandb.mode)"),
    ]
    return [f"{key}={value}: must be {want}" for key, value, ok, want in checks if not ok]


def _trainer_problems(cfg: DictConfig) -> list[str]:
    t, problems = cfg.trainer, _ranges(cfg)
    unit = t.shard_unit_numel
    if unit < 64 or unit % 64:
        problems.append(f"trainer.shard_unit_numel={unit}: must be a positive multiple of 64 (dense-sharding units "
                        "start at 64-element offsets so that vectorised kernels see them as in the whole tensor)")
    return problems


def _vllm_problems(cfg: DictConfig) -> list[str]:
    v, problems = cfg.generator.vllm, []
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if v[key] < 1:
            problems.append(f"generator.vllm.{key}={v[key]}: must be >= 1")
    if not 0.0 < v.gpu_memory_utilization <= 1.0:
        problems.append(f"generator.vllm.gpu_memory_utilization={v.gpu_memory_utilization}: must be in (0, 1]")
    if v.kv_cache_memory_bytes is not None and v.kv_cache_memory_bytes < 1:
        problems.append(f"generator.vllm.kv_cache_memory_bytes={v.kv_cache_memory_bytes}: must be >= 1 (or null)")
    if not v.enforce_eager and not v.stock:
        problems.append("generator.vllm.enforce_eager=false: rlalign's model syncs with the host in every MoE layer "
                        "(expert counts), so vLLM cannot capture or compile it; keep it true")
    return problems


def _choices(cls: type, prefix: str = "") -> dict[str, tuple[str | None, ...]]:
    """{'kernels.mode': ('deterministic', 'default'), ...}: every choice() field under `cls`
    (None is allowed where it is the default)."""
    out = {}
    for f in dataclasses.fields(cls):
        if "allowed" in f.metadata:
            out[prefix + f.name] = get_args(f.metadata["allowed"]) + ((None,) if f.default is None else ())
        elif dataclasses.is_dataclass(f.default_factory):
            out.update(_choices(f.default_factory, f"{prefix}{f.name}."))
    return out


CHOICES = _choices(Config)  # the one table of allowed values: validate() checks it


def _or(values: tuple[str | None, ...]) -> str:
    names = [str(v) if v is None else v for v in values]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def keys_of(cls: type, node: DictConfig) -> Any:
    """An instance of the dataclass `cls` from the same-named keys of `node` (e.g. EngineConfig from
    cfg.generator): a runtime object with the schema's fields, not a copy of them field by field."""
    return cls(**{f.name: node[f.name] for f in dataclasses.fields(cls)})


def model_args(cfg: DictConfig) -> ModelArgs:
    """The model's arguments: model.path's config.json when set, else the model group's fields. The
    one place they are derived from the config."""
    if cfg.model.path:
        return read_args(cfg.model.path)[0]
    names = {f for f in ModelArgs.__dataclass_fields__}
    d = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k in names}
    return ModelArgs.from_dict(d, where=f"model ({cfg.model.name})")


def shares_gpu(cfg: DictConfig) -> bool:
    """Whether the trainer and the generator take turns on the same GPUs (placement.colocate on
    CUDA): each gives its memory back while the other works, and weights move by CUDA IPC. The one
    place this is decided."""
    return bool(cfg.placement.colocate) and str(cfg.device).startswith("cuda")
