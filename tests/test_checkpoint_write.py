"""rlalign.checkpoint_write: its files are what safetensors writes (DCP's reader loads them), and a
staged save lets the trainer change its tensors while the files hold the state of the save."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import same_bits
from safetensors.torch import save as st_save

from rlalign import checkpoint as ckpt
from rlalign import checkpoint_write as cw


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dt in enumerate(ckpt.ST_DTYPE):
        x = torch.randn(3, 5, generator=g) * 50
        out[f"t{(7 * i) % 11:02d}"] = x > 0 if dt == torch.bool else x.to(dt)
    out["scalar"] = torch.tensor(3, dtype=torch.int64)
    out["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    return out


def _dcp_meta(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {"DCP_SHARDING_INFO": json.dumps({k: {"saved_offsets": [0] * t.dim()} for k, t in tensors.items()}),
            "DCP_VERSION": "1.0", "format": "pt"}


def _parts(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def test_a_file_is_what_safetensors_writes_for_every_dtype(tmp_path):
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    cw.write_file(path, cw.header(tensors), [cw._bytes_of(tensors[k]) for k in cw.file_order(tensors)])
    want = st_save(tensors, metadata=_dcp_meta(tensors))
    got = path.read_bytes()
    assert _parts(got) == _parts(want) and len(got) == len(want)  # the header's map order aside: its values
    assert list(_parts(got)[0])[1:] == list(_parts(want)[0])[1:]  # the tensors in safetensors' order
    # negative twin: the tensors' bytes in another order are not safetensors' layout
    other = sorted(tensors)
    cw.write_file(path, cw.header(tensors), [cw._bytes_of(tensors[k]) for k in other])
    assert _parts(path.read_bytes())[1] != _parts(want)[1]


def _state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.arange(4096, dtype=torch.float32) + i for i in range(8)}


@pytest.mark.parametrize("staging", ["host", "stream"])
def test_a_staged_save_frees_the_tensors_at_once_and_writes_the_state_of_the_save(tmp_path, monkeypatch, staging):
    gate, real = threading.Event(), cw.write_files

    def held(*args, **kwargs):  # the write waits until the test lets it go
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(cw, "write_files", held)
    state = _state()
    want = {k: v.clone() for k, v in state.items()}
    saver = ckpt.AsyncSaver(staging=staging, say=lambda line: None)
    saver.save(state, ckpt.tmp_path(tmp_path, 0), bucket_bytes=32 << 10)
    if staging == "host":
        assert saver.wait_tensors() >= 0 and saver._pending is not None  # not waited for: the write is held
        for v in state.values():
            v.add_(1)  # the trainer's next update
        gate.set()
    else:  # negative twin: a streamed save reads the trainer's tensors; wait_tensors waits for its write
        threading.Timer(0.2, gate.set).start()
        saver.wait_tensors()
        assert gate.is_set() and saver._pending is None
    saver.wait()
    path = ckpt.complete(tmp_path, 0, {}, keep=0)
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    ckpt.load_shards(back, path)
    assert all(same_bits(back[k], v) for k, v in want.items())


def test_auto_staging_needs_twice_the_state_in_available_memory():
    staged, line = cw.choose_staging("auto", 10 << 30, 20 << 30)
    assert staged and "copied into host buffers" in line and "\n" not in line
    staged, line = cw.choose_staging("auto", 10 << 30, (20 << 30) - 1)  # negative twin: one byte short
    assert not staged and "each save stalls the next update" in line and "checkpoint.staging=host" in line
    assert cw.choose_staging("host", 10 << 30, None)[0] and not cw.choose_staging("stream", 1, 1 << 40)[0]


def test_a_synchronous_save_stages_nothing_and_says_training_waits_for_it():
    staged, line = cw.choose_staging("sync", 10 << 30, 1 << 40)  # checkpoint.async_save=false
    assert not staged and line == ("checkpoint staging: none (checkpoint.async_save=false): this rank's 10.7 GB is "
                                   "written before training goes on")
    staged, line = cw.choose_staging("auto", 10 << 30, 1 << 40)  # twin: the background save with room stages
    assert staged and "training goes on while the files are written" in line


def test_the_buffers_a_staged_save_holds_count_as_room_for_the_next(tmp_path, monkeypatch):
    state, said = _state(), []
    size = sum(v.nbytes for v in state.values())
    saver = ckpt.AsyncSaver(say=said.append)
    free = {"spare": 0}  # what MemAvailable shows beyond the saver's buffers, which it no longer counts
    monkeypatch.setattr(cw, "host_memory_available", lambda: 2 * size + free["spare"] - saver.buffers.held_bytes)
    for step in range(2):
        saver.save(state, ckpt.tmp_path(tmp_path, step), bucket_bytes=32 << 10)
        saver.wait()
        assert saver.buffers.held_bytes == size
    assert len(said) == 1 and "copied into host buffers" in said[0]  # said once
    free["spare"] = -1  # negative twin: one byte short, the next save streams and lets its buffers go
    saver.save(state, ckpt.tmp_path(tmp_path, 2), bucket_bytes=32 << 10)
    saver.wait()
    assert saver.buffers.held_bytes == 0 and len(said) == 2 and "stalls the next update" in said[1]
