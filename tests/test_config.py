"""One source of config defaults (the dataclasses in rlalign/config.py) and one check of allowed values."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlalign.config import CHOICES, CONFIG_DIR, Config, ConfigError, load_config

GROUPS = sorted(d.name for d in CONFIG_DIR.iterdir() if d.is_dir())


def _leaves(d: dict, prefix: str = "") -> dict:
    """{'trainer.lr': 0.01, ...}; free-form maps (kwargs) are one value."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "kwargs":
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _schema() -> dict:
    return _leaves(OmegaConf.to_container(OmegaConf.structured(Config), resolve=False))


def _raw(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}


def _problems(config_dir: Path) -> list[str]:
    """What makes a config directory hold defaults twice: values in config.yaml besides the
    defaults list, or a group file that sets a key to the dataclass default."""
    schema = _schema()
    problems = [f"config.yaml sets {k}" for k in _raw(config_dir / "config.yaml") if k != "defaults"]
    for path in sorted(config_dir.glob("*/*.yaml")):
        group = path.parent.name
        for key, value in _leaves(_raw(path), f"{group}.").items():
            if key in schema and schema[key] == value:
                problems.append(f"{path.relative_to(config_dir)}: {key}={value!r} is the dataclass default")
    return problems


def test_no_yaml_file_repeats_a_default():
    assert _problems(CONFIG_DIR) == []


@pytest.mark.parametrize("where, text, expected", [
    ("config.yaml", "trainer:\n  lr: 0.5\n", "config.yaml sets trainer"),
    ("algorithm/grpo.yaml", "clip_low: 0.2\n", "algorithm/grpo.yaml: algorithm.clip_low=0.2 is the dataclass default"),
    ("logger/console.yaml", "wandb:\n  project: rlalign\n", "logger.wandb.project='rlalign' is the dataclass default"),
])
def test_a_repeated_or_disagreeing_default_is_caught(tmp_path, where, text, expected):
    shutil.copytree(CONFIG_DIR, tmp_path / "configs")
    with open(tmp_path / "configs" / where, "a") as f:
        f.write(text)
    assert any(expected in p for p in _problems(tmp_path / "configs"))
    load_config(config_dir=tmp_path / "configs")  # still a valid config: only the check above catches it


def test_dataclass_defaults_are_the_resolved_defaults():
    """The default composition = the dataclasses + what the default group options change (only
    task=repeat's max_new_tokens and kwargs); in particular the values the YAML used to restate."""
    resolved = _leaves(OmegaConf.to_container(load_config([]), resolve=False))
    schema = _schema()
    assert resolved.keys() == schema.keys()
    chosen = {}
    for d in _raw(CONFIG_DIR / "config.yaml")["defaults"]:
        if isinstance(d, dict):
            ((group, option),) = d.items()
            chosen.update(_leaves(_raw(CONFIG_DIR / group / f"{option}.yaml"), f"{group}."))
    assert sorted(chosen) == ["task.kwargs", "task.max_new_tokens"]
    assert {k: v for k, v in resolved.items() if v != schema[k]} == chosen
    c = Config()
    assert (c.trainer.ep_size, c.trainer.lr, c.trainer.micro_batch_size, c.task.max_new_tokens, c.run.steps) \
        == (2, 0.01, 32, 48, 50)
    assert resolved["model.eos_token_id"] == c.model.eos_token_id == 1


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group):
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        extra = ["task.path=x.jsonl"] if path.stem == "jsonl" else []
        cfg = load_config([f"{group}={path.stem}", *extra])
        assert cfg[group].get("name", path.stem) in (path.stem, "grpo")


