"""The command line in-process: per-command help, --cfg, hydra.*, --version, one-line errors, Ctrl-C, a
closed stdout. (--multirun: tests/test_multirun.py; --config-dir: tests/test_config_search.py.)"""

import pytest
import yaml

from rlalign import cli
from rlalign.config import ConfigError

KEYS = ["trainer.ep_size", "generator.ep_size", "kernels.mode", "kernels.backend", "seed", "device"]


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err, cmd):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"rlalign {cmd}: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv", [["train", "--help"], ["agree", "-h"], ["gate", "--help"],
                                  ["gate", "baseline", "--help"], ["help", "train"]])
def test_per_command_help_lists_groups_and_keys(capsys, argv):
    rc, out, err = _run(capsys, *argv)
    assert rc == 0 and not err
    assert out.startswith(f"usage: rlalign {argv[0] if argv[0] != 'help' else argv[1]}")
    for group in ("model", "task", "kernels", "algorithm", "logger"):
        assert f"\n  {group} " in out
    assert "tiny-moe*" in out and "deterministic*" in out  # the defaults are marked
    for key in KEYS:
        assert f"  {key} " in out
    assert "RLALIGN_DEBUG=1" in out and "RAY_ADDRESS" in out
    if argv[0] == "train":
        assert "run.steps" in out and "run.dir" in out and "checkpoint.resume" in out
        assert "run.stop_grace_s" in out and "task.reward_timeout_s" in out and "143 stopped by SIGTERM" in out
    if argv[0] == "gate":
        assert "repeatability" in out and "gate.candidate" in out


def test_unknown_option_is_not_help(capsys):
    rc, out, err = _run(capsys, "train", "--hlep")
    assert rc == 2 and not out
    assert "unknown option '--hlep'" in _one_error_line(err, "train")


def _printed_cfg(capsys, *argv):
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    return yaml.safe_load(out)


def test_cfg_does_not_swallow_the_next_override(capsys):
    assert _printed_cfg(capsys, "train", "--cfg", "trainer.ep_size=1")["trainer"]["ep_size"] == 1
    assert _printed_cfg(capsys, "train", "--cfg")["trainer"]["ep_size"] == 2  # the default (twin)
    for form in (["--cfg", "job"], ["--cfg", "all"], ["--cfg=job"], ["-c", "job"]):
        cfg = _printed_cfg(capsys, "agree", *form, "kernels.mode=default", "seed=7")
        assert cfg["kernels"]["mode"] == "default" and cfg["seed"] == 7, form
    rc, out, err = _run(capsys, "train", "--cfg", "hydra")
    assert rc == 0 and out.startswith("#") and "run.dir" in out
    rc, out, err = _run(capsys, "train", "--cfg=yaml")
    assert rc == 2 and "expected one of job, hydra, all" in _one_error_line(err, "train")


def test_hydra_run_dir_is_run_dir_and_other_hydra_keys_are_refused(capsys, tmp_path):
    cfg = _printed_cfg(capsys, "train", "--cfg", f"hydra.run.dir={tmp_path}/x")
    assert cfg["run"]["dir"] == f"{tmp_path}/x"
    for bad in ("hydra.job.chdir=true", "hydra.sweep.dir=/tmp/s", "hydra/launcher=basic", "+hydra.verbose=true"):
        rc, out, err = _run(capsys, "train", bad)
        assert rc == 2 and not out
        line = _one_error_line(err, "train")
        assert bad in line and "hydra.run.dir=DIR is accepted as run.dir" in line


def test_multirun_is_in_the_help_and_other_hydra_options_are_named(capsys):
    out = _run(capsys, "train", "--help")[1]
    assert "-m, --multirun" in out and "--config-dir DIR, -cd DIR" in out and "--version" in out
    assert "not supported" not in out
    rc, out, err = _run(capsys, "train", "--config-path", "conf")
    assert rc == 2 and "add yours with --config-dir DIR" in _one_error_line(err, "train")


@pytest.mark.parametrize("argv", [["--version"], ["train", "--version"], ["agree", "--version"]])
def test_version_prints_the_package_version(capsys, argv):
    import rlalign

    rc, out, err = _run(capsys, *argv)
    assert rc == 0 and not err and out.startswith(f"rlalign {rlalign.__version__} (")
    assert rlalign.__version__ == "0.1.0"


