"""Checkpoints that cannot ambush a run: the disk is checked before Ray starts, a save makes no
Python copy of a file and keeps its host buffers across saves, a failed write leaves the previous
checkpoint as it was; and
every JSON line the CLI prints is standard JSON."""

import errno
import hashlib
import json
import os
import threading
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import same_bits

from rlalign import checkpoint as ckpt
from rlalign.checkpoint import CheckpointError

PARTS = {"bfloat16 weights": 2_000_000, "fp32 masters": 4_000_000, "AdamW moments": 8_000_000}


def _statvfs(free: int):
    real = os.statvfs

    def fake(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, 1000, st.f_blocks, free // 1000, free // 1000, *st[5:]))

    return fake


def _strict(line: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


# --- free space before the run ------------------------------------------------------------------------
def test_checkpoints_held_at_once():
    assert ckpt.held_at_once(existing=0, saves=5, keep=2) == 3  # two kept + the one being written
    assert ckpt.held_at_once(existing=0, saves=1, keep=2) == 1
    assert ckpt.held_at_once(existing=0, saves=3, keep=0) == 3  # keep=0: all of them
    assert ckpt.held_at_once(existing=2, saves=4, keep=2) == 1  # the kept ones already use their space
    assert ckpt.held_at_once(existing=0, saves=0, keep=2) == 0


def test_a_checkpoint_larger_than_the_free_space_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "statvfs", _statvfs(10_000_000))
    d = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError) as e:
        ckpt.check_space(tmp_path, PARTS, range(0, 6), every=2, total_steps=6, keep=2)
    assert str(e.value) == (
        f"not enough disk for checkpoints: {d} needs 42 MB (3 checkpoints of 14 MB at once: bfloat16 weights 2 MB "
        f"+ fp32 masters 4 MB + AdamW moments 8 MB) but its file system has 10 MB free; set run.dir=<a directory "
        f"with room>, checkpoint.keep=1 (fewer at once), or checkpoint.enabled=false (no checkpoints)")
    # negative twin: with room for the three, the run may start
    monkeypatch.setattr(os, "statvfs", _statvfs(43_000_000))
    got = ckpt.check_space(tmp_path, PARTS, range(0, 6), every=2, total_steps=6, keep=2)
    assert got["needed_bytes"] == 42_000_000 <= got["free_bytes"] and got["checkpoints_at_once"] == 3


def test_the_estimate_is_the_size_of_the_state_a_trainer_writes():
    from rlalign import kernels
    from rlalign.config import load_config
    from rlalign.training.trainer import Trainer, checkpoint_nbytes

    cfg = load_config([])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    parts = checkpoint_nbytes(cfg)
    state = Trainer(cfg).checkpoint_state()
    assert sum(parts.values()) == sum(v.numel() * v.element_size() for v in state.values())
    assert parts["fp32 masters"] == 2 * parts["bfloat16 weights"] and parts["AdamW moments"] == 4 * parts[
        "bfloat16 weights"]


@pytest.fixture
def no_ray(monkeypatch):
    """rlalign.cluster.connect (the start of Ray) raises instead: whether a run got that far."""
    from rlalign import cluster

    calls = []

    def connect(*a, **k):
        calls.append(a)
        raise RuntimeError("Ray would start here")

    monkeypatch.setattr(cluster, "connect", connect)
    return calls


def _train(tmp_path, capsys, *extra):
    from rlalign import cli

    code = cli.main(["train", f"run.dir={tmp_path / 'run'}", "run.steps=2", "logger.console=false", *extra])
    out = capsys.readouterr()
    return code, out.err.strip().splitlines()


def test_train_refuses_at_start_when_the_checkpoint_does_not_fit(tmp_path, capsys, monkeypatch, no_ray):
    monkeypatch.setattr(os, "statvfs", _statvfs(1_000_000))
    code, err = _train(tmp_path, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"rlalign train: error: not enough disk for checkpoints: {tmp_path / 'run'}/checkpoints "
                             f"needs 6.46 MB (2 checkpoints of 3.23 MB at once: bfloat16 weights "), err  # every step
    assert err[0].endswith("but its file system has 1 MB free; set run.dir=<a directory with room>, "
                           "checkpoint.keep=1 (fewer at once), or checkpoint.enabled=false (no checkpoints)"), err
    assert no_ray == [] and not (tmp_path / "run" / "metrics.jsonl").exists()  # before Ray and any step
    # negative twins: with room, or without checkpoints, the run goes on to start Ray
    code, err = _train(tmp_path, capsys, "checkpoint.enabled=false")
    assert code == 2 and "Ray would start here" in err[-1] and len(no_ray) == 1
    monkeypatch.setattr(os, "statvfs", _statvfs(10_000_000))
    code, err = _train(tmp_path, capsys)
    assert code == 2 and "Ray would start here" in err[-1] and len(no_ray) == 2


