"""A user's config directory (--config-dir, hydra.searchpath) beside rlalign's own configs: its options
and experiment files compose with ours under the same typed schema; a missing option or config is
one line with the options closest first; a broken file is named with its line. Each with a twin."""

from __future__ import annotations

import pytest
import yaml

from rlalign import cli
from rlalign.config import ConfigError, ConfigSource, load_config

MY_MODEL = "# a smaller tiny MoE\nname: my-moe\nnum_layers: 1\nnum_experts: 4\n"
MY_TASK = "name: add\nmax_new_tokens: 6\nnum_prompts: 4\nkwargs:\n  max_operand: 9\n"
EXPERIMENT = """defaults:
  - config            # rlalign's primary config
  - override model: my-moe
  - override task: my-add
  - _self_
trainer:
  lr: 0.0003
  ep_size: 1
generator:
  temperature: 0.7
run:
  steps: 3
"""


@pytest.fixture
def user_dir(tmp_path):
    d = tmp_path / "myconf"
    (d / "model").mkdir(parents=True)
    (d / "task").mkdir()
    (d / "model" / "my-moe.yaml").write_text(MY_MODEL)
    (d / "task" / "my-add.yaml").write_text(MY_TASK)
    (d / "myexp.yaml").write_text(EXPERIMENT)
    return d


def _cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _error(capsys, *argv) -> str:
    rc, out, err = _cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and not out and len(lines) == 1, err
    assert lines[0].startswith("rlalign train: error: ") and "Traceback" not in err
    return lines[0]


def test_a_user_model_and_task_compose_with_ours(capsys, user_dir):
    rc, out, err = _cli(capsys, "train", "--cfg", "job", "--config-dir", str(user_dir), "model=my-moe", "task=my-add")
    assert rc == 0, err
    cfg = yaml.safe_load(out)
    assert (cfg["model"]["name"], cfg["model"]["num_layers"], cfg["model"]["num_experts"]) == ("my-moe", 1, 4)
    assert cfg["model"]["hidden_size"] == 64  # the schema's defaults fill what the file leaves out
    assert (cfg["task"]["name"], cfg["task"]["max_new_tokens"], cfg["task"]["kwargs"]) == ("add", 6, {"max_operand": 9})
    for form in (["-cd", str(user_dir)], [f"--config-dir={user_dir}"], [f"hydra.searchpath=[file://{user_dir}]"]):
        args = cli.parse("train", [*form, "model=my-moe"])
        assert load_config(args.overrides, source=args.source).model.num_layers == 1, form
    ours = load_config(["model=bench-moe", "task=reverse"], source=ConfigSource(str(user_dir)))  # ours stay
    assert (ours.model.name, ours.task.name) == ("bench-moe", "reverse")


def test_without_the_config_dir_the_names_are_refused_with_the_options(capsys, user_dir):
    line = _error(capsys, "train", "model=my-moe", "task=my-add")
    assert "model=my-moe: no such model option; the options, closest first: tiny-moe, " in line
    assert "; task=my-add: no such task option; the options, closest first: add, " in line
    assert "Config search path" not in line and "my-moe," not in line
    line = _error(capsys, "train", "model=qwen3-8b")
    assert line.split("closest first: ")[1].startswith("qwen3-30b-a3b-shape, qwen3-30b-a3b-rehearsal, ")
    line = _error(capsys, "train", "--config-dir", str(user_dir), "task=my-ad")
    assert "task=my-ad: no such task option; the options, closest first: my-add, " in line


def test_an_experiment_file_sets_many_keys(capsys, user_dir):
    rc, out, err = _cli(capsys, "train", "--cfg", "--config-dir", str(user_dir), "--config-name", "myexp",
                        "run.steps=5")
    assert rc == 0, err
    cfg = yaml.safe_load(out)
    assert (cfg["model"]["name"], cfg["task"]["name"], cfg["trainer"]["lr"], cfg["trainer"]["ep_size"]) \
        == ("my-moe", "add", 0.0003, 1)
    assert (cfg["generator"]["temperature"], cfg["run"]["steps"]) == (0.7, 5)  # the command line still wins
    plain = load_config([])  # twin: rlalign's own primary config sets none of them
    assert (plain.model.name, plain.trainer.lr, plain.generator.temperature, plain.run.steps) == \
        ("tiny-moe", 0.01, 1.0, 50)
    line = _error(capsys, "train", "--config-dir", str(user_dir), "--config-name", "myexpp")
    assert "--config-name myexpp: no myexpp.yaml in " in line and "closest first: myexp, config" in line