def test_the_literal_checked_keys():
    assert sorted(CHOICES) == ["algorithm.old_logprobs", "checkpoint.staging", "generator.backend", "kernels.backend",
                               "kernels.mode", "logger.wandb.mode", "model.dtype", "monitor.fingerprints",
                               "monitor.on_mismatch", "trainer.layout"]
    assert CHOICES["kernels.mode"] == ("deterministic", "default")
    assert CHOICES["logger.wandb.mode"] == ("online", "offline", "disabled", None)
    schema = _schema()
    assert all(schema[k] in allowed for k, allowed in CHOICES.items())


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_bad_choice_names_the_key_the_value_and_the_allowed_values(key):
    with pytest.raises(ConfigError) as e:
        load_config([f"{key}=bogus"])
    msg = str(e.value)
    assert f"{key}='bogus': expected" in msg
    assert all(str(v) in msg.split(f"{key}='bogus'")[1] for v in CHOICES[key])


@pytest.mark.parametrize("key, value", [(k, v) for k, vs in CHOICES.items() for v in vs if v is not None])
def test_every_allowed_value_is_accepted(key, value):
    assert OmegaConf.select(load_config([f"{key}={value}"]), key) == value


def test_old_messages_kept():
    with pytest.raises(ConfigError, match=r"kernels.mode='fast': expected deterministic or default"):
        load_config(["kernels.mode=fast"])
    with pytest.raises(ConfigError, match=r"monitor.fingerprints='all': expected off, default or layers"):
        load_config(["monitor.fingerprints=all"])


def test_more_minibatches_than_sequences_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm.num_minibatches=17: more minibatches than the step's 16"):
        load_config(["task.num_prompts=4", "task.samples_per_prompt=4", "algorithm.num_minibatches=17"])
    load_config(["task.num_prompts=4", "task.samples_per_prompt=4", "algorithm.num_minibatches=16"])  # twin


def test_engine_keys_reach_the_native_engine():
    """generator.{cuda_graphs, keep_state, lookahead} become the engine's settings; keep_state=false
    leaves no KV cache or graphs on the model after a call (twin: the default keeps them)."""
    from conftest import tiny_model

    from rlalign.rollout.generator import make_generator
    from rlalign.sampling_params import SamplingParams

    model = tiny_model()
    off = make_generator(load_config(["generator.cuda_graphs=false", "generator.keep_state=false",
                                      "generator.lookahead=false"]), model)
    on = make_generator(load_config([]), model)
    assert (off.config.cuda_graphs, off.config.keep_state, off.config.lookahead) == (False, False, False)
    assert (on.config.cuda_graphs, on.config.keep_state, on.config.lookahead) == (True, True, True)
    params = SamplingParams(seed=1, max_new_tokens=3)
    off.generate([[3, 4, 5]], [0], params)
    assert off.state is None
    on.generate([[3, 4, 5]], [0], params)
    assert on.state is not None


@pytest.mark.parametrize("override, message", [
    ("trainer.micro_batch_size=-1", r"trainer\.micro_batch_size=-1: must be >= 0"),
    ("trainer.lr=-0.1", r"trainer\.lr=-0\.1: must be finite and >= 0"),
    ("trainer.eps=0", r"trainer\.eps=0(\.0)?: must be finite and > 0"),
    ("trainer.grad_clip=-1", r"trainer\.grad_clip=-1(\.0)?: must be >= 0"),
    ("trainer.betas=[0.9,1.0]", r"trainer\.betas=\[0\.9, 1\.0\]: must be two values in \[0, 1\)"),
    ("trainer.betas=[0.9]", r"trainer\.betas=\[0\.9\]: must be two values"),
    ("algorithm.clip_low=1.5", r"algorithm\.clip_low=1\.5: must be in \[0, 1\)"),
    ("algorithm.kl_coef=-1", r"algorithm\.kl_coef=-1(\.0)?: must be finite and >= 0"),
    ("trainer.lr=inf", r"trainer\.lr=inf: must be finite and >= 0"),  # ran, and NaN weights broke the sampler
    ("trainer.lr=nan", r"trainer\.lr=nan: must be finite"),
    ("algorithm.kl_coef=inf", r"algorithm\.kl_coef=inf: must be finite"),
    ("algorithm.icepop.low=3", r"algorithm\.icepop\.low=3(\.0)?: must be in \[0, algorithm\.icepop\.high\)"),
    ("checkpoint.keep=-1", r"checkpoint\.keep=-1: must be >= 0"),
    ("checkpoint.every=-2", r"checkpoint\.every=-2: must be >= 0"),
    ("dist.timeout_s=0", r"dist\.timeout_s=0(\.0)?: must be > 0"),
    ("device=tpu", r"device='tpu': expected cpu, cuda or cuda:N"),
    ("logger.wandb.sample_table_every=0", r"logger\.wandb\.sample_table_every=0: must be >= 1"),
])
def test_numbers_outside_their_range_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_groups_of_one_sample_are_refused_but_for_a_loss_of_ones_own():
    """GRPO groups of one have advantage 0 at every sample: no built-in loss would ever learn; a user's loss
    (which may use no advantage) may run them, and groups of two run with every loss (the twins)."""
    with pytest.raises(ConfigError, match=r"task\.samples_per_prompt=1: .*algorithm\.name=gspo would never update"):
        load_config(["task.samples_per_prompt=1", "algorithm=gspo"])
    load_config(["task.samples_per_prompt=1", "algorithm.loss=mypkg.losses:fn"])
    load_config(["task.samples_per_prompt=2", "algorithm=gspo"])