def test_an_unknown_long_option_is_not_the_version(capsys):
    rc, out, err = _run(capsys, "--versoin")
    assert rc == 2 and not out and "unknown command '--versoin'" in err


def _closed_stdout(*argv, env=None):
    """`rlalign ARGV` writing into a pipe whose reader has gone (as `| head -1` leaves it)."""
    import os
    import subprocess
    import sys

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "rlalign.cli", *argv], stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=120, env={**os.environ, **(env or {})})
    finally:
        os.close(w)
    return p.returncode, p.stderr


@pytest.mark.parametrize("argv", [["train", "--help"], ["--help"], ["--version"], ["agree", "--cfg", "job"]])
def test_a_closed_pipe_is_not_an_error(argv):
    assert _closed_stdout(*argv) == (0, "")


def test_a_broken_pipe_elsewhere_stays_an_error(capsys, monkeypatch):
    import rlalign.rl

    def fail(cfg, status=None):
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a socket of the run's, while stdout is open

    monkeypatch.setattr(rlalign.rl, "main", fail)
    rc, out, err = _run(capsys, "train")
    assert rc == 2 and "Broken pipe" in _one_error_line(err, "train")
    rc, err = _closed_stdout("train", "--cfg", "job", "model=nope")  # an error with stdout closed: still one
    assert rc == 2 and err.startswith("rlalign train: error: model=nope: no such model option")


def _expected_errors():
    from rlalign.actors.group import ActorFailed
    from rlalign.checkpoint import CheckpointError
    from rlalign.rl import MismatchError, RewardError, SyncError

    return [ValueError("bad value"), FileNotFoundError("no such file: x.jsonl"), RewardError("reward raised"),
            MismatchError("step 0: 3 of 9 tokens differ"), SyncError("weight sync: tensor 'w' differs"),
            ConfigError("unknown config key 'x'"), OSError(28, "No space left on device"),
            RuntimeError("worker died"), CheckpointError("checkpoint damaged"),
            ActorFailed("trainer rank 1 of 2 failed in train_step():\nTraceback ...\nZeroDivisionError: boom"),
            ConnectionError("RAY_ADDRESS=h:1: no Ray cluster answers there")]


@pytest.mark.parametrize("i", range(11))
def test_expected_errors_are_one_line_and_exit_2(capsys, monkeypatch, i):
    import rlalign.rl

    exc = _expected_errors()[i]

    def fail(cfg, status=None):
        raise exc

    monkeypatch.setattr(rlalign.rl, "main", fail)
    monkeypatch.delenv("RLALIGN_DEBUG", raising=False)
    rc, out, err = _run(capsys, "train", "run.steps=1")
    assert rc == 2
    line = _one_error_line(err, "train")
    assert str(exc).splitlines()[0] in line and "Traceback" not in err.replace("Traceback ...", "")


def test_debug_switch_adds_the_traceback_and_bugs_keep_theirs(capsys, monkeypatch):
    import rlalign.rl

    def fail(cfg, status=None):
        raise ValueError("bad value")

    monkeypatch.setattr(rlalign.rl, "main", fail)
    monkeypatch.setenv("RLALIGN_DEBUG", "1")
    rc, out, err = _run(capsys, "train")
    assert rc == 2 and "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1] == "rlalign train: error: bad value"

    def bug(cfg, status=None):
        raise KeyError("not an input error")

    monkeypatch.delenv("RLALIGN_DEBUG")
    monkeypatch.setattr(rlalign.rl, "main", bug)
    with pytest.raises(KeyError):  # a bug is not dressed up as a one-line input error
        cli.main(["train"])


