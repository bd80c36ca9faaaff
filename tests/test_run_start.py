"""What `rlalign train` does with its run directory and defaults before the first step, and what it
says on stderr: a run.dir holding another run's steps is refused (its negative twins: a fresh
directory, run.overwrite=true, checkpoint.resume=auto, a start that did no step), the default
checkpoint cadence sized to the run, the step line and the start-up lines. No Ray: the run itself
(rl._run) is replaced where the test is about what comes before it."""

from __future__ import annotations

import io
import json

import pytest

import rlalign.rl
from rlalign import checkpoint as ckpt
from rlalign import cli
from rlalign.agree import verdict
from rlalign.config import ConfigError, load_config
from rlalign.logger import Phases, eta_seconds, step_line
from rlalign.rl import Saves, done_line
from rlalign.rundir import claim_run_dir, held_run

METRICS = {"reward/mean": 0.03125, "actor/pg_loss": -0.0107, "response/length_mean": 4.78,
           "time/step_tok_per_s": 1312.4, "consistency/mismatched_tokens": 0, "consistency/tokens": 612,
           "consistency/logprob_abs_diff_max": 0.0, "time/step_s": 0.66}


def _finished_run(d, steps=3):
    """A run dir as a finished `run.steps=<steps>` run leaves it (metrics, segments, a checkpoint, traces)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.0}) + "\n" for s in range(steps)))
    (d / "segments.jsonl").write_text(json.dumps({"start_step": 0, "started": "2026-12-04T20:19:08",
                                                  "config": {"run": {"steps": steps}}}) + "\n")
    (d / "config.yaml").write_text("run:\n  steps: 3\n")
    last = ckpt.checkpoint_dir(d) / f"step_{steps - 1:06d}"
    last.mkdir(parents=True)
    (last / "meta.json").write_text("{}")
    (d / "traces").mkdir()
    (d / "traces" / "trainer-rank0.jsonl").write_text("{}\n")
    (d / "mismatch-step000001").mkdir()
    (d / "notes.txt").write_text("the user's, not the run's")
    return d


@pytest.fixture
def no_run(monkeypatch):
    """train() up to the steps: no Ray, no actors (the steps are what other modules test)."""
    from rlalign import cluster

    def refuse(*a, **k):
        raise AssertionError("reached the Ray cluster")

    monkeypatch.setattr(cluster, "connect", refuse)
    monkeypatch.setattr(rlalign.rl, "_run", lambda *a: {})


def test_held_run_names_the_steps_the_checkpoint_and_the_start(tmp_path):
    assert held_run(tmp_path / "absent") is None and held_run(tmp_path) is None
    (tmp_path / "segments.jsonl").write_text(json.dumps({"start_step": 0, "config": {}}) + "\n")
    assert held_run(tmp_path) is None  # a start that did no step holds no work
    d = _finished_run(tmp_path / "run")
    assert held_run(d) == ("a finished run: steps 0-2 of 3 in metrics.jsonl, checkpoint step_000002, started "
                           "2026-12-04T20:19:08", 3)
    assert claim_run_dir(d, "auto", False) is None  # continuing it is no overwrite
    assert claim_run_dir(d, str(ckpt.checkpoint_dir(d) / "step_000002"), False) is None  # one of its checkpoints


def test_a_run_dir_holding_a_finished_run_is_refused_in_one_line_and_left_as_it_was(tmp_path, capsys, no_run):
    d = _finished_run(tmp_path / "run")
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    rc = cli.main(["train", "run.steps=2", f"run.dir={d}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        f"rlalign train: error: run.dir {d} holds a finished run: steps 0-2 of 3 in metrics.jsonl, checkpoint "
        f"step_000002, started 2026-12-04T20:19:08; continue it with checkpoint.resume=auto and run.steps > 3, "
        f"choose another run.dir, or set run.overwrite=true to delete that run's files first"]
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != ".rlalign.lock"} == before
    other = ckpt.checkpoint_dir(_finished_run(tmp_path / "other")) / "step_000002"
    assert cli.main(["train", f"run.dir={d}", f"checkpoint.resume={other}"]) == 2  # another run's checkpoint
    assert "(checkpoint.resume=" in capsys.readouterr().err


def test_twins_a_fresh_dir_and_run_overwrite_true_run_and_overwrite_deletes_only_the_runs_files(tmp_path, capsys,
                                                                                             no_run):
    assert cli.main(["train", "run.steps=2", f"run.dir={tmp_path / 'fresh'}"]) == 0
    assert (tmp_path / "fresh" / "segments.jsonl").is_file()
    d = _finished_run(tmp_path / "run")
    capsys.readouterr()
    assert cli.main(["train", "run.steps=2", f"run.dir={d}", "run.overwrite=true"]) == 0
    err = capsys.readouterr().err
    assert f"rlalign train: run.overwrite=true: deleted a finished run: steps 0-2 of 3 in metrics.jsonl, checkpoint " \
           f"step_000002, started 2026-12-04T20:19:08 from {d}" in err
    left = sorted(p.name for p in d.iterdir())
    assert left == [".rlalign.lock", "checkpoints", "config.yaml", "notes.txt", "segments.jsonl"], left
    assert list((d / "checkpoints").iterdir()) == []  # the probe of its write rate made it again, empty
    assert [json.loads(ln)["config"]["run"]["steps"] for ln in (d / "segments.jsonl").read_text().splitlines()] == [2]


def _checkpointed_run(d, overrides):
    """A run dir as a run of `overrides` leaves it after step 1: its segment and a checkpoint of its trainer."""
    from omegaconf import OmegaConf

    from rlalign import kernels
    from rlalign.config import model_args
    from rlalign.export import model_meta
    from rlalign.rundir import record_segment
    from rlalign.training.trainer import Trainer

    cfg = load_config(overrides)
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    d.mkdir()
    record_segment(d, 0, None, OmegaConf.to_container(cfg, resolve=True), "")
    ckpt.save_shards(Trainer(cfg, None).checkpoint_state(), ckpt.tmp_path(d, 1))
    meta = {"data_position": 2, "weights_fp": "-", **model_meta(model_args(cfg), cfg.model.dtype, None)}
    return ckpt.complete(d, 1, meta, keep=0)


def test_a_resume_from_a_checkpoint_of_another_model_is_refused_before_ray_with_the_resume_hint(tmp_path, capsys,
                                                                                                 no_run):
    d = tmp_path / "run"
    path = _checkpointed_run(d, ["run.steps=2"])
    rc = cli.main(["train", f"run.dir={d}", "model.hidden_size=48", "checkpoint.resume=auto", "run.steps=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [  # the ranks' words (without a rank: the whole trainer), then the resume hint
        f"rlalign train: error: checkpoint {path} does not fit this run's model or config: tensor "
        f"'model/model.embed_tokens.weight' is BF16[64, 64] in shard-00001-model-00001-of-00001.safetensors, the "
        f"trainer holds BF16[64, 48]; it holds a model of hidden_size=64, num_hidden_layers=2, num_experts=8, "
        f"moe_intermediate_size=64, vocab_size=64 (its meta.json); last complete checkpoint: {path}, written with "
        f"model.hidden_size=64, which this start changes (segments.jsonl); resume with: rlalign train "
        f"run.steps=3 model.hidden_size=64 run.dir={d} checkpoint.resume=auto; or start afresh in another run.dir"]
    assert len((d / "segments.jsonl").read_text().splitlines()) == 1  # the refused start recorded no segment
    # twin: the checkpoint's own model resumes (on to the steps, which no_run replaces)
    assert cli.main(["train", f"run.dir={d}", "checkpoint.resume=auto", "run.steps=3"]) == 0
    assert f"rlalign train: resumed from {path} (step 1)" in capsys.readouterr().err


def test_logger_wandb_without_wandb_is_refused_before_the_run_dir_naming_the_extra(tmp_path, capsys, no_run,
                                                                                   monkeypatch):
    import importlib.util

    assert cli.main(["train", "run.steps=1", "logger=wandb", f"run.dir={tmp_path / 'with'}"]) == 0  # twin: installed
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    capsys.readouterr()
    assert cli.main(["train", "run.steps=1", "logger=wandb", f"run.dir={tmp_path / 'without'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "rlalign train: error: logger=wandb: No module named 'wandb' (an optional dependency: pip install "
        "'rlalign[wandb]')"]
    assert not (tmp_path / "without").exists()  # before the run dir is claimed, before Ray


def test_run_overwrite_with_a_resume_is_refused_as_a_contradiction():
    with pytest.raises(ConfigError, match=r"run.overwrite=true deletes the run that checkpoint.resume=auto would "
                                          r"continue: set one of them"):
        load_config(["run.overwrite=true", "checkpoint.resume=auto"])
    assert load_config(["run.overwrite=true"]).run.overwrite is True  # twin


@pytest.mark.parametrize("steps, every", [(1, 1), (3, 1), (10, 1), (11, 2), (20, 2), (50, 5), (499, 50),
                                          (10_000, 50)])
def test_the_default_checkpoint_cadence_is_a_tenth_of_the_run_at_most_50_steps(steps, every):
    assert load_config([]).checkpoint.every is None
    assert ckpt.checkpoint_every(None, steps) == every
    saved = [s for s in range(steps) if ckpt.is_due(s, every, steps)]
    gaps = [b - a for a, b in zip([-1, *saved], saved)]  # steps a crash just before each save loses
    assert saved[-1] == steps - 1 and max(gaps) <= max(1, -(-steps // 10)) and max(gaps) <= 50


def test_an_explicit_cadence_is_kept_and_0_saves_only_the_last_step(tmp_path):
    assert ckpt.checkpoint_every(0, 50) == 0 and ckpt.checkpoint_every(7, 50) == 7
    assert [s for s in range(20) if ckpt.is_due(s, 0, 20)] == [19]  # twin: what the old default lost
    assert Saves(load_config(["run.steps=20"]), tmp_path, -1).every == 2
    assert Saves(load_config(["run.steps=20", "checkpoint.every=0"]), tmp_path, -1).every == 0
    with pytest.raises(ConfigError, match=r"checkpoint.every=-1: must be >= 0"):
        load_config(["checkpoint.every=-1"])


def test_the_step_line_has_progress_reward_loss_length_rate_agreement_time_and_eta():
    assert step_line(3, 50, METRICS, 29.4) == ("[4/50] step 3  reward 0.031  loss -0.0107  len 4.8  1312 tok/s  "
                                               "mismatched 0/612  max|d| 0  0.66s  ETA 0:29")
    with_kl = step_line(3, 50, {**METRICS, "kl/old_new_k1": 0.5, "kl/old_new_k3": 0.25, "kl/ref_k3": 0.0012}, 3725)
    assert "loss -0.0107  kl 0.0012  len 4.8" in with_kl and with_kl.endswith("ETA 1:02:05")  # the reference's first
    assert "  kl 0.25  " in step_line(3, 50, {**METRICS, "kl/old_new_k1": 0.5, "kl/old_new_k3": 0.25}, None)
    bare = {k: v for k, v in METRICS.items() if k not in ("actor/pg_loss", "response/length_mean")}
    assert step_line(0, 2, bare, None) == ("[1/2] step 0  reward 0.031  1312 tok/s  mismatched 0/612  max|d| 0  "
                                           "0.66s")  # twin: what a step does not log is left out


def test_the_eta_leaves_out_the_warm_up_step_once_there_are_others():
    assert eta_seconds([], 10) is None
    assert eta_seconds([9.0], 10) == 90.0
    assert eta_seconds([9.0, 1.0, 2.0], 10) == 15.0


def test_start_up_lines_carry_the_seconds_since_the_start_and_are_silent_when_disabled():
    t, out = [100.0], io.StringIO()
    phase = Phases("rlalign train", out=out, clock=lambda: t[0])
    t[0] += 4.06
    phase("starting 2 trainer ranks")
    assert out.getvalue() == "rlalign train: [4.1 s] starting 2 trainer ranks\n"
    quiet = io.StringIO()
    Phases("rlalign train", enabled=False, out=quiet)("starting Ray")
    assert quiet.getvalue() == ""


def test_the_closing_lines_of_train_and_agree():
    summary = {"run_dir": "runs/x", "steps": 50, "mismatched_tokens_total": 0, "tokens_total": 31788}
    assert done_line(summary, "deterministic") == ("done: run.steps=50 in runs/x; 0 of 31788 tokens differ between "
                                                   "the generator's and the trainer's logprobs "
                                                   "(kernels.mode=deterministic)")
    assert verdict({"mismatched_tokens": 304, "tokens": 306, "kernels": "default", "max_abs_diff": 0.0045223}) == (
        "304 of 306 tokens differ between the generator's and the trainer's logprobs (kernels.mode=default; "
        "max |Δ logprob| 0.0045)")
    assert verdict({"mismatched_tokens": 0, "tokens": 3262, "kernels": "deterministic", "max_abs_diff": 0.0}) \
        .endswith("logprobs: bitwise agreement (kernels.mode=deterministic)")
