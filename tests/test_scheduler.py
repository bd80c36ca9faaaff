"""What a cluster does to a job: preemption (SIGTERM), a scheduler's retry, two jobs on one run
dir, a hung reward; `rlalign compare` across trainer EP sizes; what an offline W&B run holds.

One uninterrupted run (`ref`: 3 steps, trainer EP 2, W&B offline) is the reference the preempted
and resumed runs must equal bit for bit. The runs here are in-process, on the pytest process's Ray
cluster (tests/conftest.py); a scheduler's SIGTERM is sent to this process.
"""

import contextlib
import importlib
import io
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlalign import checkpoint as ckpt
from rlalign import cli
from rlalign.config import load_config
from rlalign.tasks import read_jsonl
from rlalign.tasks.reward_calls import RewardCall, RewardCaller, RewardError
from rlalign.tasks.rewards import char_match

SMALL = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=4", "logger.console=false"]
REWARD = "task.reward=tests.test_scheduler:char_match_or_term"  # char_match; a signal on call RLALIGN_TEST_TERM_AT
BASE = [*SMALL, REWARD, "run.steps=3"]
CALLS = {"n": 0}
RELEASE = threading.Event()  # what the blocking reward waits for


def char_match_or_term(completion, answer, prompt=""):
    """char_match; sends this process SIGTERM (or $RLALIGN_TEST_SIGNAL; 'raise': raises instead) on its
    call number $RLALIGN_TEST_TERM_AT (as a scheduler would, at a point of the run the test chooses)."""
    CALLS["n"] += 1
    if CALLS["n"] == int(os.environ.get("RLALIGN_TEST_TERM_AT", "0")):
        what = os.environ.get("RLALIGN_TEST_SIGNAL", "SIGTERM")
        if what == "raise":
            raise ValueError("the verifier crashed")
        os.kill(os.getpid(), signal.Signals[what])
    return char_match(completion, answer)


def blocks_on_first_sample(completion, answer, prompt=""):
    """char_match, except that the first call of a step (call 2: call 1 is the check before the
    run) waits until RELEASE is set (a verifier whose sandbox hangs)."""
    CALLS["n"] += 1
    if CALLS["n"] == 2:
        RELEASE.wait()
    return char_match(completion, answer)


def _release(mod) -> None:
    """Let the blocked reward calls of `mod` return (they were left behind)."""
    mod.RELEASE.set()
    mod.RELEASE.clear()


def _this_module():
    """This file as the task imports it (tests.test_scheduler), whose CALLS the rewards count in."""
    return importlib.import_module("tests.test_scheduler")


def _rows(run_dir):
    rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _no_ray(monkeypatch):
    from rlalign import cluster

    def refuse(*a, **k):
        raise AssertionError("reached the Ray cluster")

    monkeypatch.setattr(cluster, "connect", refuse)