def test_a_cluster_refusal_names_no_resume_command_and_a_missing_extra_is_named(capsys, monkeypatch, tmp_path):
    import rlalign.rl
    from rlalign.actors.placement import PlacementError

    def fail_with(exc):
        def body(cfg, status=None):
            status["run_dir"] = tmp_path  # the run holds its directory, as before Ray starts
            raise exc
        return body

    refusal = "cannot place trainer.ep_size=2 + generator.ep_size=1 on this Ray cluster: it needs 3 GPUs"
    monkeypatch.setattr(rlalign.rl, "main", fail_with(PlacementError(refusal)))
    rc, out, err = _run(capsys, "train", f"run.dir={tmp_path}")
    assert rc == 2 and _one_error_line(err, "train") == f"rlalign train: error: {refusal}"
    monkeypatch.setattr(rlalign.rl, "main", fail_with(RuntimeError("worker died")))  # twin: a failure of the run
    rc, out, err = _run(capsys, "train", f"run.dir={tmp_path}")
    assert rc == 2 and f"worker died; no complete checkpoint in {tmp_path}" in _one_error_line(err, "train")

    missing = ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")
    monkeypatch.setattr(rlalign.rl, "main", fail_with(missing))
    rc, out, err = _run(capsys, "train", f"run.dir={tmp_path}")
    assert "No module named 'matplotlib' (an optional dependency: pip install 'rlalign[report]'); " in err
    monkeypatch.setattr(rlalign.rl, "main", fail_with(ModuleNotFoundError("No module named 'myrewards'",
                                                                          name="myrewards")))
    rc, out, err = _run(capsys, "train", f"run.dir={tmp_path}")  # twin: a user's module is no extra of ours
    assert "No module named 'myrewards'; " in _one_error_line(err, "train") and "pip install" not in err


def test_real_config_error_is_one_line(capsys):
    rc, out, err = _run(capsys, "agree", "trainer.micro_batch=3")
    assert rc == 2 and "valid keys under 'trainer'" in _one_error_line(err, "agree")
    rc, out, err = _run(capsys, "gate", "nope")
    assert rc == 2 and "unknown gate 'nope'; one of: " in _one_error_line(err, "gate")  # twin: nothing close
    rc, out, err = _run(capsys, "gate", "repeatabilty")
    assert rc == 2 and "unknown gate 'repeatabilty' (did you mean 'repeatability'?)" in _one_error_line(err, "gate")
    rc, out, err = _run(capsys, "gate")
    assert rc == 2 and "repeatability|baseline|replay" in _one_error_line(err, "gate")


@pytest.mark.parametrize("task", ["task=guess", "task.num_prompts=2", "task.samples_per_prompt=2"])
def test_agree_refuses_a_task_it_would_not_read(capsys, monkeypatch, task):
    ran = []
    monkeypatch.setattr("rlalign.agree.main", lambda cfg: ran.append(cfg) or 0)
    rc, out, err = _run(capsys, "agree", task)
    assert rc == 2 and not ran
    assert f"{task}: rlalign agree reads no task key" in _one_error_line(err, "agree") and "rlalign train" in err
    # twin: agree's own keys (and a key merely beginning with "task") reach the command
    rc, out, err = _run(capsys, "agree", "agree.num_prompts=2", "monitor.worst_tokens=3")
    assert rc == 0 and len(ran) == 1 and "task key" not in err


@pytest.mark.parametrize("key, instead", [
    ("run.dir=/elsewhere", "it writes no run directory: its result is the last stdout line, one JSON object"),
    ("hydra.run.dir=/elsewhere", "it writes no run directory"),  # read as run.dir=/elsewhere
    ("run.steps=3", "agree.num_prompts sizes its one batch"),
    ("checkpoint.resume=auto", "`rlalign export CHECKPOINT_DIR OUT_DIR`, then `rlalign agree model.path=OUT_DIR`"),
    ("+checkpoint.every=1", "it checks the weights of model.path"),
])
def test_agree_refuses_a_run_or_checkpoint_key_it_would_not_read(capsys, monkeypatch, key, instead):
    ran = []
    monkeypatch.setattr("rlalign.agree.main", lambda cfg: ran.append(cfg) or 0)
    rc, out, err = _run(capsys, "agree", key)
    given = key.removeprefix("hydra.")
    section = given.lstrip("+").split(".")[0]
    line = _one_error_line(err, "agree")
    assert rc == 2 and not ran and line.startswith(f"rlalign agree: error: {given}: rlalign agree reads no "
                                                   f"{section}.* key (") and instead in line
    # twin: seed, which agree reads (its prompts and sampling), reaches the command; so does the key in train
    rc, out, err = _run(capsys, "agree", "seed=3", "agree.num_prompts=2")
    assert rc == 0 and [cfg.seed for cfg in ran] == [3] and not err
    rc, out, err = _run(capsys, "train", "--cfg", "job", key)
    assert rc == 0 and not err