def test_the_space_check_counts_the_tokenizer_copy_each_checkpoint_keeps(tmp_path, capsys, monkeypatch, no_ray):
    """A run of a model with its own tokenizer keeps the tokenizer's files in each checkpoint (step_N/tokenizer):
    a disk with room for the trainer state of the checkpoints held at once but not for those copies is refused;
    twin: with room for the copies too, the run goes on to start Ray."""
    from test_tasks_user import write_tokenizer

    from rlalign.config import load_config
    from rlalign.model import save_hf
    from rlalign.model.build import model_from_config
    from rlalign.rl import checkpoint_parts
    from rlalign.training.trainer import checkpoint_nbytes

    model = tmp_path / "model"
    save_hf(model_from_config(load_config([])), model)
    write_tokenizer(model)
    (model / "chat_template.jinja").write_text("{# a template of 1 MB #}" + " " * 1_000_000)
    cfg = load_config([f"model.path={model}"])
    parts = checkpoint_parts(cfg, None, str(model))
    state = sum(checkpoint_nbytes(cfg).values())
    copy = sum(f.stat().st_size for f in model.iterdir() if f.name.startswith(("tokenizer", "chat_template")))
    assert parts["tokenizer copy"] == copy > 1_000_000 and sum(parts.values()) == state + copy
    monkeypatch.setattr(os, "statvfs", _statvfs(2 * state + 1000))  # room for the state of both checkpoints
    code, err = _train(tmp_path, capsys, f"model.path={model}")
    assert code == 2 and err[-1].startswith("rlalign train: error: not enough disk for checkpoints: "), err
    assert f"(2 checkpoints of {ckpt.size_text(state + copy)} at once: " in err[-1], err
    assert "+ tokenizer copy 1 MB) but its file system has" in err[-1] and no_ray == []
    monkeypatch.setattr(os, "statvfs", _statvfs(2 * (state + copy) + 1000))
    code, err = _train(tmp_path, capsys, f"model.path={model}")
    assert code == 2 and "Ray would start here" in err[-1] and len(no_ray) == 1


def test_a_checkpoint_exported_at_each_save_counts_its_hugging_face_directory_too():
    from rlalign.config import load_config
    from rlalign.rl import checkpoint_parts

    cfg = load_config([])
    parts = checkpoint_parts(cfg, None, None)  # the built-in char tokenizer: no copy kept
    assert parts["tokenizer copy"] == 0 and "Hugging Face export" not in parts
    exported = checkpoint_parts(load_config(["checkpoint.export_hf=true"]), None, None)
    assert exported == {**parts, "Hugging Face export": parts["bfloat16 weights"]}


def test_train_help_states_how_to_run_without_checkpoints(capsys):
    from rlalign import cli

    assert cli.main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "checkpoint.enabled" in text and "false: no checkpoint at all" in text and "checkpoint.bucket_mb" in text


# --- bounded staging -------------------------------------------------------------------------------
def _state(n: int = 64, numel: int = 1 << 16) -> dict[str, torch.Tensor]:
    return {f"t{i:03d}": torch.arange(numel, dtype=torch.float32) * (i + 1) for i in range(n)}  # 256 KiB each


