"""Checkpoints: nothing unpickled, every tensor fingerprint-checked, damage and full disks named."""

import errno
import json
import os
import pickle
import re
import shlex
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import same_bits

from rlalign import checkpoint as ckpt
from rlalign import checkpoint_files
from rlalign import checkpoint_write as cw
from rlalign.checkpoint import CheckpointError
from rlalign.config import load_config

WEIGHT = "model/model.layers.0.self_attn.q_proj.weight"
OPTIM = "optim/model.layers.1.mlp.experts.down_proj/exp_avg/expert5"


def _trainer(steps: int = 1, group=None, cfg=None):
    """A trainer after `steps` identical AdamW steps (non-zero optimizer state)."""
    from omegaconf import OmegaConf

    from rlalign import kernels
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg) if cfg is not None else load_config(["trainer.micro_batch_size=2"])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, group)
    for _ in range(steps):
        samples = [Sample([3, 4, 5], [6, 7, 8, 9], torch.zeros(4), params=SamplingParams()),
                   Sample([5, 4], [9, 2], torch.zeros(2), params=SamplingParams())]
        tr.forward_backward(samples, lambda lps, idx: (-torch.cat(lps).sum(), {}), 6)
        tr.optimizer_step()
    return tr


def _snapshot(tr) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.checkpoint_state().items()}


def _save(tr, run_dir: Path, step: int) -> Path:
    ckpt.save_shards(tr.checkpoint_state(), ckpt.tmp_path(run_dir, step))
    return ckpt.complete(run_dir, step, {"data_position": step + 1, "weights_fp": "-"}, keep=0)


def _shard(path: Path) -> Path:
    (f,) = [p for p in path.iterdir() if p.name.endswith(".safetensors")]
    return f


def _flip_bit(shard: Path, key: str) -> None:
    b = bytearray(shard.read_bytes())
    n = int.from_bytes(b[:8], "little")
    off = 8 + n + json.loads(b[8:8 + n])[key]["data_offsets"][0]
    b[off] ^= 1
    shard.write_bytes(bytes(b))


@pytest.fixture(scope="module")
def trained():
    return _trainer(steps=1)


@pytest.fixture
def two(tmp_path, trained):
    """A run with complete checkpoints at steps 1 and 3 (step 3 one AdamW step further)."""
    first = _save(trained, tmp_path, 1)
    later = _trainer(steps=2)
    return tmp_path, first, _save(later, tmp_path, 3), later


def test_round_trip_is_bitwise_equal_and_leaves_no_pickle(tmp_path, trained):
    path = _save(trained, tmp_path, 0)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["meta.json", "shard-00001-model-00001-of-00001.safetensors"]  # no DCP .metadata pickle
    fresh = _trainer(steps=0)
    want = _snapshot(trained)
    assert not all(same_bits(v, want[k]) for k, v in fresh.checkpoint_state().items())  # twin: differs before
    meta = ckpt.load_shards(fresh.checkpoint_state(), path)
    assert meta["step"] == 0 and meta["data_position"] == 1 and isinstance(meta["python_rng"], list)
    got = fresh.checkpoint_state()
    assert got.keys() == want.keys() and all(same_bits(got[k], want[k]) for k in want)
    ckpt.verify(path, tensors=True)
    # the restored optimizer continues exactly as the original: one more step on each, same bits
    again = _trainer(steps=2)
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample

    samples = [Sample([3, 4, 5], [6, 7, 8, 9], torch.zeros(4), params=SamplingParams()),
               Sample([5, 4], [9, 2], torch.zeros(2), params=SamplingParams())]
    fresh.forward_backward(samples, lambda lps, idx: (-torch.cat(lps).sum(), {}), 6)
    fresh.optimizer_step()
    a, b = fresh.checkpoint_state(), again.checkpoint_state()
    assert all(same_bits(a[k], b[k]) for k in a)