def _interrupt_after(run_dir, steps_with_meta, steps_without=()):
    def body(cfg, status=None):
        for s in (*steps_with_meta, *steps_without):
            d = run_dir / "checkpoints" / f"step_{s:06d}"
            d.mkdir(parents=True)
            if s in steps_with_meta:
                (d / "meta.json").write_text("{}")
        raise KeyboardInterrupt

    return body


def test_ctrl_c_names_the_last_complete_checkpoint_and_the_resume_command(capsys, monkeypatch, tmp_path):
    import rlalign.rl

    monkeypatch.setattr(rlalign.rl, "main", _interrupt_after(tmp_path, [1, 3], [4]))  # step 4 half-written
    rc, out, err = _run(capsys, "train", "seed=3", "checkpoint.resume=never", f"hydra.run.dir={tmp_path}")
    assert rc == 130
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"last complete checkpoint: {tmp_path}/checkpoints/step_000003;" in lines[0]
    assert lines[0].endswith(f"resume with: rlalign train seed=3 run.dir={tmp_path} checkpoint.resume=auto")


@pytest.mark.parametrize("then", [48, 64])
def test_a_start_with_another_model_than_its_checkpoint_gets_the_resume_with_that_model(capsys, monkeypatch,
                                                                                       tmp_path, then):
    import json

    import rlalign.rl

    model = {"hidden_size": then, "num_layers": 2, "path": None}
    (tmp_path / "segments.jsonl").write_text(json.dumps({"start_step": 0, "config": {"model": model}}) + "\n")
    monkeypatch.setattr(rlalign.rl, "main", _interrupt_after(tmp_path, [1]))
    rc, out, err = _run(capsys, "train", "model.hidden_size=64", f"run.dir={tmp_path}", "checkpoint.resume=auto")
    assert rc == 130 and len(err.strip().splitlines()) == 1
    if then == 48:
        assert "step_000001, written with model.hidden_size=48, which this start changes (segments.jsonl)" in err
        assert f"resume with: rlalign train model.hidden_size=48 run.dir={tmp_path} checkpoint.resume=auto;" in err
    else:  # twin: the same model as the checkpoint's, the plain hint with the start's own overrides
        assert err.strip().endswith(f"resume with: rlalign train model.hidden_size=64 run.dir={tmp_path} "
                                    "checkpoint.resume=auto") and "written with" not in err


def test_ctrl_c_without_a_checkpoint_says_so(capsys, monkeypatch, tmp_path):
    import rlalign.rl

    monkeypatch.setattr(rlalign.rl, "main", _interrupt_after(tmp_path, [], [0]))
    rc, out, err = _run(capsys, "train", f"run.dir={tmp_path}")
    assert rc == 130 and len(err.strip().splitlines()) == 1
    assert f"no complete checkpoint in {tmp_path}" in err and "checkpoint.resume=auto" in err


def test_a_start_from_a_checkpoint_given_by_path_is_resumed_from_it_again(capsys, monkeypatch, tmp_path):
    """A run started with checkpoint.resume=PATH that stops before its own first checkpoint: the hint resumes
    from PATH again (auto would have trained a new model from step 0 and dropped the checkpoint asked for).
    The twin: started with checkpoint.resume=auto, the hint keeps auto."""
    import rlalign.rl

    given = tmp_path / "other" / "checkpoints" / "step_000001"
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setattr(rlalign.rl, "main", _interrupt_after(a, [], [0]))
    rc, out, err = _run(capsys, "train", f"run.dir={a}", f"checkpoint.resume={given}")
    assert rc == 130 and err.strip().endswith(f"this run starts from checkpoint.resume={given}: mend what the error "
                                              f"names and run again: rlalign train run.dir={a} "
                                              f"checkpoint.resume={given}"), err
    monkeypatch.setattr(rlalign.rl, "main", _interrupt_after(b, [], [0]))
    rc, out, err = _run(capsys, "train", f"run.dir={b}", "checkpoint.resume=auto")
    assert rc == 130 and err.strip().endswith(f"start again with: rlalign train run.dir={b} "
                                              "checkpoint.resume=auto"), err