def test_the_schema_holds_for_a_users_files(user_dir):
    (user_dir / "model" / "typo.yaml").write_text("num_layer: 1\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'model.num_layer' in {user_dir}/model/typo.yaml "
                                          r"\(did you mean 'num_layers'\?\)"):
        load_config(["model=typo"], source=ConfigSource(str(user_dir)))
    (user_dir / "model" / "typo.yaml").write_text("num_layers: one\n")
    with pytest.raises(ConfigError, match=rf"{user_dir}/model/typo.yaml: model.num_layers: Value 'one'"):
        load_config(["model=typo"], source=ConfigSource(str(user_dir)))
    (user_dir / "model" / "typo.yaml").write_text("num_layers: 1\n")  # twin: the right key and type
    assert load_config(["model=typo"], source=ConfigSource(str(user_dir))).model.num_layers == 1
    (user_dir / "model" / "odd.yaml").write_text("num_experts: 6\n")  # validate() runs on it too
    with pytest.raises(ConfigError, match="trainer.ep_size=4 does not divide the model's num_experts=6"):
        load_config(["model=odd", "trainer.ep_size=4"], source=ConfigSource(str(user_dir)))


def test_a_users_file_that_ours_would_hide_is_refused(user_dir):
    (user_dir / "model" / "tiny-moe.yaml").write_text("num_layers: 1\n")
    with pytest.raises(ConfigError, match=r"model/tiny-moe.yaml: rlalign's own model/tiny-moe.yaml has this name .* "
                                          r"rename it \(e.g. model/my-tiny-moe.yaml\)"):
        load_config([], source=ConfigSource(str(user_dir)))
    (user_dir / "model" / "tiny-moe.yaml").rename(user_dir / "model" / "my-tiny-moe.yaml")  # twin
    assert load_config(["model=my-tiny-moe"], source=ConfigSource(str(user_dir))).model.num_layers == 1
    (user_dir / "config.yaml").write_text("defaults:\n  - config\n")
    with pytest.raises(ConfigError, match="and pass --config-name my-config"):
        load_config([], source=ConfigSource(str(user_dir)))


def test_an_experiment_file_without_the_primary_config_is_named(user_dir):
    """An experiment file whose defaults list lacks `- config` composes no schema sections; it is refused naming
    the file and the line to add (it was a ConfigAttributeError traceback, or Hydra's 'No match in the defaults
    list'). The twin: the same file with `- config` composes."""
    body = EXPERIMENT.replace("  - config            # rlalign's primary config\n", "")
    for name, text in (("noconf", body), ("plain", "trainer:\n  lr: 0.001\n")):
        (user_dir / f"{name}.yaml").write_text(text)
        with pytest.raises(ConfigError, match=rf"{user_dir}/{name}.yaml: its defaults list lacks `- config`"):
            load_config([], source=ConfigSource(str(user_dir), name))
    (user_dir / "withconf.yaml").write_text("defaults:\n  - config\n  - _self_\n" + "trainer:\n  lr: 0.001\n")
    assert load_config([], source=ConfigSource(str(user_dir), "withconf")).trainer.lr == 0.001


def test_a_missing_option_in_an_experiment_files_defaults_names_that_file(user_dir):
    """`- override model: nope` in an experiment file: the error names that file's defaults list (Hydra names
    the primary config, whose default the line replaces). The twin: on the command line the same option names
    no file."""
    (user_dir / "badexp.yaml").write_text(EXPERIMENT.replace("override model: my-moe", "override model: nope"))
    with pytest.raises(ConfigError, match=rf"model=nope \(in the defaults list of {user_dir}/badexp.yaml\): no such "
                                          r"model option"):
        load_config([], source=ConfigSource(str(user_dir), "badexp"))
    with pytest.raises(ConfigError, match=r"^model=nope: no such model option"):
        load_config(["model=nope"], source=ConfigSource(str(user_dir), "myexp"))


