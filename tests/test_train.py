"""The RL job on a local Ray cluster: metrics, corrections, resume, W&B, traces of resumed runs
(`rlalign compare`), bad input and faults.

One uninterrupted run (`full`: `rlalign train` as a process of its own, 3 steps at trainer EP 2,
W&B offline) is the reference that the interrupted-and-resumed runs must equal bit for bit (metrics
and traces); one run with the default kernels serves the corrections' metrics and the W&B tables
of a mismatching run."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import flip_checkpoint_bit, train_cli_with_fault
from procs import alive, cmdline, descendants
from wandb_read import history_by_step, logged_table

from rlalign.config import ConfigError, load_config
from rlalign.rl import RewardError, train

pytestmark = pytest.mark.slow

REQUIRED = ["step", "reward/mean", "consistency/mismatched_tokens", "consistency/tokens",
            "consistency/mismatch_token_frac", "consistency/logprob_abs_diff_max", "time/step_s"]
SMALL = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=4"]
ONE_TRAINER = [*SMALL, "trainer.ep_size=1"]  # one trainer actor: for tests whose check does not depend on the EP size
WANDB = ["logger=wandb", "logger.wandb.mode=offline"]
# the uninterrupted run and the resumed ones: a checkpoint after step 1 (the first with AdamW moments
# that are not 0) and after the last step; trainer EP 2 (two trainer traces), KL to the reference model
RESUMABLE = [*SMALL, "checkpoint.every=2", "algorithm.kl_coef=0.01"]


def _rows(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rlalign.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def full(runs):
    """`rlalign train` as a process of its own (its own Ray cluster): RESUMABLE for 3 steps at trainer
    EP 2 and generator EP 1, W&B offline with a sample table every step: (run dir, the finished process,
    seconds)."""
    d = runs / "full"
    t = time.perf_counter()
    p = _cli("train", *RESUMABLE, "run.steps=3", f"run.dir={d}", "trainer.ep_size=2", "generator.ep_size=1", *WANDB,
             "logger.wandb.sample_table_every=1")
    return d, p, time.perf_counter() - t


@pytest.fixture(scope="module")
def resumed(runs):
    """RESUMABLE stopped after step 1 (run.steps=2), then resumed in its run dir to step 2; both
    segments colocated: the generator gives its memory back after each generate and takes it back
    for the weight sync (rlalign.rollout.generator.releases_memory). Returns the run dir and a copy
    of it as it was before the resume (never changed)."""
    d, before = runs / "part", runs / "part-before-resume"
    colocated = [*RESUMABLE, "placement.colocate=true", "logger.console=false", f"run.dir={d}"]
    train(load_config([*colocated, "run.steps=2"]))
    shutil.copytree(d, before)
    train(load_config([*colocated, "run.steps=3", "checkpoint.resume=auto"]))
    return d, before


def test_train_three_steps_trainer_ep2_generator_ep1(full):
    d, p, wall = full
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(d)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert all(k in r for k in REQUIRED)
        assert r["consistency/mismatched_tokens"] == 0 and r["consistency/tokens"] > 0
        assert r["consistency/logprob_abs_diff_max"] == 0.0
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["mismatched_tokens_total"] == 0
    err = p.stderr.splitlines()  # start-up phases as they begin, a line per step, the closing line
    phases = [ln.split("] ", 1)[1] for ln in err if re.match(r"rlalign train: \[\d+\.\d s\] ", ln)]
    assert phases[:3] == ["starting Ray (a private local cluster)",
                          "starting 2 trainer ranks (EP 2), each building its model shard",
                          "starting 1 generator rank (EP 1, native engine)"], err
    steps = [ln for ln in err if ln.startswith("[")]
    assert [s.split("  ")[0] for s in steps] == ["[1/3] step 0", "[2/3] step 1", "[3/3] step 2"]
    assert all(f" {k} " in s for s in steps for k in ("loss", "kl", "tok/s", "ETA")) and all(
        " mismatched 0/" in s for s in steps)
    assert f"rlalign train: done: run.steps=3 in {d}; 0 of {summary['tokens_total']} tokens differ " in p.stderr
    print(f"rlalign train run.steps=3 (Ray start-up included): {wall:.1f}s")


@pytest.fixture(scope="module")
def default_kernels(runs):
    """One step with the default kernels (fp32, trainer EP 1), TIS and ICEPOP on, per-op row
    fingerprints, W&B offline: a run whose generator and trainer disagree."""
    d = runs / "default-kernels"
    train(load_config([*ONE_TRAINER, "run.steps=1", f"run.dir={d}", "kernels.mode=default", "model.dtype=float32",
                       "algorithm.tis.enabled=true", "algorithm.icepop.enabled=true", "monitor.fingerprints=layers",
                       "logger.console=false", *WANDB]))
    return d


def test_default_kernels_train_report_mismatch_and_corrections(default_kernels):
    rows = _rows(default_kernels)
    assert all(r["consistency/mismatched_tokens"] > 0 for r in rows)
    for key in ("tis/weight_mean", "tis/weight_max", "tis/weight_min", "tis/clipped_frac", "icepop/masked_frac"):
        assert all(key in r for r in rows), key
    assert rows[0]["tis/weight_max"] != 1.0 or rows[0]["tis/weight_min"] != 1.0


def test_a_user_loss_trains_at_trainer_ep_2_and_the_step_logs_its_metrics(tmp_path, monkeypatch):
    """algorithm.loss from a file given relative to the driver's working directory, which is not the
    ranks' (the trainer actors import it at its absolute path): GSPO plus a metric of its own, whose
    micro-batch values the driver sums over both trainer ranks; the built-in metrics it passes on are
    logged too, and none that it does not return."""
    import ray

    from rlalign import cluster

    cluster.disconnect(cluster.connect())  # Ray up (its workers' working directory) before the chdir
    (tmp_path / "my_loss.py").write_text(
        "from rlalign.training.losses import gspo_loss\n\n"
        "def loss(batch, alg):\n"
        "    value, metrics = gspo_loss(batch, alg)\n"
        "    return value, {**metrics, 'mine/sequences': float(len(batch.lengths))}\n")
    monkeypatch.chdir(tmp_path)
    # twin: a rank does not see the relative path itself
    assert not ray.get(ray.remote(num_cpus=0)(lambda: Path("my_loss.py").exists()).remote())
    train(load_config([*SMALL, "run.steps=1", "run.dir=run", "algorithm=gspo", "algorithm.name=gspo+",
                       "algorithm.loss=my_loss.py:loss", "checkpoint.enabled=false"]))
    row = _rows(tmp_path / "run")[0]
    assert row["mine/sequences"] == 16.0 and row["consistency/mismatched_tokens"] == 0
    assert row["actor/ratio_mean"] == 1.0 and "actor/pg_loss" in row and "kl/ref_k3" not in row


def test_a_mismatching_run_logs_the_worst_tokens_and_the_first_divergent_op_to_wandb(default_kernels):
    d = default_kernels
    steps, run = history_by_step(d)
    row = steps[0]
    assert row["consistency/mismatched_tokens"] > 0
    cols, data = logged_table(run, row, "consistency/worst_tokens")
    assert cols == ["sample_id", "position", "token", "text", "generator_logprob", "trainer_logprob", "abs_diff",
                    "first_op"]
    detail = json.loads((d / "divergence.jsonl").read_text().splitlines()[0])
    assert len(data) == len(detail["worst_tokens"]) > 0
    assert [r[6] for r in data] == [w["abs_diff"] for w in detail["worst_tokens"]]
    from rlalign.tasks.tokenizer import make_tokenizer

    tok = make_tokenizer(None)  # the default task's 'char' tokenizer
    assert [r[3] for r in data] == [tok.decode([r[2]]) for r in data] and all(isinstance(r[3], str) for r in data)
    first = {(t["sample_id"], t["position"] + 1): t["first_op"] for t in detail["tokens"]}
    assert [r[7] for r in data] == [first[(r[0], r[1])] for r in data] and any(r[7] for r in data)
    cols, data = logged_table(run, row, "consistency/divergence_by_op")
    assert cols == ["op", "differing_rows", "first_divergence_tokens"]
    assert {r[0]: r[1] for r in data} == detail["by_op"]
    assert sum(r[2] for r in data) == sum(detail["first_op_counts"].values())
    from rlalign.monitor.report import make_report

    text = (make_report(d) / "summary.md").read_text()
    worst = max(detail["worst_tokens"], key=lambda w: w["abs_diff"])
    assert "## worst tokens of the run" in text and f"| 0 | {worst['sample_id']} | {worst['position']} |" in text
    assert "| token | text |" in text


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(full, resumed):
    """full (not colocated, a process of its own) == part (colocated; stopped after step 1, resumed):
    no bit changes."""
    full, part = full[0], resumed[0]
    assert (resumed[1] / "checkpoints" / "step_000001" / "meta.json").is_file()
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    a, b = strip(_rows(full)), strip(_rows(part))
    assert [r["step"] for r in b] == [0, 1, 2]
    assert a == b  # rewards, losses, grad norms, mismatch, weight fingerprints: every value
    assert a[1]["actor/grad_norm"] > 0  # the checkpoint resumed from holds AdamW moments that are not 0
    meta = lambda d: json.loads((d / "checkpoints" / "step_000002" / "meta.json").read_text())  # noqa: E731
    assert meta(full)["weights_fp"] == meta(part)["weights_fp"] == a[-1]["sync/weights_fp"]


def test_wandb_offline_run_holds_metrics_and_config(full):
    pytest.importorskip("wandb")
    d = full[0]
    runs = list((d / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    from wandb_read import read_offline_run

    history, config = read_offline_run(runs[0])
    assert config["trainer"]["ep_size"] == 2 and config["task"]["name"] == "repeat"
    steps = [h for h in history if "reward/mean" in h]
    assert [h["_step"] for h in steps] == [0, 1, 2]
    jsonl = _rows(d)
    assert [h["reward/mean"] for h in steps] == [r["reward/mean"] for r in jsonl]
    assert all(h["consistency/mismatched_tokens"] == 0 for h in steps)


def _compare_cli(capsys, a, b):
    """`rlalign compare A B` in this process: (exit status, stdout, stderr)."""
    from rlalign import cli

    capsys.readouterr()
    rc = cli.main(["compare", str(a), str(b)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_rlalign_compare_of_resumed_runs_and_of_one_resumed_on_other_weights(full, resumed, tmp_path, capsys):
    """The traces (two trainer ranks, one generator rank) of the run resumed in its run dir, and of
    one resumed from the same checkpoint into a new run dir, equal the uninterrupted run's.
    Negative twin: resumed on other weights (one bit of lm_head.weight flipped in a loadable
    checkpoint)."""
    full, (part, before) = full[0], resumed
    ckpt = before / "checkpoints" / "step_000001"

    def run(d, *over):
        train(load_config([*RESUMABLE, "logger.console=false", "run.steps=3", f"run.dir={d}", *over]))

    rc, out, err = _compare_cli(capsys, full, part)
    assert rc == 0 and out.count("identical:") == 3, out + err
    run(tmp_path / "fresh", f"checkpoint.resume={ckpt}")  # resumed into a new run dir
    rc, out, err = _compare_cli(capsys, full, tmp_path / "fresh")
    assert rc == 0 and out.count("identical:") == 3, out + err
    assert "B begins at a resume (step 2) without the earlier steps" in out
    pert = tmp_path / "pert"
    shutil.copytree(before, pert)
    flip_checkpoint_bit(pert / "checkpoints" / "step_000001", "model/lm_head.weight")
    run(pert, "checkpoint.resume=auto")
    rc, out, err = _compare_cli(capsys, full, pert)
    assert rc == 1, out + err
    assert "first difference at record" in out and "B: step 1 rank 0 weights/lm_head.weight" in out


def _fails_fast(overrides, match, exc=(ConfigError, ValueError, FileNotFoundError)):
    from rlalign import cluster

    def refuse(*a, **k):
        raise AssertionError("train() reached the Ray cluster: the bad input was not caught first")

    real, cluster.connect = cluster.connect, refuse  # failed before any cluster or actor started
    try:
        with pytest.raises(exc, match=match):
            train(load_config(overrides))
    finally:
        cluster.connect = real


def test_bad_input_fails_before_any_actor(tmp_path):
    _fails_fast(["task=jsonl", f"task.path={tmp_path}/missing.jsonl"], "dataset file does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a:", "answer": "aa"}\n{"prompt": "b:", "answer": \n')
    _fails_fast(["task=jsonl", f"task.path={bad}"], r"bad.jsonl:2: malformed JSON")
    shape = tmp_path / "shape.jsonl"
    shape.write_text('{"prompt": "a:", "answer": "aa"}\n{"question": "b:"}\n')
    _fails_fast(["task=jsonl", f"task.path={shape}"], r"shape.jsonl:2: expected an object")
    _fails_fast(["task.name=jsonl", f"task.path={shape}"],  # the repeat option's kwargs kept: named, with the fix
                r"task.kwargs=\{'letters': 'abcdefgh', 'length': 4\} for task 'jsonl': got an unexpected keyword "
                r"argument 'letters' \(.*choose it with task=jsonl, not task.name=jsonl")
    _fails_fast(["task.reward=nosuchpkg.rewards:score"], r"cannot import module 'nosuchpkg.rewards'")
    _fails_fast(["task.reward=rlalign.tasks.rewards:nope"], r"has no function 'nope'")
    with pytest.raises(ConfigError, match="trainer.ep_size=3 does not divide"):
        load_config(["trainer.ep_size=3"])
    with pytest.raises(ConfigError, match="unknown config key 'trainer.lrr'"):
        load_config(["trainer.lrr=0.1"])
    for key, match in (("generator.temperature=0", "sampling needs a temperature > 0"),
                       ("generator.temperature=-1", "sampling needs a temperature > 0"),
                       ("run.steps=0", r"run.steps=0: must be >= 1"), ("run.steps=-1", r"run.steps=-1"),
                       ("run.dir=''", r"run.dir='': must name a directory"),
                       ("placement.num_cpus=0", r"placement.num_cpus=0(\.0)?: the local Ray cluster's CPUs, >= 1")):
        with pytest.raises(ConfigError, match=match):
            load_config([key])
    load_config(["placement.num_cpus=1", "placement.num_cpus=null"])  # twin: one CPU, or all of them
    (tmp_path / "a_file").write_text("")
    for under in ("a_file", "a_file/run"):  # run.dir a file, or below one
        _fails_fast([f"run.dir={tmp_path / under}"], rf"run.dir {tmp_path / under}: a file, or below one, not a "
                                                     "directory", NotADirectoryError)
    # every line of a dataset is checked, not the first two: an over-long prompt at line 31, a
    # line that is not UTF-8
    long = tmp_path / "long.jsonl"
    lines = ['{"prompt": "a:", "answer": "aa"}'] * 30 + ['{"prompt": "' + "a" * 300 + ':", "answer": "aa"}']
    long.write_text("\n".join(lines) + "\n")
    _fails_fast(["task=jsonl", f"task.path={long}"],
                r"long.jsonl:31: the prompt has 301 tokens; with task.max_new_tokens=48 it exceeds")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a:", "answer": "aa"}\n{"prompt": "caf\xe9:", "answer": "x"}\n')
    _fails_fast(["task=jsonl", f"task.path={latin}"], r"latin.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)")
    # the reward function runs once before Ray: a non-number and a NaN are named
    _fails_fast(["task.reward=tests.test_train:reward_as_text"], r"returned '1.0' \(str\).*must be a real number",
                exc=RewardError)
    _fails_fast(["task.reward=tests.test_train:reward_nan"], r"returned nan on the answer of .*must be finite",
                exc=RewardError)
    # a model directory whose tensor has the wrong shape: found from the headers, before Ray
    from safetensors.torch import load_file, save_file

    from rlalign.model import save_hf
    from rlalign.model.build import model_from_config

    save_hf(model_from_config(load_config([])), tmp_path / "model")
    t = load_file(tmp_path / "model" / "model.safetensors")
    t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()
    save_file(t, tmp_path / "model" / "model.safetensors")
    _fails_fast([f"model.path={tmp_path / 'model'}"], r"model.safetensors: tensor 'model.norm.weight' has shape")


def reward_as_text(completion, answer, prompt):
    return "1.0"


def reward_nan(completion, answer, prompt):
    return float("nan")


def reward_nan_unless_answer(completion, answer, prompt):
    return 1.0 if completion == answer else float("nan")


def test_a_nan_reward_during_the_run_is_an_error_naming_the_sample(tmp_path):
    cfg = load_config([*ONE_TRAINER, "run.steps=1", f"run.dir={tmp_path}",
                       "task.reward=tests.test_train:reward_nan_unless_answer"])
    with pytest.raises(RewardError, match=r"returned nan on sample \d+ \(step 0, prompt '.:'"):
        train(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing was applied to the weights or logged


def raise_on_second_sample(completion, answer, prompt):
    raise_on_second_sample.calls = getattr(raise_on_second_sample, "calls", 0) + 1
    if raise_on_second_sample.calls == 2:
        raise ZeroDivisionError("boom")
    return 0.0


def test_reward_error_is_reported_with_the_sample(tmp_path):
    cfg = load_config([*ONE_TRAINER, "run.steps=1", f"run.dir={tmp_path}",
                       "task.reward=tests.test_train:raise_on_second_sample"])
    # call 1 is the check before the run (on an answer), call 2 the first sample of step 0
    msg = r"sample 0 \(step 0, prompt '.:', completion '.*'\): ZeroDivisionError: boom"
    with pytest.raises(RewardError, match=msg):
        train(cfg)


def _trainer_processes() -> list[int]:
    """This process's Ray cluster's trainer ranks (the module's cluster: its raylet is our child)."""
    return [p for p in alive(descendants(os.getpid())) if cmdline(p).startswith("ray::TrainerWorker")]


def test_a_generator_rank_dying_at_start_ends_the_run_and_the_trainer_ranks_starting_beside_it(tmp_path, capsys,
                                                                                              monkeypatch):
    """The two groups start at once (rlalign.job): a generator rank that exits while building its worker ends the
    run naming it, and the trainer ranks that were building beside it are killed, not left on the cluster (nor
    the placement: the twin's run after it is placed on the same cluster). Twin: with the groups' kills and the
    job's release left out (the groups and the placement kept), the trainer ranks outlive the run."""
    from rlalign import job
    from rlalign.actors import group

    args = [*SMALL, "run.steps=1", "checkpoint.enabled=false"]
    rc, err = train_cli_with_fault("exit:generator.start:0:1", [*args, f"run.dir={tmp_path / 'a'}"], capsys,
                                   monkeypatch)
    assert rc == 2
    assert re.search(r"rlalign train: error: generator rank 0 of 1 \(node [0-9.]+\) failed in start\(\)", err), err
    t = time.monotonic()
    while _trainer_processes() and time.monotonic() - t < 30:  # a killed actor's process exits a little later
        time.sleep(0.2)
    assert not _trainer_processes()
    kept, release = [], job.Job._release
    monkeypatch.setattr(job.Job, "_release", lambda self: kept.append(self))
    monkeypatch.setattr(group.ActorGroup, "kill", lambda self: None)
    try:
        rc, err = train_cli_with_fault("exit:generator.start:0:1", [*args, f"run.dir={tmp_path / 'b'}"], capsys,
                                       monkeypatch)
        assert rc == 2 and "generator rank 0 of 1" in err, err
        assert len(_trainer_processes()) == 2
    finally:
        monkeypatch.undo()
        for j in kept:
            release(j)


@pytest.mark.parametrize("async_save", [False, True])
def test_crashed_actor_stops_the_driver_and_keeps_the_last_checkpoint(tmp_path, async_save, capsys, monkeypatch):
    from rlalign import checkpoint as ckpt

    rc, err = train_cli_with_fault("exit:trainer.train_step:1:3", [
        *SMALL, "run.steps=4", f"run.dir={tmp_path}", "checkpoint.every=1",
        f"checkpoint.async_save={str(async_save).lower()}"], capsys, monkeypatch)  # in-process: the module's Ray
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert re.match(r"rlalign train: error: trainer rank 1 of 2 \(node [0-9.]+\) failed in train_step\(\): ", line), \
        err[-3000:]
    assert f"; last complete checkpoint: {tmp_path}/checkpoints/step_00000" in line  # 0 or 1: the async write
    assert line.endswith(f"resume with: rlalign train {' '.join(SMALL)} run.steps=4 checkpoint.every=1 "
                         f"checkpoint.async_save={str(async_save).lower()} run.dir={tmp_path} checkpoint.resume=auto")
    done = sorted(d.name for d in (tmp_path / "checkpoints").iterdir())
    if async_save:  # step 1's checkpoint was written while step 2 ran: complete, a .tmp if the kill came first,
        # or gone: the write failed when its peer rank died and rank 0 removed the .tmp
        assert done in (["step_000000", "step_000001"], ["step_000000", "step_000001.tmp"], ["step_000000"]), done
    else:
        assert done == ["step_000000", "step_000001"]  # complete; nothing half-written left behind
    newest = ckpt.checkpoint_dir(tmp_path) / done[-1].removesuffix(".tmp")
    if not newest.is_dir():
        newest = ckpt.checkpoint_dir(tmp_path) / "step_000000"
    assert ckpt.newest_intact(tmp_path, tensors=True) == newest == ckpt.resolve_resume(tmp_path, "auto")
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1]
