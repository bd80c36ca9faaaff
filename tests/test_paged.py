"""The paged path that the native engine and the vLLM backend share: attention_paged over shuffled
pages, and Transformer.step over any mix of prefill chunks and decode rows, bitwise equal to the
trainer's packed forward row at the same position."""

import pytest
import torch
from conftest import same_bits, tiny_model

from rlalign import kernels
from rlalign.model import PagedKVCache
from rlalign.model.model import PAD_LOGIT


def _paged_setup(lens, page_size, num_pages, seed=0):
    """Block tables of shuffled pages for sequences of `lens` (pages in a random order)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)
    need = [-(-n // page_size) for n in lens]
    width = max(need)
    table = torch.full((len(lens), width), 0, dtype=torch.int32)
    off = 0
    for s, k in enumerate(need):
        table[s, :k] = perm[off : off + k].to(torch.int32)
        off += k
    return table


@pytest.mark.parametrize("page_size", [4, 16])
def test_attention_paged_equals_prefill_rows(page_size):
    torch.manual_seed(0)
    lens, H, Hk, D = [5, 19, 1, 33], 4, 2, 16
    N = sum(lens)
    q = torch.randn(N, H, D).bfloat16()
    k = torch.randn(N, Hk, D).bfloat16()
    v = torch.randn(N, Hk, D).bfloat16()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    ref = kernels.attention_prefill(q, k, v, cu)
    P = 64
    table = _paged_setup(lens, page_size, P)
    # garbage (NaN/inf) in unwritten slots must not leak into any row
    kp = torch.full((P, page_size, Hk, D), float("nan")).bfloat16()
    vp = torch.full((P, page_size, Hk, D), float("inf")).bfloat16()
    seq_idx = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    slot = table[seq_idx, pos // page_size].long() * page_size + pos % page_size
    kp.flatten(0, 1)[slot] = k
    vp.flatten(0, 1)[slot] = v
    perm = torch.randperm(N)  # rows in any order
    out = kernels.attention_paged(q[perm], kp, vp, table, seq_idx[perm], pos[perm])
    assert same_bits(out, ref[perm])


def test_attention_paged_negative_twin_default_mode_differs():
    torch.manual_seed(1)
    lens, H, Hk, D = [40, 57], 4, 2, 16
    N = sum(lens)
    q, k, v = (torch.randn(N, h, D).bfloat16() for h in (H, Hk, Hk))
    ref = kernels.attention_prefill(q, k, v, [0, lens[0], N])
    table = _paged_setup(lens, 16, 16)
    seq_idx = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    slot = table[seq_idx, pos // 16].long() * 16 + pos % 16
    kp, vp = torch.zeros(16, 16, Hk, D).bfloat16(), torch.zeros(16, 16, Hk, D).bfloat16()
    kp.flatten(0, 1)[slot], vp.flatten(0, 1)[slot] = k, v
    with kernels.use(mode="default"):
        out = kernels.attention_paged(q, kp, vp, table, seq_idx, pos)
    assert not same_bits(out, ref)


def _step_rows(model, prompts, chunk, page_size=4, num_pages=64):
    """Feed `prompts` through Transformer.step in chunks of `chunk` tokens per sequence per step
    (all sequences in every step, a mixed batch once short ones finish) and return each sequence's
    logits rows."""
    a = model.args
    cache = PagedKVCache(a, num_pages, page_size, model.dtype)
    table = _paged_setup([len(p) for p in prompts], page_size, num_pages, seed=3)
    done = [0] * len(prompts)
    rows = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        toks, pos, sidx = [], [], []
        for s, p in enumerate(prompts):
            n = min(chunk, len(p) - done[s])
            toks += p[done[s] : done[s] + n]
            pos += list(range(done[s], done[s] + n))
            sidx += [s] * n
            done[s] += n
        pos_t, sidx_t = torch.tensor(pos), torch.tensor(sidx)
        slot = table[sidx_t, pos_t // page_size].long() * page_size + pos_t % page_size
        logits = model.step(torch.tensor(toks), pos_t, sidx_t, cache, table, slot)
        for r, s in enumerate(sidx):
            rows[s].append(logits[r])
    return [torch.stack(r) for r in rows]


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_model_step_equals_packed_forward(chunk):
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (7, 1, 12)]
    cu = [0]
    for p in prompts:
        cu.append(cu[-1] + len(p))
    with torch.no_grad():
        ref = model(torch.tensor([t for p in prompts for t in p]), cu)
        got = _step_rows(model, prompts, chunk)
    for s in range(len(prompts)):
        assert same_bits(got[s], ref[cu[s] : cu[s + 1]]), f"sequence {s}, chunk {chunk}"


def test_model_step_negative_twin_default_mode_differs():
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (30, 21)]
    cu = [0, 30, 51]
    with torch.no_grad():
        ref = model(torch.tensor([t for p in prompts for t in p]), cu)
        with kernels.use(mode="default"):
            got = _step_rows(model, prompts, 1)
    assert not all(same_bits(got[s], ref[cu[s] : cu[s + 1]]) for s in range(2))



def test_model_step_keep_gives_the_dropped_rows_the_pad_row_only():
    """keep=False rows (a decode graph's padding rows) get logits of PAD_LOGIT at column 0 and exactly zero
    elsewhere, also where their own hidden rows are non-finite; kept rows' bits equal a step without keep.
    Twin: without keep, the dropped row's logits are not that row (and a NaN row's are not finite)."""
    model = tiny_model()
    a = model.args
    cache = PagedKVCache(a, 8, 4, model.dtype)
    table = torch.tensor([[0, 1], [2, 3], [7, 7]], dtype=torch.int32)
    toks, pos, sidx = torch.tensor([5, 9, 3]), torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])
    slot = torch.tensor([0, 8, 28])
    keep = torch.tensor([True, True, False])
    with torch.no_grad():
        plain = model.step(toks, pos, sidx, cache, table, slot)
        kept = model.step(toks, pos, sidx, cache, table, slot, keep=keep)
        h = torch.randn(3, a.hidden_size).to(model.dtype)
        h[2] = float("nan")
        poisoned = model._head(h, None)
        masked = model._head(h, None, keep)
    assert plain[2].abs().sum() > 0 and not torch.isfinite(poisoned[2]).all()  # the twins
    assert same_bits(kept[:2], plain[:2]) and same_bits(masked[:2], poisoned[:2])
    pad = torch.zeros_like(kept[2])
    pad[0] = PAD_LOGIT
    assert torch.equal(kept[2], pad) and torch.equal(masked[2], pad)
