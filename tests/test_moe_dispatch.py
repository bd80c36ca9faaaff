"""The one-launch MoE dispatch (kernels/triton/dispatch.py, the Triton interpreter here) gives the same
integers as the torch counting sort (rlalign.kernels.torch_deterministic.moe_dispatch): order, dest and counts, for
decode-sized row counts, skewed and empty experts, expert counts that are not powers of two."""

import pytest
import torch

from rlalign.kernels.torch_deterministic import moe_dispatch as dispatch_torch

dispatch = pytest.importorskip("rlalign.kernels.triton.dispatch")


def _ids(n, e, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most rows to two experts, most experts empty
        return torch.where(torch.rand(n, generator=g) < 0.9, torch.randint(0, 2, (n,), generator=g) * (e - 1),
                           torch.randint(0, e, (n,), generator=g))
    return torch.randint(0, e, (n,), generator=g)


@pytest.mark.parametrize("n,e,skew", [(0, 8, False), (1, 8, False), (7, 8, False), (130, 5, False),
                                      (2048, 64, False), (2048, 64, True), (300, 128, True), (513, 3, True),
                                      (5000, 16, False)])
def test_triton_dispatch_equals_the_torch_counting_sort(n, e, skew):
    flat = _ids(n, e, seed=n + e, skew=skew)
    want = dispatch_torch(flat, e)
    got = dispatch.moe_dispatch(flat, e)
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    order, dest, counts = got
    assert torch.equal(order[dest], torch.arange(n))  # dest inverts order


@pytest.mark.parametrize("n,e,skew", [(5000, 3, False), (777, 5, True), (4097, 8, False), (2049, 2, True)])
def test_triton_dispatch_in_segments_equals_the_torch_counting_sort(n, e, skew, monkeypatch):
    """Past SEGMENT_ROWS (lowered here) the rows are counted and placed per (expert, segment of SEGMENT
    rows, a block each): the same integers."""
    monkeypatch.setattr(dispatch, "SEGMENT_ROWS", 100)
    monkeypatch.setattr(dispatch, "SEGMENT", 256)
    flat = _ids(n, e, seed=n * e, skew=skew)
    for w, g in zip(dispatch_torch(flat, e), dispatch.moe_dispatch(flat, e), strict=True):
        assert torch.equal(g, w)


def test_triton_dispatch_refuses_more_rows_than_a_launch_takes():
    with pytest.raises(ValueError, match="exceed MAX_ROWS"):
        dispatch.moe_dispatch(torch.zeros(dispatch.MAX_ROWS + 1, dtype=torch.long), 8)


def test_triton_dispatch_gives_an_id_outside_the_experts_no_group_and_a_safe_dest():
    # NaN router logits can give an id == num_experts: that row is in no group (counts miss it) and
    # its dest is 0 (a row the combine may read), never uninitialised memory; the others are placed as usual
    flat = torch.tensor([3, 8, 1, 3, 0, 8, 2])
    order, dest, counts = dispatch.moe_dispatch(flat, 8)
    assert counts.tolist() == [1, 1, 1, 2, 0, 0, 0, 0]
    assert dest[1] == 0 and dest[5] == 0
    assert order[:5].tolist() == [4, 2, 6, 0, 3] and dest[[0, 2, 3, 4, 6]].tolist() == [3, 1, 4, 0, 2]


def test_triton_dispatch_in_segments_gives_an_id_outside_the_experts_no_group(monkeypatch):
    """The segmented path: rows with id == num_experts in several segments get dest 0 and no group, the
    others the torch counting sort's places among themselves (twin: with those rows moved to expert 0,
    expert 0's count changes)."""
    monkeypatch.setattr(dispatch, "SEGMENT_ROWS", 10)
    monkeypatch.setattr(dispatch, "SEGMENT", 16)
    flat = _ids(70, 8, seed=5)
    flat[[3, 20, 21, 69]] = 8
    order, dest, counts = dispatch.moe_dispatch(flat, 8)
    good = flat < 8
    w_order, w_dest, w_counts = dispatch_torch(flat[good], 8)
    assert torch.equal(counts, w_counts) and bool((dest[~good] == 0).all())
    assert torch.equal(dest[good], w_dest) and torch.equal(order[:66], good.nonzero()[:, 0][w_order])
    assert not torch.equal(dispatch.moe_dispatch(torch.where(good, flat, 0), 8)[2], counts)