def _peak_host(fn) -> int:
    """Peak bytes Python allocated while fn ran (tracemalloc, every thread): Python bytes, such as
    safetensors.torch.save's copy of a file (torch's own buffers are not traced: see Staging)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("mode", ["sync", "stream", "host"])
def test_a_streamed_save_copies_nothing_and_a_staged_one_reuses_its_host_buffers(tmp_path, mode):
    from safetensors.torch import save as st_save

    state = _state(64)
    size, bucket = 16 << 20, 4 << 20
    assert sum(v.nbytes for v in state.values()) == size
    saver = ckpt.AsyncSaver(staging=mode if mode != "sync" else "auto", say=lambda line: None)

    def save(path):
        if mode == "sync":
            ckpt.save_shards(state, path, bucket_bytes=bucket)
        else:
            saver.save(state, path, bucket_bytes=bucket)
            saver.wait()

    save(ckpt.tmp_path(tmp_path / "warm", 0))  # imports, first-call caches, the staged buffers
    held = [f.data_ptr() for _, f in saver.buffers._files.values()]
    peak = _peak_host(lambda: save(ckpt.tmp_path(tmp_path, 0)))
    print(f"{mode}: state {size >> 20} MiB, bucket {bucket >> 10} KiB: Python's peak {peak / bucket:.2f} buckets")
    assert peak < bucket // 2  # no Python copy of a file (the fingerprints' temporaries: a few tensors)
    assert saver.buffers.held_bytes == (size if mode == "host" else 0)
    assert [f.data_ptr() for _, f in saver.buffers._files.values()] == held  # the same buffers, reused
    path = ckpt.complete(tmp_path, 0, {}, keep=0)
    assert len(ckpt.read_meta(path)["files"]) == 4  # 16 MiB in 4 MiB files
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.load_shards(back, path)
    assert all(same_bits(back[k], v) for k, v in state.items())
    # negative twins: safetensors.torch.save (what DCP's writer calls) copies a file into Python bytes;
    # a state of other shapes gets buffers of its own
    one = {k: state[k] for k in list(state)[:16]}
    assert _peak_host(lambda: st_save(one)) >= bucket
    if mode == "host":
        saver.save(_state(8, 1 << 10), ckpt.tmp_path(tmp_path / "other", 0), bucket_bytes=bucket)
        saver.wait()
        assert saver.buffers.held_bytes == 8 * 4 << 10


def test_bucket_files_are_consecutive_groups_by_rank_a_larger_tensor_alone():
    layout = {"b": (0, 300), "a": (0, 300), "big": (0, 2000), "c": (1, 100), "d": (1, 600), "z": (0, 100)}
    assert ckpt.bucket_files(layout, 1000) == {"a": 1, "b": 1, "big": 2, "z": 3, "c": 3, "d": 3}
    assert ckpt.bucket_files(layout, 10**9) == dict.fromkeys(layout, 1)  # twin: one bucket holds all


@pytest.mark.parametrize("mode,bucket", [("sync", 1 << 30), ("async", 64 << 10)])
def test_a_trainer_checkpoint_in_one_or_many_buckets_resumes_bitwise(tmp_path, mode, bucket):
    from omegaconf import OmegaConf
    from test_checkpoint import _snapshot, _trainer

    from rlalign.config import load_config

    # dense parameters cut into units that share their parameter's AdamW step (one tensor, several keys)
    cfg = OmegaConf.to_container(load_config(["trainer.micro_batch_size=2", "trainer.shard_unit_numel=1024"]))
    tr = _trainer(steps=1, cfg=cfg)
    state = tr.checkpoint_state()
    steps = [k for k in state if k.endswith("/step")]
    assert len({state[k].untyped_storage().data_ptr() for k in steps}) < len(steps)
    if mode == "sync":
        ckpt.save_shards(state, ckpt.tmp_path(tmp_path, 0), bucket_bytes=bucket)
    else:
        saver = ckpt.AsyncSaver()
        saver.save(state, ckpt.tmp_path(tmp_path, 0), bucket_bytes=bucket)
        saver.wait()
    path = ckpt.complete(tmp_path, 0, {"data_position": 1}, keep=0)
    files = len(ckpt.read_meta(path)["files"])
    assert files == 1 if bucket == 1 << 30 else files > 20
    ckpt.verify(path, tensors=True)
    fresh = _trainer(steps=0, cfg=cfg)
    ckpt.load_shards(fresh.checkpoint_state(), path)
    want = _snapshot(tr)
    assert all(same_bits(v, want[k]) for k, v in fresh.checkpoint_state().items())


# --- a failed write ---------------------------------------------------------------------------------
@contextmanager
def _disk_full_at_file(n: int):
    """The n-th checkpoint file begun (1-based) fails with ENOSPC after part of it is written."""
    from rlalign import checkpoint_write

    real, opened, lock = checkpoint_write.write_file, [], threading.Lock()

    def full(path, head, parts):
        with lock:
            opened.append(path)
            nth = len(opened)
        if nth == n:
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, head, parts)

    mp = pytest.MonkeyPatch()
    mp.setattr(checkpoint_write, "write_file", full)
    try:
        yield opened
    finally:
        mp.undo()


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_enospc_in_a_later_bucket_leaves_the_previous_checkpoint_bit_identical(tmp_path, mode):
    state = _state(16)
    ckpt.save_shards(state, ckpt.tmp_path(tmp_path, 1), bucket_bytes=1 << 20)
    first = ckpt.complete(tmp_path, 1, {"data_position": 2}, keep=1)
    before = _digest(first)
    later = {k: v + 1 for k, v in state.items()}
    tmp = ckpt.tmp_path(tmp_path, 2)
    msg = (rf"^checkpoint of step 2 not written \(rank 0\): {tmp}: No space left on device \(ENOSPC\); "
           rf"the previous checkpoint {first} is intact$")
    with _disk_full_at_file(3) as opened, pytest.raises(CheckpointError, match=msg):
        if mode == "sync":
            ckpt.save_shards(later, tmp, bucket_bytes=1 << 20)
        else:
            saver = ckpt.AsyncSaver()
            saver.save(later, tmp, bucket_bytes=1 << 20)
            saver.wait()
    assert len(opened) >= 3  # the third failed (its writer's neighbours may have begun the fourth)
    assert not tmp.exists() and ckpt.list_complete(tmp_path) == [first] and _digest(first) == before
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ckpt.load_shards(back, ckpt.resolve_resume(tmp_path, "auto"))
    assert all(same_bits(back[k], v) for k, v in state.items())
    # negative twin: with space, the same save completes, becomes the newest and replaces the first
    ckpt.save_shards(later, tmp, bucket_bytes=1 << 20)
    second = ckpt.complete(tmp_path, 2, {"data_position": 3}, keep=1)
    assert ckpt.resolve_resume(tmp_path, "auto") == second and ckpt.list_complete(tmp_path) == [second]


# --- JSON lines ------------------------------------------------------------------------------------
def test_agree_prints_standard_json_with_non_finite_numbers_null_and_named(monkeypatch, capsys):
    from rlalign import agree

    result = {"kernels": "default", "tokens": 4, "mismatched_tokens": 1, "max_abs_diff": float("inf"),
              "mean_abs_diff": float("nan"),
              "abs_diff_hist": [3, 1], "k3_kl": 0.5, "nested": {"x": -float("inf"), "y": [1.0, float("nan")]}}
    monkeypatch.setattr(agree, "run_agree", lambda cfg, phase: (result, []))
    monkeypatch.setattr(agree, "print_report", lambda r: None)
    assert agree.main(None) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    got = _strict(line)
    assert got["max_abs_diff"] is None and got["mean_abs_diff"] is None and got["nested"] == {"x": None,
                                                                                             "y": [1.0, None]}
    assert got["nonfinite"] == ["max_abs_diff", "mean_abs_diff", "nested.x", "nested.y.1"]
    assert got["tokens"] == 4 and got["abs_diff_hist"] == [3, 1]
    # negative twin: plain json.dumps writes Infinity, which the strict parser refuses
    with pytest.raises(ValueError, match="non-standard JSON constant Infinity"):
        _strict(json.dumps(result))


def test_train_prints_its_summary_as_standard_json(monkeypatch, capsys):
    from rlalign import rl

    monkeypatch.setattr(rl, "train", lambda cfg, status=None: {"steps": 2, "reward_gain": float("nan")})
    assert rl.main(None) == 0
    got = _strict(capsys.readouterr().out.strip().splitlines()[-1])
    assert got == {"steps": 2, "reward_gain": None, "nonfinite": ["reward_gain"]}
    # negative twin: a finite summary is unchanged
    monkeypatch.setattr(rl, "train", lambda cfg, status=None: {"steps": 2, "reward_gain": 0.5})
    rl.main(None)
    assert _strict(capsys.readouterr().out.strip().splitlines()[-1]) == {"steps": 2, "reward_gain": 0.5}
