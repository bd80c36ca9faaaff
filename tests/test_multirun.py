"""--multirun: one job per combination of comma-separated values, each in its own run directory, every
job's config checked before the first runs, a table on stderr and a JSON line per job at the end. The
fast tests run the sweep with a stand-in for the RL run; the slow one trains two one-step runs."""

from __future__ import annotations

import json

import pytest

from rlalign import cli


@pytest.fixture
def runs(monkeypatch):
    """A stand-in for `rlalign train`'s run (no Ray): records each job's config and prints its summary."""
    import rlalign.cluster
    import rlalign.rl

    calls = []

    def fake(cfg, status=None):
        calls.append(cfg)
        if cfg.seed == 13:
            raise ValueError("task.path: no such file")
        if cfg.seed == 99:
            raise KeyboardInterrupt
        print(json.dumps({"run_dir": str(cfg.run.dir), "reward_last5": cfg.trainer.lr * 1000,
                          "mismatched_tokens_total": 0, "sync/weights_fp": f"fp{cfg.seed}"}))
        return 0

    monkeypatch.setattr(rlalign.rl, "main", fake)
    monkeypatch.setattr(rlalign.cluster, "connect", lambda *a, **k: False)
    return calls


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_sweep_runs_every_combination_in_its_own_run_dir(capsys, runs, tmp_path):
    rc, out, err = _run(capsys, "train", "-m", "trainer.lr=1e-4,3e-4", "seed=0,1", f"run.dir={tmp_path}")
    assert rc == 0, err
    assert [(c.trainer.lr, c.seed, c.run.dir) for c in runs] == [
        (1e-4, 0, f"{tmp_path}/0"), (1e-4, 1, f"{tmp_path}/1"), (3e-4, 0, f"{tmp_path}/2"), (3e-4, 1, f"{tmp_path}/3")]
    records = [json.loads(ln) for ln in out.strip().splitlines()[-4:]]
    assert [(r["job"], r["run_dir"], r["exit_code"], r["summary"]["sync/weights_fp"]) for r in records] == [
        (0, f"{tmp_path}/0", 0, "fp0"), (1, f"{tmp_path}/1", 0, "fp1"), (2, f"{tmp_path}/2", 0, "fp0"),
        (3, f"{tmp_path}/3", 0, "fp1")]
    assert records[2]["overrides"] == ["trainer.lr=0.0003", "seed=0", f"run.dir={tmp_path}/2"]
    assert (tmp_path / "multirun.jsonl").read_text().splitlines() == out.strip().splitlines()[-4:]
    table = err[err.index("rlalign train: multirun: 4 of 4 jobs exited 0"):].splitlines()
    assert table[1].split() == ["job", "exit", "trainer.lr", "seed", "reward_last5", "mismatched_tokens_total",
                                "sync/weights_fp", "run_dir"]
    assert table[4].split() == ["2", "0", "0.0003", "0", "0.3", "0", "fp0", f"{tmp_path}/2"]
    assert err.count("rlalign train: multirun job ") == 4


def test_without_multirun_a_sweep_is_refused_with_hydras_hint(capsys, runs):
    rc, out, err = _run(capsys, "train", "trainer.lr=1e-4,3e-4")
    assert rc == 2 and not runs and len(err.strip().splitlines()) == 1
    assert "Ambiguous value for argument 'trainer.lr=1e-4,3e-4'" in err and "add --multirun" in err


def test_every_jobs_config_is_checked_before_the_first_runs(capsys, runs, tmp_path):
    rc, out, err = _run(capsys, "train", "--multirun", "trainer.ep_size=1,3", f"run.dir={tmp_path}")
    assert rc == 2 and not runs and "multirun job 1 of 2 (trainer.ep_size=3): invalid config: trainer.ep_size=3 " \
                                    "does not divide" in err
    rc, out, err = _run(capsys, "train", "--multirun", "trainer.ep_size=1,2", f"run.dir={tmp_path}")  # twin
    assert rc == 0 and [c.trainer.ep_size for c in runs] == [1, 2]


def test_a_sweep_of_no_jobs_names_the_empty_value(capsys, runs, tmp_path):
    """An empty range sweeps nothing: refused naming it (it was an IndexError traceback). The twin: a range of
    one value runs one job."""
    rc, out, err = _run(capsys, "train", "-m", "seed=range(0,0)", "trainer.lr=1e-4,3e-4", f"run.dir={tmp_path}")
    assert rc == 2 and not runs and "the sweep has no jobs: seed=range(0,0) gives no value" in err, err
    rc, out, err = _run(capsys, "train", "-m", "seed=range(0,1)", f"run.dir={tmp_path}")
    assert rc == 0 and [c.seed for c in runs] == [0]