def test_ctrl_c_in_a_gate_is_one_line(capsys, monkeypatch, tmp_path):
    import rlalign.gates

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(rlalign.gates, "run_gate", interrupted)
    rc, out, err = _run(capsys, "gate", "repeatability", f"run.dir={tmp_path}")
    assert rc == 130 and err.strip() == "rlalign gate: interrupted"


@pytest.mark.parametrize("raised, rc", [("mismatch", 1), ("other", 2)])
def test_a_gate_run_stopped_by_a_mismatch_is_a_fail(capsys, monkeypatch, tmp_path, raised, rc):
    """A gate run that stops at a generator/trainer mismatch is the gate's FAIL (exit 1) with the mismatch's
    line; the twin: any other error of a run stays an error (exit 2)."""
    from rlalign import cluster, gates
    from rlalign.rl import MismatchError

    def train(cfg):
        if cfg.run.dir.endswith("/b"):
            raise (MismatchError if raised == "mismatch" else ValueError)("step 0: 3 of 9 tokens differ ... "
                                                                         "(first divergence: layers.1.attn)")

    monkeypatch.setattr(gates, "train", train)
    monkeypatch.setattr(cluster, "connect", lambda num_cpus: False)
    monkeypatch.setattr(cluster, "disconnect", lambda initialized: None)
    got, out, err = _run(capsys, "gate", "baseline", f"run.dir={tmp_path}", "run.steps=1")
    assert got == rc
    text = out + err
    assert ("gate baseline: FAIL (a run stopped: its generator and trainer disagree" in text) == (raised == "mismatch")
    assert "first divergence: layers.1.attn" in text


@pytest.mark.parametrize("argv, line", [
    (["train", "--cfg", "yml"], "--cfg yml: expected one of job, hydra, all"),  # was read as an override
    (["train", "trainer.ep_size=two"],
     "trainer.ep_size=two: Value 'two' of type 'str' could not be converted to Integer (the command line)"),
    (["train", "run.steps="], "run.steps=: Value '' of type 'str' could not be converted to Integer"),
    (["train", "trainer=big"], "trainer=big: trainer is a section of keys, not a config group: set its keys as "
                               "trainer.KEY=VALUE (--cfg job lists them); the groups: algorithm, kernels, logger, "
                               "model, task"),
    (["train", "+model=tiny-moe"], "model is chosen twice: the primary config chooses an option of model already, so "
                                   "write model=OPTION to replace it (+model=OPTION adds a second choice)"),
    (["gate", "baseline", "gate.candidate=[seed=1]"], "gate.candidate=[seed=1]: Hydra's override grammar cannot parse "
                                                      "it (no viable alternative at input '[seed=')"),
    (["gate", "replay", "run.steps=1"], "gate replay: run.steps=1: needs run.steps >= 2"),  # not replay_step=-1
])
def test_a_bad_override_is_one_line_naming_it(capsys, argv, line):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and not out and line in _one_error_line(err, argv[0]), err


def test_negative_twin_the_same_overrides_written_right_compose(capsys):
    assert _printed_cfg(capsys, "train", "--cfg", "job", "--resolve", "trainer.ep_size=1", "run.steps=3",
                        "model=tiny-moe")["trainer"]["ep_size"] == 1
    cfg = _printed_cfg(capsys, "gate", "baseline", "--cfg", 'gate.candidate=["seed=1"]')
    assert cfg["gate"]["candidate"] == ["seed=1"]


@pytest.mark.parametrize("removed", [True, False])
def test_a_working_directory_removed_under_the_process_is_named_in_one_line(capsys, tmp_path, monkeypatch, removed):
    """A driver whose directory was removed (Ray's job working_dir cache) gets one line saying so, not a bare
    [Errno 2] from the first relative path; twin: the same command in a directory that exists gets past it."""
    here = tmp_path / "job"
    here.mkdir()
    monkeypatch.chdir(here)
    if removed:
        here.rmdir()
    rc = cli.main(["train", "run.steps=nope"])
    err = capsys.readouterr().err
    assert rc == 2
    assert ("working directory no longer exists" in err) == removed, err
    if not removed:
        assert "run.steps" in err  # reached the config