def test_numbers_at_the_edges_of_their_range_are_accepted():
    load_config(["trainer.micro_batch_size=0", "trainer.lr=0", "trainer.grad_clip=0", "trainer.betas=[0.0,0.999]",
                 "algorithm.clip_low=0", "checkpoint.keep=0", "checkpoint.every=0"])


@pytest.mark.parametrize("override, message", [
    ("model.rms_norm_eps=-1", r"model \(tiny-moe\): invalid model arguments: rms_norm_eps=-1(\.0)? must be positive"),
    ("model.rope_theta=0", r"rope_theta=0(\.0)? must be positive"),  # ran, then failed deep in the router
    ("model.num_kv_heads=0", r"num_kv_heads=0 must be positive"),  # was a ZeroDivisionError
    ("model.decoder_sparse_step=0", r"decoder_sparse_step=0 must be positive"),  # was a ZeroDivisionError
    ("model.moe_intermediate_size=0", r"moe_intermediate_size=0 must be positive \(MoE layers\)"),
])
def test_model_numbers_outside_their_range_are_named(override, message):
    from rlalign.config import model_args

    with pytest.raises(ValueError, match=message):
        model_args(load_config([override]))


@pytest.mark.parametrize("override, message", [
    ("generator.temperature=inf", r"generator\.temperature=inf: sampling needs a temperature > 0 and < inf"),
    ("generator.temperature=nan", r"generator\.temperature=nan: sampling needs a temperature > 0"),
    ("generator.top_k=65", r"generator\.top_k=65: more than the model's 64 token ids \(0 disables it\)"),
    ("generator.top_p=0", r"generator\.top_p=0(\.0)?: must be in \(0, 1\]"),
    ("generator.top_p=1e-310", r"generator\.top_p=1e-310: must be in \(0, 1\] and a normal double"),
    ("generator.temperature=1e-38", r"generator\.temperature=1e-38: outside \[3\.85e-34, 8\.51e\+37\]"),
    ("generator.temperature=1e39", r"generator\.temperature=1e\+39: outside \[3\.85e-34, 8\.51e\+37\]"),
    ("seed=9223372036854775808", r"seed=9223372036854775808: must be a signed 64-bit integer"),
])
def test_sampling_no_sampler_draws_with_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_negative_twin_sampling_at_the_edges_is_accepted():
    """top_k of the whole vocabulary (no cut), top_p 1, a huge finite temperature, the temperature range's ends and
    the least normal top_p, greedy at any temperature."""
    load_config(["generator.top_k=64", "generator.top_p=1", "generator.temperature=1e30"])
    load_config([f"generator.temperature={2.0 ** -111!r}", f"generator.top_p={sys.float_info.min!r}"])
    load_config([f"generator.temperature={2.0 ** 126!r}"])
    load_config(["generator.greedy=true", "generator.temperature=inf", "seed=9223372036854775807"])