def test_a_failing_job_is_reported_and_the_sweep_goes_on(capsys, runs, tmp_path):
    rc, out, err = _run(capsys, "train", "-m", "seed=13,2", f"run.dir={tmp_path}")
    assert rc == 2 and [c.seed for c in runs] == [13, 2]
    assert "rlalign train: error: task.path: no such file" in err
    records = [json.loads(ln) for ln in out.strip().splitlines()[-2:]]
    assert [(r["exit_code"], r["summary"]) for r in records] == [(2, None), (0, records[1]["summary"])]
    assert "1 of 2 jobs exited 0" in err


def test_ctrl_c_ends_the_sweep_and_names_the_jobs_resume_command(capsys, runs, tmp_path):
    rc, out, err = _run(capsys, "train", "-m", "seed=99,1", f"run.dir={tmp_path}")
    assert rc == 130 and [c.seed for c in runs] == [99]
    lines = err.strip().splitlines()
    assert lines[-3].split()[:2] == ["0", "stopped"] and lines[-2].split()[:3] == ["1", "not", "run"]
    assert lines[-1].endswith(f"start again with: rlalign train seed=99 run.dir={tmp_path}/0 checkpoint.resume=auto")
    assert not (tmp_path / "multirun.jsonl").exists()


def test_a_swept_run_dir_is_each_jobs_own_and_hydra_sweep_dir_is_run_dir(capsys, runs, tmp_path):
    assert _run(capsys, "train", "-m", f"run.dir={tmp_path}/a,{tmp_path}/b")[0] == 0
    assert [c.run.dir for c in runs] == [f"{tmp_path}/a", f"{tmp_path}/b"]
    assert _run(capsys, "train", "-m", "seed=0,1", f"hydra.sweep.dir={tmp_path}/s")[0] == 0
    assert [c.run.dir for c in runs[2:]] == [f"{tmp_path}/s/0", f"{tmp_path}/s/1"]


def test_cfg_job_prints_every_jobs_config(capsys, runs, tmp_path):
    rc, out, err = _run(capsys, "train", "-m", "--cfg", "job", "trainer.lr=0.1,0.2", f"run.dir={tmp_path}")
    assert rc == 0 and not runs
    assert [ln for ln in out.splitlines() if ln.startswith(("# multirun job", "  lr:", "  dir:"))] == [
        f"# multirun job 0: trainer.lr=0.1 run.dir={tmp_path}/0", "  lr: 0.1", f"  dir: {tmp_path}/0",
        f"# multirun job 1: trainer.lr=0.2 run.dir={tmp_path}/1", "  lr: 0.2", f"  dir: {tmp_path}/1"]


def test_an_agree_sweep_writes_no_run_dir(capsys, monkeypatch, tmp_path):
    import rlalign.agree

    def fake(cfg):
        print(json.dumps({"tokens": 4, "mismatched_tokens": 0, "max_abs_diff": 0.0, "seed": cfg.seed}))
        return 0

    monkeypatch.setattr(rlalign.agree, "main", fake)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "agree", "-m", "seed=0,1")
    records = [json.loads(ln) for ln in out.strip().splitlines()[-2:]]
    assert rc == 0 and [(r["run_dir"], r["summary"]["seed"]) for r in records] == [(None, 0), (None, 1)]
    assert "run_dir" not in err and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_two_one_step_training_runs(capsys, tmp_path):
    """In this process: the jobs run on the pytest process's Ray cluster (tests/conftest.py)."""
    small = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=4", "trainer.ep_size=1",
             "run.steps=1", "checkpoint.enabled=false", "monitor.fingerprints=off"]
    rc, out, err = _run(capsys, "train", "-m", "seed=0,1", *small, f"run.dir={tmp_path}")
    assert rc == 0, err[-3000:]
    records = [json.loads(ln) for ln in out.strip().splitlines()[-2:]]
    assert [r["run_dir"] for r in records] == [f"{tmp_path}/0", f"{tmp_path}/1"]
    for r in records:
        assert r["exit_code"] == 0 and r["summary"]["mismatched_tokens_total"] == 0
        assert len((tmp_path / str(r["job"]) / "metrics.jsonl").read_text().splitlines()) == 1
    fps = [r["summary"]["sync/weights_fp"] for r in records]
    assert fps[0] != fps[1]  # the seed reached each run
    assert "2 of 2 jobs exited 0" in err