def _resume_cmd(run_dir, *over):
    return "rlalign train " + shlex.join([*over, f"run.dir={run_dir}", "checkpoint.resume=auto"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


# --- fast: the run-dir lock, reward calls, input forms ---------------------------------------------------
HOLD = ("import sys, time\nfrom rlalign.rundir import RunLock\n"
        "RunLock(sys.argv[1], 'rlalign train (the holder)').acquire()\nprint('held', flush=True)\ntime.sleep(600)\n")


def test_a_second_job_on_a_locked_run_dir_is_refused_and_a_crashed_jobs_lock_is_taken_over(tmp_path, capsys,
                                                                                        monkeypatch):
    import rlalign.rl

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        _no_ray(monkeypatch)
        rc = cli.main(["train", "run.steps=1", f"run.dir={tmp_path}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"rlalign train: error: run.dir {tmp_path} is in use by another rlalign job (host "
                                 f"{socket.gethostname()}, pid {holder.pid}, started ")
        assert err[0].endswith("command 'rlalign train (the holder)'); wait for it to end or choose another run.dir")
    finally:
        holder.kill()  # a crash: the file still names the holder, the kernel dropped its flock
        holder.wait()
    assert f'"pid": {holder.pid}' in (tmp_path / ".rlalign.lock").read_text()
    monkeypatch.setattr(rlalign.rl, "_run", lambda *a: {})  # the run itself is not what this test is about
    rc = cli.main(["train", "run.steps=1", f"run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"took over the lock of a job that ended without releasing it (host {socket.gethostname()}, pid " \
           f"{holder.pid}," in err
    assert (tmp_path / ".rlalign.lock").read_text() == ""  # released cleanly: empty
    rc = cli.main(["train", "run.steps=1", f"run.dir={tmp_path}"])  # twin: after a clean release, no note
    assert rc == 0 and "took over" not in capsys.readouterr().err


def test_reward_calls_time_out_naming_the_sample_or_score_the_fallback(capsys):
    from rlalign.tasks import Example

    class Task:
        def reward(self, completion, ex):
            if completion == "hang":
                RELEASE.wait()
            return float(len(completion))

    calls = [RewardCall(c, Example("p:", "a"), f"sample {i} (step 7)") for i, c in enumerate(["ab", "hang", "abc"])]
    with pytest.raises(RewardError, match=r"did not return within task.reward_timeout_s=0.2 s on sample 1 \(step 7\)"):
        RewardCaller(Task(), timeout_s=0.2, workers=2).score(calls, "step 7")
    values, timed_out = RewardCaller(Task(), timeout_s=0.2, fallback=-1.0, progress_s=0.05).score(calls, "step 7")
    assert values == [2.0, -1.0, 3.0] and timed_out == 1
    err = capsys.readouterr().err
    assert "on sample 1 (step 7); scored task.reward_timeout_fallback=-1" in err
    assert "rlalign train: step 7 rewards: 1 of 3 done after 0 s; the slowest running call for 0 s" in err
    # twin: without a time limit the same calls wait for the slow one
    threading.Timer(0.3, RELEASE.set).start()
    try:
        assert RewardCaller(Task(), timeout_s=None, workers=3).score(calls, "step 7") == ([2.0, 4.0, 3.0], 0)
    finally:
        RELEASE.set()
        RELEASE.clear()


@pytest.mark.parametrize("value,expected,note", [
    (True, 1.0, "returns bool; rlalign uses it as 1.0 / 0.0"),
    (torch.tensor(0.25), 0.25, "returns a 0-d torch.Tensor; rlalign uses its .item()"),
    (torch.tensor(True), 1.0, "returns a 0-d torch.Tensor"),
    (pytest.importorskip("numpy").float32(0.5), 0.5, None),
    (pytest.importorskip("numpy").bool_(False), 0.0, "returns a 0-d numpy.bool"),
])
def test_a_bool_or_0d_tensor_reward_is_converted_and_said_once(capsys, value, expected, note):
    from rlalign.tasks import Example

    class Task:
        def reward(self, completion, ex):
            return value

    caller = RewardCaller(Task())
    calls = [RewardCall("x", Example("p:", "a"), f"sample {i}") for i in range(3)]
    assert caller.score(calls, "step 0") == ([expected] * 3, 0)
    assert caller.score(calls, "step 1") == ([expected] * 3, 0)
    err = capsys.readouterr().err
    assert err.count("note:") == (1 if note else 0) and (note is None or note in err)


@pytest.mark.parametrize("value,match", [(torch.tensor([0.5, 0.5]), r"\(Tensor of shape \[2\]\).*must be a real"),
                                         ("1.0", r"'1.0' \(str\).*must be a real"),
                                         (torch.tensor(float("nan")), r"returned nan on sample 0.*must be finite")])
def test_negative_twin_other_reward_types_are_refused_naming_the_sample(value, match):
    from rlalign.tasks import Example

    class Task:
        def reward(self, completion, ex):
            return value

    with pytest.raises(RewardError, match=match):
        RewardCaller(Task()).score([RewardCall("x", Example("p:", "a"), "sample 0")], "step 0")


def test_stop_signals_request_then_abandon_and_are_restored_after():
    from rlalign.stop import StopSignals

    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals(["SIGUSR1"], grace_s=30) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)  # the first: a request, the run goes on
        assert stop.requested and not stop.abandoned
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGUSR1)  # the second: abandon at once
        assert stop.abandoned and stop.stopped("during step 3").exit_code == 128 + signal.SIGUSR1
    with StopSignals(["SIGUSR1"], grace_s=0.1) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(KeyboardInterrupt):
            threading.Event().wait(30)  # the grace period ends it
        assert stop.abandoned
    assert signal.getsignal(signal.SIGUSR1) == before and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    from rlalign.config import ConfigError

    for bad in ("SIGKILL", "SIGINT", "TERM"):  # twin: what may not be a stop signal
        with pytest.raises(ConfigError, match=rf"run.stop_signals=\['{bad}'\]: \['{bad}'\] not among"):
            load_config([f"run.stop_signals=[{bad}]"])


def test_jsonl_with_a_byte_order_mark_is_read(tmp_path):
    lines = '{"prompt": "a:", "answer": "aa"}\n{"prompt": "b:", "answer": "bb"}\n'
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    (tmp_path / "plain.jsonl").write_text(lines)
    assert read_jsonl(tmp_path / "bom.jsonl") == read_jsonl(tmp_path / "plain.jsonl")
    (tmp_path / "mid.jsonl").write_bytes(lines.encode() + b"\xef\xbb\xbf" + lines.encode())  # twin: not at the start
    with pytest.raises(ValueError, match=r"mid.jsonl:3: malformed JSON"):
        read_jsonl(tmp_path / "mid.jsonl")


def test_a_hanging_reward_in_the_check_before_the_run_is_named(monkeypatch):
    from rlalign.rl import train

    _no_ray(monkeypatch)
    mod = _this_module()
    mod.CALLS["n"] = 1  # the check's call is then call 2, the one that blocks
    try:
        with pytest.raises(RewardError, match=r"within task.reward_timeout_s=0.3 s on the answer of 'a:' \(a check "
                                              r"before the run\)"):
            train(load_config(["task.reward=tests.test_scheduler:blocks_on_first_sample", "task.reward_timeout_s=0.3",
                               "task.kwargs.letters=a"]))
    finally:
        _release(mod)


def test_error_lines_are_cut_at_a_word_boundary():
    from rlalign.actors.group import clip

    text = "Read error [127.0.0.1]:58020: Connection reset by peer while receiving the tensor"
    assert clip(text, 40) == "Read error [127.0.0.1]:58020 ..." and clip(text, 200) == text
    assert text[:35].endswith("Conne")  # twin: a plain slice cuts mid-word, as the line did


# --- slow: real runs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def write_stopped(runs):
    """`rlalign train` in this process whose step-1 checkpoint write hangs on trainer rank 0
    (RLALIGN_FAULT: set once the pytest process's Ray cluster is up, it reaches this run's actors
    through their runtime env, actors/group.py), stopped by SIGTERM to this process (sent, as a
    scheduler would, once the write has begun) with run.stop_grace_s=2: (run dir, exit status,
    stderr, seconds from the signal to the return)."""
    from rlalign import cluster

    d = runs / "write"
    cluster.disconnect(cluster.connect(load_config([]).placement.num_cpus))
    sent: list[float] = []

    def term_once_the_write_began():
        t = time.monotonic()
        while not (d / "checkpoints" / "step_000001.tmp").exists():
            if time.monotonic() - t > 300:  # the run failed before it: its error is the test's
                return
            time.sleep(0.2)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_once_the_write_began, daemon=True).start()
    os.environ["RLALIGN_FAULT"] = "hang:checkpoint.write:0:2"
    log = runs / "write.stderr"
    try:
        with _stderr_into(log):
            rc = cli.main(["train", *BASE, "checkpoint.every=1", "run.stop_grace_s=2", f"run.dir={d}"])
    finally:
        del os.environ["RLALIGN_FAULT"]
    err = log.read_text()
    assert sent, err[-3000:]
    return d, rc, err, time.monotonic() - sent[0]


@contextlib.contextmanager
def _stderr_into(path: Path):
    """sys.stderr and this process's file descriptor 2 (where Ray's C++ core writes, its SIGTERM
    stack dump among it) into one file, as a process of its own would have them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w", buffering=1) as f:
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.redirect_stderr(f):
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@pytest.mark.slow
def test_sigterm_while_a_checkpoint_write_hangs_abandons_it_and_names_the_last_intact_one(write_stopped):
    d, rc, err, seconds = write_stopped
    print(f"SIGTERM -> exit with run.stop_grace_s=2 and a hung checkpoint write: {seconds:.1f} s")
    assert rc == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlalign train: stopped by SIGTERM "), err[-3000:]
    # the signal lands while the step-1 save is being handed out or after: either it is abandoned past the
    # grace, or step 0's checkpoint covers the steps done and the run stops at once
    assert ("(abandoned: not done within run.stop_grace_s=2 s" in last
            or "at once: the checkpoint of step 0 covers the steps done" in last), last
    assert last.endswith(f"; last complete checkpoint: {d}/checkpoints/step_000000; resume with: "
                         + _resume_cmd(d, *BASE, "checkpoint.every=1", "run.stop_grace_s=2"))
    assert "SIGTERM received at time" not in err and "Traceback" not in err  # not Ray's stack dump
    # step 1 logged or not yet when the signal came (its hung checkpoint is waited for), or the step-1 save
    # handed out before the driver counts step 1 done (step 0's checkpoint covers the steps done)
    assert any(f"SIGTERM received: {plan}" in err for plan in (
        "stopping at once: the checkpoint of step 1 covers the steps done (waiting for its write)",
        "stopping at once: the checkpoint of step 0 covers the steps done",
        "finishing the step in flight and its checkpoint")), err
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000000", "step_000001.tmp"]
    assert ckpt.verify(d / "checkpoints" / "step_000000", tensors=True)["step"] == 0
    with pytest.raises(ckpt.CheckpointError, match="meta.json: missing"):  # twin: the half-written one
        ckpt.verify(d / "checkpoints" / "step_000001.tmp")
    assert ckpt.resolve_resume(d, "auto") == d / "checkpoints" / "step_000000"


@pytest.fixture(scope="module")
def ref(runs):
    """3 uninterrupted steps at trainer EP 2, a checkpoint after each, W&B offline (samples every
    2 steps)."""
    from rlalign.rl import train

    d = runs / "ref"
    summary = train(load_config([*BASE, "checkpoint.every=1", f"run.dir={d}", "logger=wandb",
                                 "logger.wandb.mode=offline", "logger.wandb.sample_table_every=2"]))
    return d, summary


@pytest.mark.slow
def test_resuming_after_the_hung_write_gives_the_uninterrupted_bits(write_stopped, ref, capsys):
    from rlalign.rl import train

    d = write_stopped[0]
    got = train(load_config([*BASE, "checkpoint.every=1", f"run.dir={d}", "checkpoint.resume=auto"]))
    err = capsys.readouterr().err
    assert f"rlalign train: resumed from {d}/checkpoints/step_000000 (step 0); running steps 1..2" in err
    assert "rlalign train: checkpoints an interrupted run left unfinished: step_000001.tmp removed (" in err
    assert _rows(d) == _rows(ref[0]) and got["sync/weights_fp"] == ref[1]["sync/weights_fp"]
    assert [r["step"] for r in _rows(d)] == [0, 1, 2]  # each step once


@pytest.fixture(scope="module")
def term_stopped(runs):
    """In-process `rlalign train` (checkpoint.every=0) that gets SIGTERM during step 1 once its update
    is done (at the start of its weight sync): (run dir, rc, stderr); a copy of the dir as it was then
    goes to runs/flipped."""
    from rlalign.job import Job

    d = runs / "term"
    sync = Job.sync_weights

    def term_at_step_1(job, step, *a):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return sync(job, step, *a)

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stderr(err):
        m.setattr(Job, "sync_weights", term_at_step_1)
        rc = cli.main(["train", *BASE, "checkpoint.every=0", f"run.dir={d}"])
    shutil.copytree(d, runs / "flipped")
    return d, rc, err.getvalue()


@pytest.mark.slow
def test_sigterm_after_a_steps_update_finishes_it_checkpoints_it_and_a_resume_at_ep1_gives_the_bits(
        term_stopped, ref, capsys):
    from rlalign.rl import train

    d, rc, err = term_stopped
    assert rc == 143, err[-3000:]
    assert "SIGTERM received: finishing the step in flight and its checkpoint" in err
    assert err.strip().splitlines()[-1] == ("rlalign train: stopped by SIGTERM after step 1 and its checkpoint; last "
                                            f"complete checkpoint: {d}/checkpoints/step_000001; resume with: "
                                            + _resume_cmd(d, *BASE, "checkpoint.every=0"))
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000001"]  # written by the stop
    assert ckpt.verify(d / "checkpoints" / "step_000001", tensors=True)["step"] == 1
    assert [r["step"] for r in _rows(d)] == [0, 1]
    assert _rows(d) == _rows(ref[0])[:2]
    got = train(load_config([*BASE, "trainer.ep_size=1", f"run.dir={d}", "checkpoint.resume=auto"]))
    assert f"resumed from {d}/checkpoints/step_000001 (step 1); running steps 2..2" in capsys.readouterr().err
    assert _rows(d) == _rows(ref[0]) and got["sync/weights_fp"] == ref[1]["sync/weights_fp"]
    segs = [json.loads(ln) for ln in (d / "segments.jsonl").read_text().splitlines()]
    assert [(s["start_step"], s["config"]["trainer"]["ep_size"]) for s in segs] == [(0, 2), (2, 1)]
    assert segs[1]["resumed_from"] == str(d / "checkpoints" / "step_000001")
    assert yaml.safe_load((d / "config.yaml").read_text())["trainer"]["ep_size"] == 1  # the latest segment's


@pytest.mark.slow
def test_compare_an_ep2_run_resumed_at_ep1_with_the_uninterrupted_one_and_one_flipped_expert_bit(
        term_stopped, ref, runs, capsys):
    from conftest import flip_checkpoint_bit  # here: the reward subprocesses import this module as tests.test_scheduler

    from rlalign.monitor.compare import compare_files
    from rlalign.rl import train

    d = term_stopped[0]
    if not (d / "checkpoints" / "step_000002").exists():  # the resume of the test above, when run alone
        train(load_config([*BASE, "trainer.ep_size=1", f"run.dir={d}", "checkpoint.resume=auto"]))
    capsys.readouterr()
    rc = cli.main(["compare", str(ref[0]), str(d)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "identical: trainer state (gradients, AdamW moments, weights per global expert) across the trainer EP " \
           "sizes (EP [2] vs [1, 2])" in out
    assert "identical:" in out and "(generator-rank0.jsonl)" in out and "first divergence" not in out
    # twin: stream by stream, as `rlalign compare` did, the per-rank trainer streams differ
    assert not compare_files(ref[0] / "traces" / "trainer-rank0.jsonl", d / "traces" / "trainer-rank0.jsonl",
                             out=open(os.devnull, "w"))
    # twin: one changed bit in one expert's weight, resumed at EP 1 the same way
    flipped = runs / "flipped"
    tensor = "model.layers.1.mlp.experts.down_proj"
    flip_checkpoint_bit(flipped / "checkpoints" / "step_000001", f"model/{tensor}/expert5")
    train(load_config([*BASE, "trainer.ep_size=1", f"run.dir={flipped}", "checkpoint.resume=auto"]))
    assert _rows(flipped) != _rows(ref[0])
    capsys.readouterr()
    rc = cli.main(["compare", str(ref[0]), str(flipped)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert f"first divergence: weights/{tensor} (step 1)" in out
    assert f"B: step 1 rank 0 weights/{tensor} bfloat16" in out


@pytest.mark.slow
def test_a_retry_of_a_finished_job_has_nothing_to_do(ref, capsys, monkeypatch):
    d, summary = ref
    _no_ray(monkeypatch)
    before = (d / "segments.jsonl").read_text(), (d / "metrics.jsonl").read_text()
    for steps in (3, 2):  # at the checkpoint's step, and below it
        over = [*SMALL, REWARD, f"run.steps={steps}", "checkpoint.every=1", f"run.dir={d}", "checkpoint.resume=auto"]
        rc = cli.main(["train", *over])
        out, err = capsys.readouterr()
        assert rc == 0 and err == (f"rlalign train: nothing to do: {d}/checkpoints/step_000002 holds step 2, so "
                                   f"run.steps={steps} are done (raise run.steps to train further)\n")
        got = json.loads(out)
        assert got["nothing_to_do"] and got["sync/weights_fp"] == summary["sync/weights_fp"]
    assert ((d / "segments.jsonl").read_text(), (d / "metrics.jsonl").read_text()) == before


# --- a stop covered by a checkpoint, a stop before the update, an error during a save ---------------------
def _run_to_call_18(d, what, monkeypatch, *over, fault=None):
    """`rlalign train BASE OVER` in this process whose reward, at its first call of step 1 (call 18: 1
    check before the run + 16 samples of step 0), sends this process `what` (a signal's name) or
    raises ('raise'); RLALIGN_FAULT=fault on its actors (set once the process's Ray cluster is up, so
    only this run's actors get it): (exit status, stderr)."""
    from rlalign import cluster

    cluster.disconnect(cluster.connect(load_config([]).placement.num_cpus))
    _this_module().CALLS["n"] = 0
    monkeypatch.setenv("RLALIGN_TEST_TERM_AT", "18")
    monkeypatch.setenv("RLALIGN_TEST_SIGNAL", what)
    if fault is not None:
        monkeypatch.setenv("RLALIGN_FAULT", fault)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["train", *BASE, *over, f"run.dir={d}"])
    return rc, err.getvalue()


@pytest.mark.slow
def test_a_reward_error_lets_the_save_in_flight_finish_and_the_resume_gives_the_uninterrupted_bits(
        runs, ref, capsys, monkeypatch):
    from rlalign.rl import train

    d = runs / "reward-error"  # step 0's write takes 6 s more on rank 0: still in flight when step 1's reward raises
    rc, err = _run_to_call_18(d, "raise", monkeypatch, "checkpoint.every=1", fault="sleep:checkpoint.write:0:1:6")
    assert rc == 2, err[-3000:]
    assert "rlalign train: RewardError during step 1; waiting up to 60 s for the checkpoint of step 0 being " \
           "written" in err
    assert f"rlalign train: the checkpoint of step 0 is complete: {d}/checkpoints/step_000000" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlalign train: error: reward function raised on sample 16 (step 1, ") and \
        "ValueError: the verifier crashed" in last
    assert last.endswith(f"; last complete checkpoint: {d}/checkpoints/step_000000; resume with: "
                         + _resume_cmd(d, *BASE, "checkpoint.every=1"))
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000000"]
    assert ckpt.verify(d / "checkpoints" / "step_000000", tensors=True)["step"] == 0
    monkeypatch.delenv("RLALIGN_FAULT")
    got = train(load_config([*BASE, "checkpoint.every=1", f"run.dir={d}", "checkpoint.resume=auto"]))
    assert f"resumed from {d}/checkpoints/step_000000 (step 0); running steps 1..2" in capsys.readouterr().err
    assert _rows(d) == _rows(ref[0]) and got["sync/weights_fp"] == ref[1]["sync/weights_fp"]


@pytest.mark.slow
def test_a_save_in_flight_that_outlasts_the_bound_is_left_behind_and_the_error_names_no_checkpoint(runs, monkeypatch):
    from rlalign import rl

    d = runs / "reward-error-slow-save"  # twin: the write outlasts the wait (1 s here)
    monkeypatch.setattr(rl, "SAVE_IN_FLIGHT_MIN_WAIT_S", 1.0)
    rc, err = _run_to_call_18(d, "raise", monkeypatch, "checkpoint.every=1", fault="sleep:checkpoint.write:0:1:600")
    assert rc == 2, err[-3000:]
    assert "rlalign train: the checkpoint of step 0 was not written within 1 s (left as a .tmp, which resume " \
           "ignores)" in err
    assert f"; no complete checkpoint in {d} " in err.strip().splitlines()[-1]
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000000.tmp"]


@pytest.fixture(scope="module")
def sigint_stopped(runs):
    """checkpoint.every=1 and checkpoint.export_hf=true, Ctrl-C (SIGINT) at the first reward of step 1,
    while step 0's checkpoint is written in the background: (run dir, rc, stderr)."""
    d = runs / "sigint"
    with pytest.MonkeyPatch.context() as m:
        rc, err = _run_to_call_18(d, "SIGINT", m, "checkpoint.every=1", "checkpoint.export_hf=true")
    return d, rc, err


@pytest.mark.slow
def test_sigint_covered_by_a_recent_async_checkpoint_stops_at_once_without_a_new_save(sigint_stopped, ref):
    from rlalign.fingerprint import combined, state_fingerprints
    from rlalign.model import load_hf

    d, rc, err = sigint_stopped
    assert rc == 130, err[-3000:]
    assert "rlalign train: SIGINT received: stopping at once: the checkpoint of step 0 covers the steps done" in err
    assert err.strip().splitlines()[-1] == (
        "rlalign train: stopped by SIGINT during step 1, at once: the checkpoint of step 0 covers the steps done (no "
        f"new save); last complete checkpoint: {d}/checkpoints/step_000000; resume with: "
        + _resume_cmd(d, *BASE, "checkpoint.every=1", "checkpoint.export_hf=true"))
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000000"]  # no new save, no .tmp
    assert _rows(d) == _rows(ref[0])[:1]
    meta = ckpt.verify(d / "checkpoints" / "step_000000", tensors=True)
    # checkpoint.export_hf: the exported model holds the weights the generator sampled with after step 0
    model = load_hf(d / "checkpoints" / "step_000000" / "hf")
    assert combined(state_fingerprints(dict(model.named_parameters()))) == meta["weights_fp"] == \
        _rows(ref[0])[0]["sync/weights_fp"]


@pytest.mark.slow
def test_sigterm_before_a_steps_update_saves_the_unchanged_trainer_at_once(runs, sigint_stopped, ref, monkeypatch):
    d = runs / "term-cut"  # twin: no checkpoint covers step 0 (checkpoint.every=0), so a save happens
    rc, err = _run_to_call_18(d, "SIGTERM", monkeypatch, "checkpoint.every=0")
    assert rc == 143, err[-3000:]
    assert "SIGTERM received: stopping at once: writing the checkpoint of step 0 (the step in flight has not " \
           "changed the trainer)" in err
    assert err.strip().splitlines()[-1] == (
        "rlalign train: stopped by SIGTERM during step 1, at once, after writing the checkpoint of step 0 (the step "
        f"in flight had not changed the trainer); last complete checkpoint: {d}/checkpoints/step_000000; resume "
        "with: " + _resume_cmd(d, *BASE, "checkpoint.every=0"))
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000000"]
    assert _rows(d) == _rows(ref[0])[:1]
    # the state written at the stop is the one the background save after step 0 wrote, tensor for tensor
    meta, other = (ckpt.verify(x / "checkpoints" / "step_000000", tensors=True) for x in (d, sigint_stopped[0]))
    assert meta["tensors"] == other["tensors"] and meta["weights_fp"] == other["weights_fp"]


@pytest.mark.slow
def test_a_reward_past_its_time_limit_ends_the_run_naming_the_sample(runs, capsys):
    d = runs / "hung-reward"
    mod = _this_module()
    mod.CALLS["n"] = 0
    t = time.monotonic()
    try:
        rc = cli.main(["train", *SMALL, "run.steps=1", "trainer.ep_size=1", f"run.dir={d}",
                       "task.reward=tests.test_scheduler:blocks_on_first_sample", "task.reward_timeout_s=1"])
    finally:
        _release(mod)  # train() returned without the blocked call: the limit ended it
    print(f"a reward blocked forever, task.reward_timeout_s=1: the run ended after {time.monotonic() - t:.1f} s")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("rlalign train: error: reward function did not return within task.reward_timeout_s=1 s "
                             "on sample 0 (step 0, prompt ")
    assert f"; no complete checkpoint in {d} " in err[0] and err[0].endswith("checkpoint.resume=auto")


@pytest.mark.slow
def test_the_offline_wandb_run_holds_histograms_samples_and_rollout_stats(ref):
    from wandb_read import history_by_step, logged_table  # here: see flip_checkpoint_bit's import

    steps, run = history_by_step(ref[0])
    assert sorted(steps) == [0, 1, 2]
    metrics = {r["step"]: r for r in _rows(ref[0])}
    for s, row in steps.items():
        assert row["consistency/abs_diff_hist/_type"] == "histogram"
        assert row["consistency/abs_diff_hist/bins"] == list(range(-8, 1))  # differing tokens only
        assert row["consistency/abs_diff_hist/values"] == metrics[s]["consistency/abs_diff_hist"][1:]
        assert row["consistency/identical_tokens"] == metrics[s]["consistency/abs_diff_hist"][0] > 0
        for key in ("response/length_min", "response/length_max", "response/clip_frac", "response/entropy",
                    "actor/lr", "time/generate_tok_per_s", "time/train_tok_per_s", "time/step_tok_per_s",
                    "time/reward_tok_per_s", "time/compare_tok_per_s", "time/sync_mb_per_s",
                    "kl/old_new_k1", "kl/old_new_k3", "actor/clip_high_frac", "actor/clip_low_frac", "actor/entropy",
                    "reward/std", "reward/zero_std_group_frac", "advantage/mean", "advantage/std"):
            assert key in row and (key.startswith("time/") or row[key] == metrics[s][key]), key
        # one on-policy update sees the policy before it: no KL, no clipping; a real entropy
        assert row["kl/old_new_k1"] == row["kl/old_new_k3"] == row["actor/clip_high_frac"] == 0.0
        assert 0 < row["actor/entropy"] <= math.log(load_config(BASE).model.vocab_size)
        assert "consistency/worst_tokens/_type" not in row  # twin: no mismatch, no worst-token table
    assert [s for s, row in steps.items() if row.get("samples/_type") == "table-file"] == [0, 2]
    cols, data = logged_table(run, steps[2], "samples")
    assert cols == ["sample_id", "prompt", "completion", "answer", "reward"] and data[0][0] == 2 * 16
    from rlalign.wandb_workspace import layout_keys

    logged = {k.split("/_type")[0] for row in steps.values() for k in row} | {"text_metrics"}
    missing = layout_keys() - logged - {"consistency/worst_tokens", "consistency/divergence_by_op"}
    assert not missing, missing  # every key of the workspace template is one the run logs


@pytest.mark.slow
def test_report_has_the_phase_times_tokens_per_s_and_rollout_stats(ref):
    from rlalign.monitor.report import make_report

    text = (make_report(ref[0]) / "summary.md").read_text()
    assert "| phase | mean s | share of the step | tokens/s |" in text
    for phase in ("generate", "reward", "train", "sync", "checkpoint", "step"):
        assert f"\n| {phase} | " in text, phase
    assert "| response length: mean (min..max over the run) |" in text
    assert "| responses stopped by max_new_tokens, mean |" in text and "| reward calls past" in text
    assert "worst tokens" not in text  # twin: a run without mismatches has none
