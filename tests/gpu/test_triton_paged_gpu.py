"""GPU: the attention kernels' bitwise promises at real shapes (bf16, head_dim 128, GQA 32/8, up to
4,096 keys, the pinned tiles and key chunks): paged == decode == prefill at every position, split-K ==
chunks folded in registers, page sizes 16 and 32 with ragged lengths and shuffled block tables; a
negative twin (another chunk size moves bits); the backward against fp32 SDPA and run to run."""

import math

import pytest
import torch
from conftest import same_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, HK, D = 32, 8, 128
SCALE = 1 / math.sqrt(D)
# the split-K schedule (attention.chunks_per_program): 1 / 4 chunks per program, chunks folded in registers, the
# size-based schedule
SCHEDULE = {"split1": 1, "split4": 4, "registers": 0, "auto": None}


def _schedule(monkeypatch, spp):
    """Every rows launch takes spp chunks per program (None: the size-based schedule)."""
    from rlalign.kernels.triton import attention as attn

    if not hasattr(_schedule, "size_based"):
        _schedule.size_based = attn.chunks_per_program
    monkeypatch.setattr(attn, "chunks_per_program", _schedule.size_based if spp is None else lambda *a: spp)


def _packed(lens, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = sum(lens)
    q, k, v = (torch.randn(N, h, D, device="cuda", generator=g).to(dtype) for h in (H, HK, HK))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return q, k, v, cu


def _pages(k, v, lens, page_size, seed):
    """k, v in shuffled pages (NaN elsewhere), block table with a spare column, seq_idx, positions."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 7
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    off = 0
    for s, c in enumerate(need):
        table[s, :c] = perm[off : off + c].to(torch.int32)
        off += c
    table = table.cuda()
    seq_idx = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)]).cuda()
    pos = torch.cat([torch.arange(n) for n in lens]).cuda()
    slot = table[seq_idx, pos // page_size].long() * page_size + pos % page_size
    kp = torch.full((num_pages, page_size, HK, D), float("nan"), device="cuda", dtype=k.dtype)
    vp = torch.full_like(kp, float("nan"))
    kp.flatten(0, 1)[slot], vp.flatten(0, 1)[slot] = k, v
    return kp, vp, table, seq_idx, pos


@pytest.mark.parametrize("mode", list(SCHEDULE))
def test_decode_equals_prefill_at_every_position(mode, monkeypatch):
    from rlalign.kernels.triton import attention as attn

    T = 4096
    q, k, v, cu = _packed([T], 0)
    pre = attn.attention_prefill(q, k, v, cu, SCALE)
    kc, vc = k[None], v[None]
    _schedule(monkeypatch, SCHEDULE[mode])
    # all 4,096 positions as one batch of rows over a stride-0 view of the one cache
    dec = attn.attention_decode(q, kc.expand(T, -1, -1, -1), vc.expand(T, -1, -1, -1),
                                torch.arange(1, T + 1, device="cuda"), SCALE)
    bad = [t for t in range(T) if not same_bits(dec[t], pre[t])]
    assert not bad, f"{len(bad)} positions differ, first {bad[:8]}"


def test_decode_batch_of_one_around_chunk_boundaries():
    from rlalign.kernels.triton import attention as attn

    T = 4096
    q, k, v, cu = _packed([T], 1)
    pre = attn.attention_prefill(q, k, v, cu, SCALE)
    kc = torch.zeros(1, T + 100, HK, D, device="cuda", dtype=k.dtype)  # a cache longer than the keys
    vc = torch.zeros_like(kc)
    kc[0, :T], vc[0, :T] = k, v
    chunk = attn.ATTN_FWD[torch.bfloat16]["CHUNK"]
    for t in sorted({0, 1, 63, 64, chunk - 1, chunk, chunk + 1, 2 * chunk, 1000, 2047, 2048, 3333, T - 1}):
        dec = attn.attention_decode(q[t : t + 1], kc, vc, torch.tensor([t + 1], device="cuda"), SCALE)
        assert same_bits(dec[0], pre[t]), t


@pytest.mark.parametrize("mode", ["split1", "registers"])
@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_equals_prefill_ragged_shuffled(page_size, mode, monkeypatch):
    from rlalign.kernels.triton import attention as attn

    lens = [1, 77, 1000, 4096, 255, 2500]
    q, k, v, cu = _packed(lens, 2)
    pre = attn.attention_prefill(q, k, v, cu, SCALE)
    kp, vp, table, seq_idx, pos = _pages(k, v, lens, page_size, 3)
    perm = torch.randperm(len(pos), generator=torch.Generator().manual_seed(4)).cuda()
    _schedule(monkeypatch, SCHEDULE[mode])
    out = attn.attention_paged(q[perm], kp, vp, table, seq_idx[perm], pos[perm], SCALE)
    assert same_bits(out, pre[perm])
    # decode rows only (the last position of each sequence), a small batch: the size-based schedule
    _schedule(monkeypatch, None)
    last = torch.tensor(cu[1:], device="cuda") - 1
    assert same_bits(attn.attention_paged(q[last], kp, vp, table, seq_idx[last], pos[last], SCALE), pre[last])


def test_negative_twin_another_chunk_size_moves_bits(monkeypatch):
    from rlalign.kernels.triton import attention as attn

    T = 4096
    q, k, v, cu = _packed([T], 5)
    dec = attn.attention_decode(q, k[None].expand(T, -1, -1, -1), v[None].expand(T, -1, -1, -1),
                                torch.arange(1, T + 1, device="cuda"), SCALE)
    chunk = attn.ATTN_FWD[torch.bfloat16]["CHUNK"]
    monkeypatch.setitem(attn.ATTN_FWD[torch.bfloat16], "CHUNK", chunk * 2)
    other = attn.attention_prefill(q, k, v, cu, SCALE)
    assert not same_bits(other, dec)
    assert same_bits(other[:chunk], dec[:chunk])  # rows in the first chunk of both: unchanged


def test_backward_close_to_sdpa_and_identical_run_to_run():
    from rlalign.kernels.triton import attention as attn

    lens = [700, 1324]
    q, k, v, cu = _packed(lens, 6)
    go = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    grads = []
    for _ in range(2):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        attn.attention_prefill(qq, kk, vv, cu, SCALE).backward(go)
        grads.append((qq.grad, kk.grad, vv.grad))
    assert all(same_bits(a, b) for a, b in zip(*grads))
    ref = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
    for s0, s1 in zip(cu[:-1], cu[1:]):
        qq, kk, vv = (t[s0:s1].float().transpose(0, 1).requires_grad_() for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=SCALE, enable_gqa=True)
        o.transpose(0, 1).backward(go[s0:s1].float())
        for r, t in zip(ref, (qq, kk, vv)):
            r[s0:s1] = t.grad.transpose(0, 1)
    for name, a, b in zip("qkv", grads[0], ref):
        rel = float((a.float() - b).abs().max() / b.abs().max())
        assert rel < 2e-2, (name, rel)


@pytest.mark.parametrize("page_size", [16, 32])
def test_rows_settings_leave_bits_alone(page_size, monkeypatch):
    """How a program finds its pages (table entries preloaded and gathered, or a table load per key block)
    and 32- or 64-bit key offsets — the pinned bf16 settings and the fp32 config's on bf16 data: the same
    bits as prefill (paged rows of ragged, shuffled sequences, split-K and in registers; decode rows)."""
    from rlalign.kernels.triton import attention as attn

    lens = [1, 300, 4096, 1000]
    q, k, v, cu = _packed(lens, 10)
    pre = attn.attention_prefill(q, k, v, cu, SCALE)
    kp, vp, table, seq_idx, pos = _pages(k, v, lens, page_size, 11)
    rows = torch.randperm(len(pos), generator=torch.Generator().manual_seed(12))[:700].cuda()
    last = torch.tensor(cu[1:], device="cuda") - 1
    kc = torch.zeros(len(lens), 4096, HK, D, device="cuda", dtype=k.dtype)
    vc = torch.zeros_like(kc)
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        kc[s, : b - a], vc[s, : b - a] = k[a:b], v[a:b]
    cfg = attn.ATTN_FWD[torch.bfloat16]
    base = dict(cfg["decode"])
    # pinned: pages preloaded up to 256 table entries (the 4,096-key row folded in registers has 257: a table
    # load per key block), int32 offsets; the fp32 config's settings: a table load per key block, int64 offsets
    fp32 = attn.ATTN_FWD[torch.float32]["decode"]
    for rows_cfg in (dict(), dict(PAGED_PRE_MAX=fp32["PAGED_PRE_MAX"], PAGED_OFF32=fp32["PAGED_OFF32"])):
        monkeypatch.setitem(cfg, "decode", dict(base, **rows_cfg))
        for spp in (1, 0):
            _schedule(monkeypatch, spp)
            out = attn.attention_paged(q[rows], kp, vp, table, seq_idx[rows], pos[rows], SCALE)
            assert same_bits(out, pre[rows]), (rows_cfg, spp)
        _schedule(monkeypatch, None)
        assert same_bits(attn.attention_paged(q[last], kp, vp, table, seq_idx[last], pos[last], SCALE), pre[last])
        dec = attn.attention_decode(q[last], kc, vc, torch.tensor(lens, device="cuda"), SCALE)
        assert same_bits(dec, pre[last]), rows_cfg
    assert all(int(t.abs().sum()) == 0 for t in attn.ticket_buffers())


def test_fused_split_k_in_a_cuda_graph():
    """The fused fold's ticket counters reset themselves: a captured decode (split-K, no host sync)
    replayed several times on new queries equals eager calls bitwise."""
    from rlalign.kernels.triton import attention as attn

    T = 4096
    q, k, v, cu = _packed([T], 13)
    kc, vc = k[None].expand(8, -1, -1, -1), v[None].expand(8, -1, -1, -1)
    lengths = torch.tensor([T, 1, 256, 257, 2048, 3000, 4095, 64], device="cuda")
    qs = q[lengths - 1].clone()
    eager = attn.attention_decode(qs, kc, vc, lengths, SCALE)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attn.attention_decode(qs, kc, vc, lengths, SCALE)
        with torch.cuda.graph(g, stream=s):
            out = attn.attention_decode(qs, kc, vc, lengths, SCALE)
    torch.cuda.current_stream().wait_stream(s)
    pre = attn.attention_prefill(q, k, v, cu, SCALE)
    for i in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert same_bits(out, eager), i
    qs.copy_(q[lengths - 2].clone())  # other queries at the same lengths
    lengths.sub_(1).clamp_(min=1)
    g.replay()
    torch.cuda.synchronize()
    assert same_bits(out, attn.attention_decode(qs, kc, vc, lengths, SCALE))
    assert same_bits(out[1:], pre[lengths[1:] - 1])
    assert all(int(t.abs().sum()) == 0 for t in attn.ticket_buffers())