def test_a_pickle_payload_in_the_checkpoint_is_never_executed(tmp_path, trained, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = _save(trained, tmp_path, 0)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {shlex.quote(str(marker))}",)

    for name in (".metadata", "__0.metadata", "model.safetensors.index.json"):
        (path / name).write_bytes(pickle.dumps(Payload()))
    fresh = _trainer(steps=0)
    with monkeypatch.context() as m:  # nothing on the load path may unpickle anything
        def refuse(*a, **k):
            raise AssertionError("unpickling during checkpoint load")

        for mod, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
            m.setattr(mod, attr, refuse)
        ckpt.load_shards(fresh.checkpoint_state(), path)
    assert not marker.exists()
    want = _snapshot(trained)
    assert all(same_bits(v, want[k]) for k, v in fresh.checkpoint_state().items())
    # negative twin: the payload is live; DCP's default reader (the old load path) executes it
    with pytest.raises(CheckpointException):  # it unpickles an int, then fails
        dcp.load(_snapshot(trained), checkpoint_id=str(path), no_dist=True)
    assert marker.exists()
    # an extra .safetensors file (which DCP's safetensors reader would read) is refused
    (path / "shard-00002-model-00001-of-00001.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"shard-00002-model.*not part of this checkpoint"):
        ckpt.load_shards(fresh.checkpoint_state(), path)


@pytest.mark.parametrize("key", [WEIGHT, OPTIM])
def test_a_flipped_bit_is_refused_naming_checkpoint_file_tensor_and_the_intact_one(two, key):
    run, first, later_path, later = two
    shard = _shard(later_path)
    fresh = _trainer(steps=0)
    before = _snapshot(fresh)
    _flip_bit(shard, key)
    ckpt.verify(later_path)  # the file checks do not read tensor data ...
    msg = (rf"checkpoint {later_path} is not loadable: {shard.name}: tensor '{key}' has fingerprint [0-9a-f]{{16}}, "
           rf"meta.json records [0-9a-f]{{16}} \(its bytes changed\); newest intact checkpoint: {first}")
    with pytest.raises(CheckpointError, match=msg):  # ... the fingerprints do
        ckpt.load_shards(fresh.checkpoint_state(), later_path)
    assert all(same_bits(v, before[k]) for k, v in fresh.checkpoint_state().items())  # trainer untouched
    with pytest.raises(CheckpointError, match=msg):
        ckpt.verify(later_path, tensors=True)
    assert ckpt.newest_intact(run, tensors=True) == first
    # negative twin: the bit flipped back loads, bitwise equal to what was saved
    _flip_bit(shard, key)
    ckpt.load_shards(fresh.checkpoint_state(), later_path)
    want = _snapshot(later)
    assert all(same_bits(v, want[k]) for k, v in fresh.checkpoint_state().items())


def test_a_resume_refused_by_a_fingerprint_names_another_checkpoint_to_resume_from(two, capsys, monkeypatch):
    """checkpoint.resume=auto checks the files, not their data: when the trainer ranks refuse the newest checkpoint
    by a fingerprint, the error line names it and the resume command names the newest other one by its path
    (auto would pick the damaged one again); twin: a load that fails on intact data keeps checkpoint.resume=auto."""
    from rlalign import cli, rl

    run, first, later, _ = two

    class Job:  # the actor groups, whose trainer ranks fail to load
        def __init__(self, cfg, phase):
            pass

        def open_traces(self, start):
            pass

        def load_checkpoint(self, path):
            raise RuntimeError(f"trainer rank 0 of 1 failed in load(): CheckpointError: checkpoint {path} ...")

        def close(self, trace_timeout_s=None):
            pass

    monkeypatch.setattr(rl, "Job", Job)
    args = ["train", "run.steps=6", "logger.console=false", f"run.dir={run}", "checkpoint.resume=auto"]
    command = f"rlalign train run.steps=6 logger.console=false run.dir={run} checkpoint.resume="
    _flip_bit(_shard(later), WEIGHT)
    assert cli.main(args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(f"; {later} does not load; the newest other complete checkpoint: {first}; resume with: "
                         f"{command}{first}"), line
    _flip_bit(_shard(later), WEIGHT)  # the bit back: the data is intact, the load failed otherwise
    assert cli.main(args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith(f"; last complete checkpoint: {later}; resume with: {command}auto"), line


def test_truncated_meta_json_is_named_and_auto_resume_skips_it(two, capsys):
    run, first, later, _ = two
    assert ckpt.resolve_resume(run, "auto") == later  # twin: intact
    meta = later / "meta.json"
    meta.write_bytes(meta.read_bytes()[:100])
    msg = rf"checkpoint {later} is not loadable: meta.json: invalid JSON \(.*; 100 bytes, truncated\?\); " \
          rf"newest intact checkpoint: {first}"
    with pytest.raises(CheckpointError, match=msg):
        ckpt.verify(later)
    with pytest.raises(CheckpointError, match=msg):
        ckpt.read_meta(later)
    with pytest.raises(CheckpointError, match=msg):
        ckpt.resolve_resume(run, str(later))
    assert ckpt.resolve_resume(run, "auto") == first
    assert f"checkpoint {later} is damaged (meta.json: invalid JSON" in capsys.readouterr().err
    (first / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="none of the 2 checkpoints .* is intact"):
        ckpt.resolve_resume(run, "auto")


def test_a_meta_json_whose_step_lies_is_damage_and_auto_resume_skips_it(two, tmp_path):
    """meta.json's step, read as the step a resume continues after: one that is not the directory's (step_N) or
    not a step number (-5, true) is damage (a step of -5 resumed at step -4 and overwrote the intact
    checkpoints). The twin: the true step verifies, and a copy under another name with it too."""
    import json
    import shutil

    run, first, later, _ = two
    good = json.loads((later / "meta.json").read_text())
    for lie, what in ((-5, rf"step -5 does not match the directory {later.name}"),
                      (good["step"] + 6, rf"step {good['step'] + 6} does not match the directory {later.name}"),
                      (True, rf"step True does not match the directory {later.name}")):
        (later / "meta.json").write_text(json.dumps({**good, "step": lie}))
        with pytest.raises(CheckpointError, match=rf"checkpoint {later} is not loadable: meta.json: {what}"):
            ckpt.verify(later)
        assert ckpt.resolve_resume(run, "auto") == first
    copy = tmp_path / "mine"
    shutil.copytree(later, copy)
    (copy / "meta.json").write_text(json.dumps({**good, "step": -1}))
    with pytest.raises(CheckpointError, match=r"meta.json: step -1 is not a step number \(an int >= 0\)"):
        ckpt.verify(copy)
    (later / "meta.json").write_text(json.dumps(good))
    (copy / "meta.json").write_text(json.dumps(good))
    ckpt.verify(later)
    ckpt.verify(copy)
    assert ckpt.resolve_resume(run, "auto") == later


def test_a_run_directory_as_checkpoint_resume_is_refused_naming_its_newest_checkpoint(two, tmp_path_factory):
    run, _, later, _ = two
    for given in (run, run / "checkpoints"):
        with pytest.raises(FileNotFoundError, match=rf"checkpoint.resume='{given}': not a complete checkpoint \(no "
                                                    rf"meta.json\); it is a run's directory, whose newest intact "
                                                    rf"checkpoint is {later}$"):
            ckpt.resolve_resume(run, str(given))
    with pytest.raises(FileNotFoundError, match=rf"checkpoint.resume='{later}/meta.json': a checkpoint's meta.json, "
                                                rf"not the checkpoint; give its directory: checkpoint.resume={later}$"):
        ckpt.resolve_resume(run, str(later / "meta.json"))
    empty = tmp_path_factory.mktemp("empty")  # twin: a directory of no run names no checkpoint
    with pytest.raises(FileNotFoundError, match=r"not a complete checkpoint \(no meta.json\)$"):
        ckpt.resolve_resume(run, str(empty))
    nope = later.with_name("step_000009")
    with pytest.raises(CheckpointError, match=rf"checkpoint {nope} is not loadable: {nope}: no such directory; "
                                              rf"newest intact checkpoint: {later}"):
        ckpt.verify(nope)
    with pytest.raises(CheckpointError, match=rf"{later / 'meta.json'}: not a directory"):
        ckpt.verify(later / "meta.json")


def test_truncated_or_missing_shard_is_named(two):
    run, first, later, _ = two
    shard = _shard(later)
    data = shard.read_bytes()
    shard.write_bytes(data[:-1000])
    msg = rf"checkpoint {later} is not loadable: {shard.name}: {len(data) - 1000} bytes, meta.json records " \
          rf"{len(data)} \(truncated or overwritten\); newest intact checkpoint: {first}"
    with pytest.raises(CheckpointError, match=msg):
        ckpt.load_shards(_trainer(steps=0).checkpoint_state(), later)
    assert ckpt.resolve_resume(run, "auto") == first
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{later} is not loadable: {shard.name}: missing; newest intact"):
        ckpt.verify(later)
    shard.write_bytes(data)  # negative twin: restored, it loads
    assert ckpt.verify(later, tensors=True)["step"] == 3


def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_tensor_and_no_older_checkpoint(tmp_path, trained):
    from rlalign.config import model_args
    from rlalign.export import model_meta

    cfg = load_config([])
    meta = {"data_position": 1, "weights_fp": "-", **model_meta(model_args(cfg), cfg.model.dtype, None)}
    for step in (0, 1):  # an intact older checkpoint of the same model: not offered, it does not fit either
        ckpt.save_shards(trained.checkpoint_state(), ckpt.tmp_path(tmp_path, step))
        path = ckpt.complete(tmp_path, step, meta, keep=0)
    full = _snapshot(trained)
    one_layer = {k: v for k, v in full.items() if "layers.1." not in k}  # a trainer of fewer layers
    three_layers = {**full, "model/model.layers.2.self_attn.q_proj.weight": full[WEIGHT].clone()}
    narrower = {**full, WEIGHT: full[WEIGHT].reshape(32, -1).clone()}
    held = ("; it holds a model of hidden_size=64, num_hidden_layers=2, num_experts=8, moe_intermediate_size=64, "
            "vocab_size=64 (its meta.json)")
    for state, what in (
            (one_layer, r"tensor 'model/model.layers.1.input_layernorm.weight' \(BF16\[64\] in shard-.*\) is not part "
                        r"of the trainer's model"),
            (three_layers, r"no tensor 'model/model.layers.2.self_attn.q_proj.weight', which the trainer holds \(rank "
                           r"0\)"),
            (narrower, rf"tensor '{WEIGHT}' is BF16\[64, 64\] in shard-.*, the trainer holds BF16\[32, 128\] "
                       r"\(rank 0\)")):
        before = {k: v.clone() for k, v in state.items()}
        with pytest.raises(CheckpointError) as e:
            ckpt.load_shards(state, path)
        assert re.fullmatch(rf"checkpoint {path} does not fit this run's model or config: {what}{re.escape(held)}",
                            str(e.value)), str(e.value)
        assert all(same_bits(v, before[k]) for k, v in state.items())  # untouched
    back = {k: torch.zeros_like(v) for k, v in full.items()}  # twin: the trainer's own shape loads, bit for bit
    ckpt.load_shards(back, path)
    assert all(same_bits(back[k], full[k]) for k in full)


def test_an_old_pickle_format_checkpoint_is_refused_not_loaded(tmp_path, trained):
    path = _save(trained, tmp_path, 0)
    meta = json.loads((path / "meta.json").read_text())
    del meta["format"]
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json: format None, expected .*pickled DCP .metadata"):
        ckpt.load_shards(_trainer(steps=0).checkpoint_state(), path)


@contextmanager
def _disk_full_after(nbytes: int):
    """Checkpoint files' writes fail with ENOSPC after nbytes (a part of the file is written)."""
    from rlalign import checkpoint_write

    def full(path, head, parts):
        with open(path, "wb") as f:
            f.write(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    mp = pytest.MonkeyPatch()
    mp.setattr(checkpoint_write, "write_file", full)
    try:
        yield
    finally:
        mp.undo()


def test_enospc_raises_one_line_and_leaves_the_previous_checkpoint_loadable(tmp_path, trained, monkeypatch):
    first = _save(trained, tmp_path, 1)
    later = _trainer(steps=2)
    tmp = ckpt.tmp_path(tmp_path, 3)
    msg = rf"^checkpoint of step 3 not written \(rank 0\): {tmp}: No space left on device \(ENOSPC\); " \
          rf"the previous checkpoint {first} is intact$"
    with _disk_full_after(4096), pytest.raises(CheckpointError, match=msg) as e:
        ckpt.save_shards(later.checkpoint_state(), tmp)
    assert "\n" not in str(e.value) and not tmp.exists()
    # the driver's meta.json write fails the same way
    ckpt.save_shards(later.checkpoint_state(), tmp)

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with monkeypatch.context() as m:
        m.setattr(checkpoint_files, "_write_file", full)
        with pytest.raises(CheckpointError, match=r"^checkpoint of step 3 not written: .*meta.json.part: No space left "
                                                  rf"on device \(ENOSPC\); the previous checkpoint {first} is intact$"):
            ckpt.complete(tmp_path, 3, {"data_position": 4}, keep=0)
    assert not tmp.exists() and ckpt.list_complete(tmp_path) == [first]
    assert ckpt.resolve_resume(tmp_path, "auto") == first
    fresh = _trainer(steps=0)
    ckpt.load_shards(fresh.checkpoint_state(), first)
    want = _snapshot(trained)
    assert all(same_bits(v, want[k]) for k, v in fresh.checkpoint_state().items())
    # negative twin: with space, the same save completes
    ckpt.save_shards(later.checkpoint_state(), tmp)
    assert ckpt.complete(tmp_path, 3, {"data_position": 4}, keep=0) == ckpt.resolve_resume(tmp_path, "auto")


# --- EP sizes: the keys don't depend on the EP size (run in spawned gloo ranks) ---------------------
def _ep_save(rank, world, group, cfg_dict, path):
    from rlalign.fingerprint import state_fingerprints

    tr = _trainer(steps=1, group=group, cfg=cfg_dict)
    ckpt.save_shards(tr.checkpoint_state(), path, rank, group, bucket_bytes=256 << 10)  # several files per rank
    return state_fingerprints({k: v.cpu() for k, v in tr.checkpoint_state().items()})


def _ep_load(rank, world, group, cfg_dict, path):
    from rlalign.fingerprint import state_fingerprints

    tr = _trainer(steps=0, group=group, cfg=cfg_dict)
    ckpt.load_shards(tr.checkpoint_state(), path, rank, group)
    return state_fingerprints({k: v.cpu() for k, v in tr.checkpoint_state().items()})


@pytest.mark.slow
def test_a_checkpoint_written_at_ep2_loads_bitwise_at_ep1_and_ep2(tmp_path):
    from omegaconf import OmegaConf
    from test_checkpoint_writers import written

    from rlalign.fingerprint import state_fingerprints
    from rlalign.parallel import launch

    cfg = OmegaConf.to_container(load_config(["trainer.ep_size=2", "trainer.micro_batch_size=2",
                                              "dist.timeout_s=60"]), resolve=True)
    tmp = ckpt.tmp_path(tmp_path, 0)
    saved = launch.run_workers(2, _ep_save, (cfg, str(tmp)), timeout_s=120)
    path = ckpt.complete(tmp_path, 0, {}, keep=0)
    meta = ckpt.read_meta(path)
    assert meta["world"] == 2 and {ckpt.rank_of_file(f) for f in meta["files"]} == {0, 1} and len(meta["files"]) > 4
    union = {**saved[0], **saved[1]}
    assert all(saved[0][k] == saved[1][k] for k in saved[0].keys() & saved[1].keys())  # replicated: same bits
    on_disk = written(path)  # each replicated tensor written by the holder the greedy names: even bytes
    held = {k: ([r for r in (0, 1) if k in saved[r]], n) for keys in on_disk.values() for k, n in keys.items()}
    assert {k: r for r, keys in on_disk.items() for k in keys} == {k: w for k, (w, _) in cw.writers(held).items()}
    per_rank = [sum(on_disk[r].values()) for r in (0, 1)]
    largest = max(n for ranks, n in held.values() if len(ranks) > 1)
    assert abs(per_rank[0] - per_rank[1]) <= largest, (per_rank, largest)
    lowest = [sum(n for ranks, n in held.values() if min(ranks) == r) for r in (0, 1)]  # negative twin
    assert lowest[0] - lowest[1] > 10 * largest, (lowest, largest)  # the lowest holder: rank 0 writes more
    one = _trainer(steps=0)  # EP 1 holds every expert
    ckpt.load_shards(one.checkpoint_state(), path)
    assert state_fingerprints({k: v.cpu() for k, v in one.checkpoint_state().items()}) == union
    assert launch.run_workers(2, _ep_load, (cfg, str(path)), timeout_s=120) == saved


# --- asynchronous saves --------------------------------------------------------------------------
def _parts(shard: Path) -> tuple[dict, bytes]:
    """A safetensors file as (parsed header, tensor bytes). Not the raw file: safetensors writes the
    header's __metadata__ map in hash order, so two synchronous saves of one state already differ
    there (seen: 5 of 6 saves in one process)."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"] = {k: json.loads(v) if k == "DCP_SHARDING_INFO" else v
                              for k, v in header.get("__metadata__", {}).items()}
    return header, raw[8 + n :]


def _publish(run_dir: Path, step: int) -> dict:
    return {"run_dir": str(run_dir), "step": step, "meta": {"data_position": step + 1, "weights_fp": "-"}, "keep": 0}


def test_async_save_returns_before_the_write_and_writes_the_synchronous_bytes(tmp_path, trained, monkeypatch):
    import threading

    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample

    want = _save(trained, tmp_path / "sync", 1)
    gate = threading.Event()

    from rlalign import checkpoint_write

    real = checkpoint_write.write_files

    def held(*args, **kwargs):  # the write waits until the test lets it go
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_write, "write_files", held)  # what rlalign.checkpoint writes through
    tr, run = _trainer(steps=1), tmp_path / "async"
    saver = ckpt.AsyncSaver()
    saver.save(tr.checkpoint_state(), ckpt.tmp_path(run, 1), publish=_publish(run, 1))
    assert ckpt.list_complete(run) == []  # returned while the write is held
    gate.set()
    got = saver.wait()  # the trainer's next update waits for this (TrainerWorker.train_step)
    samples = [Sample([3, 4], [5, 6], torch.zeros(2), params=SamplingParams())]
    tr.forward_backward(samples, lambda lps, idx: (-torch.cat(lps).sum(), {}), 2)
    tr.optimizer_step()
    assert got == ckpt.checkpoint_dir(run) / "step_000001" and ckpt.list_complete(run) == [got]
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
    assert _parts(_shard(got)) == _parts(_shard(want))  # bitwise the synchronous save
    meta_a, meta_b = ckpt.read_meta(want), ckpt.read_meta(got)
    assert meta_a["tensors"] == meta_b["tensors"] and meta_a["files"] == meta_b["files"]
    ckpt.verify(got, tensors=True)
    assert saver.wait() is None  # nothing in flight


def test_a_failed_async_save_is_raised_by_wait_and_the_newest_intact_checkpoint_stays_findable(tmp_path, trained):
    first = _save(trained, tmp_path, 1)
    later = _trainer(steps=2)
    tmp = ckpt.tmp_path(tmp_path, 3)
    saver = ckpt.AsyncSaver()
    msg = rf"^checkpoint of step 3 not written \(rank 0\): {tmp}: No space left on device \(ENOSPC\); " \
          rf"the previous checkpoint {first} is intact$"
    with _disk_full_after(4096):
        saver.save(later.checkpoint_state(), tmp, publish=_publish(tmp_path, 3))
        with pytest.raises(CheckpointError, match=msg):
            saver.wait()
    assert not tmp.exists() and ckpt.list_complete(tmp_path) == [first]
    # a process killed mid-save leaves its .tmp directory (part of a shard, no meta.json): ignored
    killed = ckpt.tmp_path(tmp_path, 5)
    killed.mkdir()
    (killed / ckpt.shard_name(0)).write_bytes(_shard(first).read_bytes()[:1000])
    assert ckpt.newest_intact(tmp_path, tensors=True) == first == ckpt.resolve_resume(tmp_path, "auto")
    # negative twin: with space, the same asynchronous save completes and becomes the newest
    saver.save(later.checkpoint_state(), tmp, publish=_publish(tmp_path, 3))
    assert saver.wait() == ckpt.newest_intact(tmp_path, tensors=True) == ckpt.resolve_resume(tmp_path, "auto")