def test_invalid_yaml_names_the_file_and_line(capsys, monkeypatch, user_dir):
    (user_dir / "task" / "broken.yaml").write_text("name: add\nkwargs:\n  max_operand: [9\n  other: 1\n")
    monkeypatch.delenv("RLALIGN_DEBUG", raising=False)
    line = _error(capsys, "train", "--config-dir", str(user_dir), "task=broken")
    assert f"{user_dir}/task/broken.yaml:4:8: invalid YAML: " in line and "at line 3" in line
    monkeypatch.setenv("RLALIGN_DEBUG", "1")
    rc, out, err = _cli(capsys, "train", "--config-dir", str(user_dir), "task=broken")
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1] == line
    monkeypatch.delenv("RLALIGN_DEBUG")
    (user_dir / "task" / "broken.yaml").write_text("name: add\n")  # twin: the fixed file composes
    assert _cli(capsys, "train", "--cfg", "--config-dir", str(user_dir), "task=broken")[0] == 0


@pytest.mark.parametrize("argv, expected", [
    (["--config-dir", "NOPE"], "--config-dir NOPE: no such directory"),
    (["hydra.searchpath=[file://NOPE]"], "hydra.searchpath=[file://NOPE]: file://NOPE: no such directory"),
    (["hydra.searchpath=[s3://bucket]"], "expected file://DIR or pkg://PACKAGE"),
    (["--config-path", "x"], "--config-path: rlalign's own configs are part of the package"),
])
def test_a_config_dir_that_is_not_there_is_one_line(capsys, tmp_path, argv, expected):
    argv = [a.replace("NOPE", str(tmp_path / "nope")) for a in argv]
    assert expected.replace("NOPE", str(tmp_path / "nope")) in _error(capsys, "train", *argv)


def test_help_lists_the_users_options_and_the_experiments_choices(capsys, user_dir):
    out = _cli(capsys, "train", "--help", "--config-dir", str(user_dir), "--config-name", "myexp")[1]
    assert "\n  model      bench-moe, " in out and "my-moe*" in out and "my-add*" in out
    assert "tiny-moe*" not in out and "[0.0003]" in out
    out = _cli(capsys, "train", "--help")[1]  # twin: rlalign's own
    assert "tiny-moe*" in out and "my-moe" not in out and "[0.01]" in out


def test_cfg_hydra_prints_the_search_path(capsys, user_dir):
    out = _cli(capsys, "train", "--cfg", "hydra", "-cd", str(user_dir))[1]
    assert out.splitlines()[-1] == f"#   {user_dir}" and "first match wins" in out


def test_the_resume_command_and_the_gates_keep_the_config_dir(capsys, monkeypatch, user_dir, tmp_path):
    import rlalign.cluster
    import rlalign.gates
    import rlalign.rl

    def interrupted(cfg, status=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(rlalign.rl, "main", interrupted)
    rc, out, err = _cli(capsys, "train", "-cd", str(user_dir), "-cn", "myexp", f"run.dir={tmp_path}/run")
    assert rc == 130 and err.strip().endswith(f"start again with: rlalign train --config-dir {user_dir} "
                                              f"--config-name myexp run.dir={tmp_path}/run checkpoint.resume=auto")
    models = []
    monkeypatch.setattr(rlalign.cluster, "connect", lambda *a, **k: False)
    monkeypatch.setattr(rlalign.gates, "train", lambda cfg: models.append(cfg.model.name))
    monkeypatch.setattr(rlalign.gates, "compare_runs", lambda *a: rlalign.gates.Comparison())
    rlalign.gates.run_gate("repeatability", [], load_config([f"run.dir={tmp_path}/g"]), ConfigSource(str(user_dir),
                                                                                                      "myexp"))
    rlalign.gates.run_gate("repeatability", [], load_config([f"run.dir={tmp_path}/g"]))  # twin: rlalign's own
    assert models == ["my-moe", "my-moe", "tiny-moe", "tiny-moe"]
