"""Preemption-ready checkpoints without Ray: the start's estimate of a save against run.stop_grace_s
(a measured write rate, injectable), the stop plan that cuts a step at once, and the progress lines
of saves and loads on stderr. The runs that stop and fail for real: tests/test_scheduler.py."""

import io
import os
import signal
import sys
import time

import pytest

from rlalign import checkpoint as ckpt
from rlalign import checkpoint_files
from rlalign.checkpoint_files import Progress, SaveWatch, grace_warning, measure_write_rate


def test_the_grace_warning_names_the_orchestrators_knobs_only_when_the_save_outlasts_the_grace(tmp_path):
    line = grace_warning(61_200_000_000, 1_020_000_000, 20.0, tmp_path)
    assert line.startswith(f"a checkpoint of 61.2 GB takes ~60 s at the 1.02 GB/s measured in {tmp_path}, longer than "
                           "run.stop_grace_s=20 s")
    for knob in ("raise run.stop_grace_s above ~60 s", "Kubernetes: terminationGracePeriodSeconds",
                 "Slurm: KillWait, or sbatch --signal=TERM@SECONDS", "checkpoint.every=1"):
        assert knob in line
    assert "\n" not in line
    assert grace_warning(61_200_000_000, 1_020_000_000, 20.0, tmp_path, every=5) == line
    every_step = grace_warning(61_200_000_000, 1_020_000_000, 20.0, tmp_path, every=1)  # saves every step already
    assert every_step == line.split(", or save every step")[0] and "checkpoint.every" not in every_step
    assert grace_warning(61_200_000_000, 1_020_000_000, 90.0, tmp_path) is None  # twin: a generous grace
    assert grace_warning(61_200_000_000, 10_000_000_000, 20.0, tmp_path) is None  # twin: a fast disk


def test_the_write_rate_probe_leaves_nothing_behind(tmp_path):
    d = tmp_path / "checkpoints"
    rate = measure_write_rate(d, checkpoint_files.probe_bytes(1000))
    assert rate > 0 and list(d.iterdir()) == []
    assert checkpoint_files.probe_bytes(1000) == 4 << 20 and checkpoint_files.probe_bytes(10**12) == 64 << 20


@pytest.fixture
def no_ray(monkeypatch):
    from rlalign import cluster

    def connect(*a, **k):
        raise RuntimeError("Ray would start here")

    monkeypatch.setattr(cluster, "connect", connect)


@pytest.mark.parametrize("grace, warned", [("20", True), ("600", False)])
def test_train_warns_at_start_when_a_save_outlasts_run_stop_grace_s(tmp_path, capsys, monkeypatch, no_ray, grace,
                                                                    warned):
    from rlalign import cli

    probed = []

    def slow_disk(directory, nbytes):  # 100 kB/s: the tiny model's 3.23 MB take ~32 s
        probed.append((directory, nbytes))
        return 100_000.0

    monkeypatch.setattr(ckpt, "measure_write_rate", slow_disk)
    rc = cli.main(["train", f"run.dir={tmp_path}", "run.steps=1", f"run.stop_grace_s={grace}"])
    out, err = capsys.readouterr()
    assert rc == 2 and "Ray would start here" in err.splitlines()[-1] and out == ""
    assert probed == [(tmp_path / "checkpoints", 4 << 20)]
    lines = [ln for ln in err.splitlines() if "warning" in ln]
    if warned:
        assert lines == [f"rlalign train: warning: a checkpoint of 3.23 MB takes ~32 s at the 100 kB/s measured in "
                         f"{tmp_path}/checkpoints, longer than run.stop_grace_s=20 s: a stop signal (preemption, "
                         f"Ctrl-C) may end the run before its checkpoint is written; raise run.stop_grace_s above ~32 "
                         f"s and the orchestrator's grace above that (Kubernetes: terminationGracePeriodSeconds; "
                         f"Slurm: KillWait, or sbatch --signal=TERM@SECONDS to be signalled earlier)"]  # run.steps=1:
        # every step is saved already, so saving every step is not offered
    else:
        assert lines == []
    rc = cli.main(["train", f"run.dir={tmp_path / 'off'}", "run.steps=1", "checkpoint.enabled=false"])
    assert rc == 2 and len(probed) == 1  # twin: no checkpoints, no probe


def _ray_init_signalled(*args, **kwargs):
    """What ray.init does with SIGTERM (its driver handler: sys.exit(15)), then a scheduler's SIGTERM
    while it starts the cluster; returns as if started."""
    import ray._private.utils as ray_utils

    ray_utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))
    os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next line
    return "started"


