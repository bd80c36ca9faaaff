"""The Triton paged attention kernel and split-K decode on CPU through TRITON_INTERPRET=1 (tiny shapes;
the interpreter uses 16-key blocks and 32-key chunks, so these rows cross chunk boundaries): paged ==
decode == prefill bitwise, split-K == chunks folded in registers, and a negative twin (another chunk
size moves bits). GPU shapes and bits: tests/gpu/test_triton_paged_gpu.py."""

import os

import pytest
import torch
from conftest import same_bits

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.kernels.triton import attention as attn  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the split-K schedule (attention.chunks_per_program): a program per chunk / per two chunks, chunks folded in
# registers, the size-based schedule
SCHEDULE = {"split1": 1, "split2": 2, "registers": 0, "auto": None}


SIZE_BASED = attn.chunks_per_program


def _schedule(monkeypatch, spp):
    """Every rows launch takes spp chunks per program (None: the size-based schedule)."""
    monkeypatch.setattr(attn, "chunks_per_program", SIZE_BASED if spp is None else lambda *a: spp)


def _packed(lens, H=4, Hk=2, D=16, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    N = sum(lens)
    q, k, v = (torch.randn(N, h, D, generator=g).to(dtype).to(DEV) for h in (H, Hk, Hk))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return q, k, v, cu


def _pages(k, v, lens, page_size, num_pages, seed=0):
    """k, v written into shuffled pages (NaN / inf everywhere else); block table [S, max_pages] int32
    (unused entries point at page 0), seq_idx and positions of every packed row."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)
    need = [-(-n // page_size) for n in lens]
    table = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)  # a spare column past every sequence
    off = 0
    for s, c in enumerate(need):
        table[s, :c] = perm[off : off + c].to(torch.int32)
        off += c
    seq_idx = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    slot = table[seq_idx, pos // page_size].long() * page_size + pos % page_size
    Hk, D = k.shape[1:]
    kp = torch.full((num_pages, page_size, Hk, D), float("nan"), dtype=k.dtype)
    vp = torch.full((num_pages, page_size, Hk, D), float("inf"), dtype=v.dtype)
    kp.flatten(0, 1)[slot], vp.flatten(0, 1)[slot] = k.cpu(), v.cpu()
    return kp.to(DEV), vp.to(DEV), table.to(DEV), seq_idx.to(DEV), pos.to(DEV)


@pytest.mark.parametrize("mode", ["split1", "registers"])
@pytest.mark.parametrize("page_size", [8, 16, 32])  # smaller than, equal to and larger than the 16-key block
def test_paged_rows_equal_prefill_rows(page_size, mode, monkeypatch):
    _schedule(monkeypatch, SCHEDULE[mode])
    lens = [5, 37, 1, 20]  # ragged; 37 crosses the 32-key chunk
    q, k, v, cu = _packed(lens)
    pre = tb.attention_prefill(q, k, v, cu, 0.25)
    kp, vp, table, seq_idx, pos = _pages(k, v, lens, page_size, 16)
    perm = torch.randperm(len(pos), generator=torch.Generator().manual_seed(1)).to(DEV)  # rows in any order
    out = tb.attention_paged(q[perm], kp, vp, table, seq_idx[perm], pos[perm], 0.25)
    assert same_bits(out, pre[perm])


def test_paged_mixed_step_of_prefill_chunks_and_decode_rows(monkeypatch):
    """One engine step: a fresh prefill chunk, a chunk after a cached prefix and two decode rows; split-K
    with two chunks per program."""
    _schedule(monkeypatch, 2)
    lens = [37, 50, 9, 66]
    q, k, v, cu = _packed(lens, seed=3)
    pre = tb.attention_prefill(q, k, v, cu, 0.25)
    kp, vp, table, seq_idx, pos = _pages(k, v, lens, 16, 20, seed=4)
    rows = torch.cat([torch.arange(cu[0], cu[0] + 12), torch.arange(cu[1] + 30, cu[2]), torch.tensor([cu[3] - 1]),
                      torch.tensor([cu[2] + 4])]).to(DEV)
    out = tb.attention_paged(q[rows], kp, vp, table, seq_idx[rows], pos[rows], 0.25)
    assert same_bits(out, pre[rows])


def test_prompt_runs_as_prefill_tiles_equal_rows_alone():
    """The engine's hint `runs` (prompt chunks after the decode rows) runs those rows as prefill tiles
    read through the block table: the same bits as one program per row, and as prefill. Chunks: a
    fresh prompt longer than a tile and a chunk after a cached prefix, behind two decode rows.
    Twin: runs that misstate a chunk's first position move bits."""
    lens = [37, 50, 9, 66]
    q, k, v, cu = _packed(lens, seed=3)
    pre = tb.attention_prefill(q, k, v, cu, 0.25)
    kp, vp, table, seq_idx, pos = _pages(k, v, lens, 16, 20, seed=4)
    rows = torch.cat([torch.tensor([cu[3] - 1, cu[2] + 4]), torch.arange(cu[0], cu[0] + 37),
                      torch.arange(cu[1] + 30, cu[2])]).to(DEV)
    runs = [(2, 37, 0, 0), (39, 20, 30, 1)]
    args = (q[rows], kp, vp, table, seq_idx[rows], pos[rows], 0.25)
    tiles = tb.attention_paged(*args, runs=runs)
    assert same_bits(tiles, tb.attention_paged(*args)) and same_bits(tiles, pre[rows])
    off = tb.attention_paged(*args, runs=[(2, 37, 0, 0), (39, 20, 29, 1)])
    assert not same_bits(off, tiles) and same_bits(off[:39], tiles[:39])
    with pytest.raises(ValueError, match="not the last rows"):
        tb.attention_paged(*args, runs=[(2, 37, 0, 0)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_equals_prefill_at_every_position_every_schedule(dtype, monkeypatch):
    T = 40
    q, k, v, cu = _packed([T], seed=5, dtype=dtype)
    pre = tb.attention_prefill(q, k, v, cu, 0.25)
    kc = torch.zeros(1, 70, 2, 16, dtype=dtype, device=DEV)  # 3 chunks of capacity
    vc = torch.zeros_like(kc)
    kc[0, :T], vc[0, :T] = k, v
    # one decode batch of T rows, row t at position t, over a stride-0 view of the one cache
    kb, vb = kc.expand(T, -1, -1, -1), vc.expand(T, -1, -1, -1)
    lengths = torch.arange(1, T + 1, device=DEV)
    for mode in SCHEDULE:
        _schedule(monkeypatch, SCHEDULE[mode])
        assert same_bits(tb.attention_decode(q, kb, vb, lengths, 0.25), pre), mode
    # a batch of one at a few positions (other rows never change a row's bits), split-K
    _schedule(monkeypatch, 1)
    for t in (0, 31, 32, 39):
        dec = tb.attention_decode(q[t : t + 1], kc, vc, torch.tensor([t + 1], device=DEV), 0.25)
        assert same_bits(dec[0], pre[t]), t


@pytest.mark.parametrize("page_size", [8, 32])
def test_split_k_fold_leaves_bits_alone(page_size, monkeypatch):
    """Split-K folded by the last split program of a row (ticket counters, left zero) or in registers:
    the same bits."""
    lens = [70, 9, 33]
    q, k, v, cu = _packed(lens, seed=10)
    pre = tb.attention_prefill(q, k, v, cu, 0.25)
    kp, vp, table, seq_idx, pos = _pages(k, v, lens, page_size, 16, seed=11)
    rows = torch.tensor([69, 31, 32, 0, 75, 78, 111, 100], device=DEV)  # ragged, both sides of chunk ends
    kc = torch.zeros(len(lens), 80, 2, 16, dtype=k.dtype, device=DEV)
    vc = torch.zeros_like(kc)
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        kc[s, : b - a], vc[s, : b - a] = k[a:b], v[a:b]
    last = torch.tensor(cu[1:], device=DEV) - 1
    for spp in (1, 2, 0):
        _schedule(monkeypatch, spp)
        out = tb.attention_paged(q[rows], kp, vp, table, seq_idx[rows], pos[rows], 0.25)
        assert same_bits(out, pre[rows]), spp
        dec = tb.attention_decode(q[last], kc, vc, torch.tensor(lens, device=DEV), 0.25)
        assert same_bits(dec, pre[last]), spp
    assert attn.ticket_buffers()
    assert all(int(t.abs().sum()) == 0 for t in attn.ticket_buffers())  # every launch reset its counters


@pytest.mark.parametrize("heads_minor", [False, True])
@pytest.mark.parametrize("pre_max,off32", [(256, True), (0, False)])  # the bf16 and the fp32 configs' settings
def test_preloaded_pages_leave_bits_alone(pre_max, off32, heads_minor, monkeypatch):
    """A program's table entries loaded all at once before its key loop and picked by tl.gather (up to
    PAGED_PRE_MAX of them) or loaded per key block, with int32 or int64 key offsets; pages smaller than,
    equal to and not dividing the 32-key chunk, split-K and in registers, on a (row, kv head) grid or a
    1-D one with a row's kv heads adjacent (HEADS_MINOR): the bits of prefill."""
    lens = [70, 9, 33]
    q, k, v, cu = _packed(lens, seed=14)
    pre_out = tb.attention_prefill(q, k, v, cu, 0.25)
    rows = torch.tensor([69, 31, 32, 0, 75, 78, 111, 100, 47], device=DEV)
    base = dict(attn.INTERPRET_ATTN["decode"])
    monkeypatch.setitem(attn.INTERPRET_ATTN, "decode", dict(base, PAGED_PRE_MAX=pre_max, PAGED_OFF32=off32,
                                                                  HEADS_MINOR=heads_minor))
    for page_size in (8, 16, 48):
        kp, vp, table, seq_idx, pos = _pages(k, v, lens, page_size, 24, seed=15)
        for spp in (1, 2, 0):
            _schedule(monkeypatch, spp)
            out = tb.attention_paged(q[rows], kp, vp, table, seq_idx[rows], pos[rows], 0.25)
            assert same_bits(out, pre_out[rows]), (page_size, spp)


def test_negative_twin_another_chunk_size_moves_bits(monkeypatch):
    """The chunk size is part of the contract: prefill reduced with 16- or 64-key chunks (the same
    blocks, folded at other points) differs from the 32-key chunks the decode rows use (fp32: a bf16
    output can round the difference away)."""
    T = 70
    q, k, v, cu = _packed([T], seed=6, dtype=torch.float32)
    kc, vc = k[None].contiguous(), v[None].contiguous()
    dec = tb.attention_decode(q, kc.expand(T, -1, -1, -1), vc.expand(T, -1, -1, -1), torch.arange(1, T + 1), 0.25)
    assert same_bits(tb.attention_prefill(q, k, v, cu, 0.25), dec)
    for chunk in (16, 64):
        monkeypatch.setitem(attn.INTERPRET_ATTN, "CHUNK", chunk)
        other = tb.attention_prefill(q, k, v, cu, 0.25)
        assert not same_bits(other, dec), chunk
        assert same_bits(other[:16], dec[:16])  # rows inside the first chunk of both: unchanged


def test_paged_refuses_bad_input_clearly():
    q = torch.zeros(2, 4, 16, device=DEV)
    kp = torch.zeros(4, 16, 2, 16, device=DEV)
    with pytest.raises(ValueError, match="block_table"):
        tb.attention_paged(q, kp, kp, torch.zeros(2, 2, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV),
                           torch.zeros(2, dtype=torch.long, device=DEV), 0.25)
    with pytest.raises(ValueError, match="k_pages"):
        tb.attention_paged(q, kp[0], kp[0], torch.zeros(2, 2, dtype=torch.int32, device=DEV),
                           torch.zeros(2, dtype=torch.long, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV),
                           0.25)
