"""Checkpoint writers: a tensor held by several ranks is written once, by the holder that evens the
ranks' written bytes (checkpoint_write.writers), and every checkpoint loads bitwise wherever its
tensors lie, at another world size too."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import same_bits

from rlalign import checkpoint as ckpt
from rlalign import checkpoint_write as cw

# {key: (elements, dtype)}: held by both ranks (the same bits), or by one (its own)
REPLICATED = {"ra": (1000, torch.float32), "rb": (1200, torch.bfloat16), "rc": (500, torch.float32),
              "rd": (250, torch.float32), "re": (500, torch.bfloat16)}
SHARDED = {0: {"s0": (100, torch.float32)}, 1: {"s1": (300, torch.float32)}}
# the greedy's answer: ranks start at s0 400 B, s1 1200 B; ra 4000 -> 0 (4400), rb 2400 -> 1 (3600),
# rc 2000 -> 1 (5600), then rd and re 1000 each (ties by key): rd -> 0 (5400), re -> 0 (6400)
BALANCED = {0: {"s0", "ra", "rd", "re"}, 1: {"s1", "rb", "rc"}}
FIRST_HOLDER = {0: {"s0", "ra", "rb", "rc", "rd", "re"}, 1: {"s1"}}


def _tensors(spec: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(n, generator=g).to(dt) for k, (n, dt) in spec.items()}


def _state(rank: int) -> dict[str, torch.Tensor]:
    return {**_tensors(REPLICATED, 0), **_tensors(SHARDED[rank], 1 + rank)}


def _first_holder(held: dict[str, tuple[list[int], int]]) -> dict[str, tuple[int, int]]:
    """Each tensor written by the lowest rank holding it: all replicated bytes on rank 0."""
    return {k: (min(ranks), n) for k, (ranks, n) in held.items()}


def _save(rank, world, group, balanced: str, first: str):
    ckpt.save_shards(_state(rank), balanced, rank, group, bucket_bytes=4096)  # several files per rank
    cw.writers = _first_holder  # this spawned rank only: the files a lowest-holder writer leaves
    ckpt.save_shards(_state(rank), first, rank, group, bucket_bytes=4096)


def _load(rank, world, group, paths: list[str]):
    out = []
    for p in paths:
        back = {k: torch.zeros_like(v) for k, v in _state(rank).items()}
        ckpt.load_shards(back, p, rank, group)
        out.append(back)
    return out


def written(path: Path) -> dict[int, dict[str, int]]:
    """{rank: {key: bytes}} of the tensors in each rank's files, read from their headers."""
    out: dict[int, dict[str, int]] = {}
    for f in ckpt.read_meta(path)["files"]:
        raw = (path / f).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for k, h in json.loads(raw[8 : 8 + n]).items():
            if k != "__metadata__":
                out.setdefault(ckpt.rank_of_file(f), {})[k] = h["data_offsets"][1] - h["data_offsets"][0]
    return out


def test_replicated_tensors_are_written_by_the_holder_with_the_fewest_bytes_and_load_anywhere(tmp_path):
    from rlalign.parallel import launch

    runs = {"balanced": tmp_path / "balanced", "first": tmp_path / "first"}
    launch.run_workers(2, _save, tuple(str(ckpt.tmp_path(r, 0)) for r in runs.values()), timeout_s=120)
    paths = {name: ckpt.complete(r, 0, {}, keep=0) for name, r in runs.items()}
    got = {name: written(p) for name, p in paths.items()}
    held = {k: ([r for r in (0, 1) if k in _state(r)], v.numel() * v.element_size())
            for k, v in {**_state(0), **_state(1)}.items()}
    assert {w: {k for k, (r, _) in cw.writers(held).items() if r == w} for w in (0, 1)} == BALANCED
    assert {r: set(keys) for r, keys in got["balanced"].items()} == BALANCED
    assert {r: sum(keys.values()) for r, keys in got["balanced"].items()} == {0: 6400, 1: 5600}
    files = {name: {r: sum(m["bytes"] for f, m in ckpt.read_meta(p)["files"].items() if ckpt.rank_of_file(f) == r)
                    for r in (0, 1)} for name, p in paths.items()}
    assert max(files["balanced"].values()) < 1.25 * min(files["balanced"].values())  # headers included
    # negative twin: the lowest holder writes every replicated tensor, rank 0 nine tenths of the bytes
    assert {r: set(keys) for r, keys in got["first"].items()} == FIRST_HOLDER
    assert {r: sum(keys.values()) for r, keys in got["first"].items()} == {0: 10800, 1: 1200}
    assert files["first"][0] > 5 * files["first"][1]
    # both load bitwise: at world 1 (every tensor) and at world 2 (each rank its own)
    want = {**_state(0), **_state(1)}
    for p in paths.values():
        ckpt.verify(p, tensors=True)
        one = {k: torch.zeros_like(v) for k, v in want.items()}
        ckpt.load_shards(one, p)
        assert all(same_bits(one[k], v) for k, v in want.items())
    loaded = launch.run_workers(2, _load, (list(map(str, paths.values())),), timeout_s=120)
    for rank, per_path in enumerate(loaded):
        assert all(same_bits(t, _state(rank)[k]) for back in per_path for k, t in back.items())


def test_the_greedy_answer_among_each_tensors_holders():
    held = {"big": ([0, 1, 2], 900), "x": ([0, 1], 800), "y": ([0, 1], 800), "mid": ([1, 2], 500),
            "own0": ([0], 100), "own2": ([2], 50), "none": ([0, 1, 2], 0)}
    got = cw.writers(held)
    # loads 100 / 0 / 50: big -> 1 (900); x -> 0 (900); y: 900 and 900, the tie to the lower rank -> 0;
    # mid -> 2 (550); none -> 2 (the fewest)
    assert got == {"big": (1, 900), "mid": (2, 500), "none": (2, 0), "own0": (0, 100), "own2": (2, 50),
                   "x": (0, 800), "y": (0, 800)}
    assert all(got[k][0] in ranks for k, (ranks, _) in held.items())
    assert cw.writers(dict(reversed(held.items()))) == got  # the same answer from any order of the layout
    # negative twin: the lowest holder's rule gives rank 0 2600 bytes, rank 1 500 and rank 2 50
    first = _first_holder(held)
    assert first != got
    assert {r: sum(n for w, n in first.values() if w == r) for r in (0, 1, 2)} == {0: 2600, 1: 500, 2: 50}