def test_a_sigterm_during_ray_init_is_held_for_the_processs_own_handler():
    from rlalign import cluster

    got = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with cluster._own_sigterm():
            got.append(_ray_init_signalled())
        assert got == ["started", signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is not None
        with pytest.raises(SystemExit) as e:  # twin: without the guard, Ray's handler ends the start with exit 15
            _ray_init_signalled()
        assert e.value.code == signal.SIGTERM and got == ["started", signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_train_stopped_by_sigterm_while_ray_starts_exits_143_naming_that(tmp_path, capsys, monkeypatch):
    import ray

    from rlalign import cli

    monkeypatch.setattr(ray, "init", _ray_init_signalled)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # a Ray another test left up is not started again
    rc = cli.main(["train", f"run.dir={tmp_path}", "run.steps=1", "logger.console=false"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 143, err
    assert err[-1].startswith("rlalign train: stopped by SIGTERM while starting the actors, at once: no step of this "
                              f"run had finished; no complete checkpoint in {tmp_path}"), err


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_lines_name_bytes_rate_and_time_left_and_stay_silent_for_a_short_transfer():
    clock, out = _Clock(), io.StringIO()
    p = Progress("rlalign train: checkpoint of step 7", 10 * 10**9, clock=clock, out=out)
    clock.t += 2.9
    p.update(3 * 10**9)
    p.done()  # a transfer shorter than 3 s: nothing at all
    assert out.getvalue() == ""
    p = Progress("rlalign train: checkpoint of step 7", 10 * 10**9, clock=clock, out=out)
    for seconds, done in ((1, 10**9), (3, 3 * 10**9), (5, 4 * 10**9), (8, 8 * 10**9)):
        clock.t = p.t0 + seconds
        p.update(done)
    clock.t = p.t0 + 10
    p.done(result="written")
    assert out.getvalue().splitlines() == [
        "rlalign train: checkpoint of step 7: 3 GB of 10 GB (30 %, 1 GB/s, ~7 s left)",
        "rlalign train: checkpoint of step 7: 8 GB of 10 GB (80 %, 1 GB/s, ~2 s left)",  # every 5 s, not at 5 s
        "rlalign train: checkpoint of step 7: written: 10 GB in 10 s (1 GB/s)"]


def test_a_save_in_flight_reports_its_progress_from_the_disk(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Progress, "AFTER_S", 0.0)
    monkeypatch.setattr(Progress, "EVERY_S", 0.0)
    tmp = ckpt.tmp_path(tmp_path, 3)
    watch = SaveWatch(tmp_path, 3, 2_000_000, poll_s=0.02)
    time.sleep(0.1)  # the .tmp directory is not there yet: no line, no end
    tmp.mkdir(parents=True)
    (tmp / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"x" * 1_000_000)
    deadline = time.monotonic() + 10
    while "1 MB of 2 MB (50 %" not in capsys.readouterr().err and time.monotonic() < deadline:
        time.sleep(0.02)
    (tmp / "meta.json").write_text("{}")  # published as checkpoint.complete does: the index, then the rename
    os.replace(tmp, tmp.with_name("step_000003"))
    watch.close()
    err = capsys.readouterr().err
    assert "rlalign train: checkpoint of step 3: written: 2 MB in " in err
    assert capsys.readouterr().out == ""
    silent = SaveWatch(tmp_path, 4, 2_000_000, poll_s=0.02)  # twin: a save that is never seen prints nothing
    time.sleep(0.1)
    silent.close()
    assert capsys.readouterr().err == ""


def test_loading_a_checkpoint_reports_its_progress_on_stderr(tmp_path, monkeypatch, capsys):
    from test_export import _save, _trainer

    tr, cfg = _trainer()
    path = _save(tr, cfg, tmp_path)
    monkeypatch.setattr(Progress, "AFTER_S", 0.0)
    ckpt.load_shards(tr.checkpoint_state(), path)
    out, err = capsys.readouterr()
    assert f"rlalign: loading {path} (rank 0's part): " in err and f"rlalign: loading {path} (rank 0's part): read: " \
        in err and out == ""
    monkeypatch.setattr(Progress, "AFTER_S", 3.0)
    ckpt.load_shards(tr.checkpoint_state(), path)
    assert capsys.readouterr().err == ""  # twin: a load within 3 s says nothing


def test_a_stop_plan_cuts_the_step_at_once_or_lets_it_finish():
    from rlalign.stop import StopSignals

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where the suite started with it ignored
    with StopSignals(["SIGUSR1", "SIGINT"], grace_s=30) as stop:
        stop.plan = lambda: "the checkpoint of step 4 covers the steps done"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the first signal: cut at once
        assert stop.requested and stop.cut and not stop.abandoned and stop.stopped("x").exit_code == 130
    with StopSignals(["SIGUSR1", "SIGINT"], grace_s=30) as stop:
        stop.plan = lambda: None  # twin: the step's update has begun, nothing covers the step before it
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and not stop.cut
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second one: abandon at once
        assert stop.abandoned
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("published", [True, False])
def test_a_grace_that_ends_in_the_prune_after_a_complete_checkpoint_says_so(tmp_path, monkeypatch, published):
    """SIGTERM while the checkpoint of step k is written: the write ends, then the prune of the older
    ones outlasts run.stop_grace_s. The line says the checkpoint is complete and the prune was cut;
    twin: a write that never completes is still named as the wait that was cut."""
    from omegaconf import OmegaConf

    from rlalign import rl
    from rlalign.stop import StopSignals

    class Saves:
        covered = 3

        def wait_on_disk(self, _):
            return tmp_path / "step_000003" if published else None

        def wait_pruned(self):
            stop.abandoned = True
            raise KeyboardInterrupt  # the grace period ends here

    stop = StopSignals([], grace_s=20)
    stop.signum, stop.cut = signal.SIGTERM, True
    run = rl._Run.__new__(rl._Run)
    run.stop, run.done, run.start, run.run_dir, run.saves = stop, 3, 0, tmp_path, Saves()
    run.cfg = OmegaConf.create({"checkpoint": {"enabled": True, "keep": 1}})
    monkeypatch.setattr(rl.ckpt, "published", lambda *a: None)
    what = run._stopped_now().what
    if published:
        assert what.startswith("while removing the checkpoints before step 3 (checkpoint.keep=1), the checkpoint "
                               "of step 3 complete (abandoned: not done within run.stop_grace_s=20 s"), what
    else:
        assert what.startswith("while waiting for the checkpoint of step 3 being written (abandoned"), what
