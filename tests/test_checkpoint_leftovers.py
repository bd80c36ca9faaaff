"""What an interrupted run leaves in run_dir/checkpoints (a prune, a save or a publish cut short) never
reads as a checkpoint and is cleared at the next start."""

from __future__ import annotations

import shutil

from rlalign import checkpoint as ckpt


def _fake_checkpoint(d, name: str, nbytes: int = 1000, meta: bool = True):
    p = d / "checkpoints" / name
    p.mkdir(parents=True)
    (p / "shard-00000-model-00001-of-00001.safetensors").write_bytes(b"x" * nbytes)
    if meta:
        (p / "meta.json").write_text("{}")
    return p


def test_a_prune_cut_short_leaves_no_step_dir_and_the_next_start_removes_it(tmp_path, monkeypatch):
    p = _fake_checkpoint(tmp_path, "step_000000")
    _fake_checkpoint(tmp_path, "step_000001")
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", lambda *a, **k: None)  # the process killed before the delete ran
        ckpt.prune(p)
    assert [q.name for q in ckpt.list_complete(tmp_path)] == ["step_000001"]
    assert ckpt.clear_leftovers(tmp_path) == ["step_000000.pruned removed (1 kB)"]
    assert sorted(q.name for q in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def test_negative_twin_a_delete_in_place_cut_short_reads_as_a_checkpoint(tmp_path):
    p = _fake_checkpoint(tmp_path, "step_000000")
    _fake_checkpoint(tmp_path, "step_000001")
    for f in p.glob("*.safetensors"):  # the files deleted before the kill; meta.json not yet
        f.unlink()
    assert [q.name for q in ckpt.list_complete(tmp_path)] == ["step_000000", "step_000001"]
    assert ckpt.clear_leftovers(tmp_path) == []  # nothing marks it: it stays


def test_leftovers_of_a_save_and_a_publish_cut_short(tmp_path):
    _fake_checkpoint(tmp_path, "step_000002.tmp", 2000, meta=False)  # a save never published: removed
    _fake_checkpoint(tmp_path, "step_000003.old")  # moved aside, its replacement never renamed: put back
    _fake_checkpoint(tmp_path, "step_000004")
    _fake_checkpoint(tmp_path, "step_000004.old")  # its replacement in place: removed
    (tmp_path / "checkpoints" / "notes.txt").write_text("mine")  # not the saver's: left alone
    assert ckpt.clear_leftovers(tmp_path) == [
        "step_000002.tmp removed (2 kB)", "step_000003.old put back as step_000003", "step_000004.old removed (1 kB)"]
    assert sorted(q.name for q in (tmp_path / "checkpoints").iterdir()) == ["notes.txt", "step_000003", "step_000004"]
    assert ckpt.clear_leftovers(tmp_path) == [] and ckpt.clear_leftovers(tmp_path / "none") == []


def test_a_stopping_run_waits_for_the_prune_after_a_publish(tmp_path):
    import threading

    _fake_checkpoint(tmp_path, "step_000001")
    old = _fake_checkpoint(tmp_path, "step_000000")
    threading.Timer(0.3, ckpt.prune, (old,)).start()  # the publishing rank's prune, a moment after the publish
    assert ckpt.wait_pruned(tmp_path, keep=1, timeout_s=60, poll_s=0.02)
    assert [q.name for q in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


def test_negative_twin_a_prune_that_never_comes_or_a_delete_under_way_is_not_waited_out(tmp_path):
    _fake_checkpoint(tmp_path, "step_000000")
    _fake_checkpoint(tmp_path, "step_000001")
    assert not ckpt.wait_pruned(tmp_path, keep=1, timeout_s=0.1, poll_s=0.02)
    assert ckpt.wait_pruned(tmp_path, keep=2, timeout_s=0.1, poll_s=0.02)  # both kept: nothing to delete
    _fake_checkpoint(tmp_path, "step_000002.pruned", meta=False)
    assert not ckpt.wait_pruned(tmp_path, keep=0, timeout_s=0.1, poll_s=0.02)
