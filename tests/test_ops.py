"""Batch invariance of every op in deterministic mode, each with a negative twin."""

import pytest
import torch
from conftest import same_bits

from rlalign import kernels

DTYPES = [torch.bfloat16, torch.float32]


def _rows_in_batches(fn, row: torch.Tensor, others: torch.Tensor, sizes=range(1, 65), seed=0):
    """fn applied to `row` embedded at a random position of batches of each size; yields the row's
    output each time."""
    g = torch.Generator().manual_seed(seed)
    for m in sizes:
        pos = int(torch.randint(0, m, (1,), generator=g))
        pick = torch.randint(0, others.shape[0], (m,), generator=g)
        batch = others[pick].clone()
        batch[pos] = row
        yield m, fn(batch)[pos]


def _invariant(fn, dtype, K=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    others = torch.randn(256, K, generator=g).to(dtype)
    row = torch.randn(K, generator=g).to(dtype)
    alone = fn(row[None])[0]
    return [m for m, out in _rows_in_batches(fn, row, others) if not same_bits(out, alone)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_batch_invariant(dtype):
    w = torch.randn(80, 96).to(dtype)
    assert _invariant(lambda x: kernels.linear(x, w), dtype) == []


def test_linear_negative_twin_default_mode_differs():
    w = torch.randn(256, 256)
    with kernels.use(mode="default"):
        assert _invariant(lambda x: kernels.linear(x, w), torch.float32, K=256) != []


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward_rows_batch_invariant(dtype):
    # grad_x = grad_y @ W is a linear of the same kind: rows independent of M
    w = torch.randn(96, 80).to(dtype)

    def grad_x(gy):
        x = torch.zeros(gy.shape[0], 80, dtype=dtype, requires_grad=True)
        kernels.linear(x, w).backward(gy)
        return x.grad

    assert _invariant(grad_x, dtype) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_rows_batch_invariant(dtype):
    w = (1 + 0.1 * torch.randn(96)).to(dtype)
    assert _invariant(lambda x: kernels.rmsnorm(x, w, 1e-6), dtype) == []


def test_rmsnorm_negative_twin_other_order_differs():
    # the norm's reduction in another order (torch's mean) changes bits for some rows
    x = torch.randn(512, 96)
    w = torch.ones(96)
    var = (x * x).mean(-1, keepdim=True)
    other = w * (x * (1.0 / torch.sqrt(var + 1e-6)))
    assert not same_bits(kernels.rmsnorm(x, w, 1e-6), other)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_swiglu_rows_batch_invariant(dtype):
    cos, sin = kernels.rope_table(128, 16, 10000.0)

    def rope(x):  # every row at position 37
        n = x.shape[0]
        return kernels.rope(x.view(n, 6, 16), cos[37].expand(n, -1), sin[37].expand(n, -1)).view(n, -1)

    assert _invariant(rope, dtype) == []
    assert _invariant(lambda x: kernels.swiglu(x[:, :48], x[:, 48:]), dtype) == []


def test_rope_and_swiglu_negative_twin_other_rounding_differs():
    # elementwise ops are row-independent by construction; the check still sees a change of
    # rounding path: default mode rotates and gates in bf16 instead of fp32
    cos, sin = kernels.rope_table(128, 16, 10000.0)
    x = torch.randn(256, 6, 16).to(torch.bfloat16)
    ref = kernels.rope(x, cos[37].expand(256, -1), sin[37].expand(256, -1))
    gate, up = torch.randn(2, 256, 64).to(torch.bfloat16)
    ref2 = kernels.swiglu(gate, up)
    with kernels.use(mode="default"):
        assert not same_bits(ref, kernels.rope(x, cos[37].expand(256, -1), sin[37].expand(256, -1)))
        assert not same_bits(ref2, kernels.swiglu(gate, up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_rows_batch_invariant(dtype):
    tok = torch.tensor(5)

    def lp(z):
        return kernels.token_logprobs(z, tok.expand(z.shape[0]), temperature=0.7)

    g = torch.Generator().manual_seed(3)
    others = (torch.randn(256, 96, generator=g) * 3).to(dtype)
    row = (torch.randn(96, generator=g) * 3).to(dtype)
    alone = lp(row[None])[0]
    assert all(same_bits(o, alone) for _, o in _rows_in_batches(lp, row, others))


def test_token_logprobs_negative_twin_default_mode_differs():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(2000, 1000, generator=g) * 4
    tok = torch.randint(0, 1000, (2000,), generator=g)
    ref = kernels.token_logprobs(z, tok)
    with kernels.use(mode="default"):
        other = kernels.token_logprobs(z, tok)
    assert not same_bits(ref, other)
    assert (ref - other).abs().max() < 1e-5  # same quantity, other rounding


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_route_and_combine_rows_batch_invariant(dtype):
    def route(x):
        w, e = kernels.moe_route(x[:, :8], 2, True)
        return torch.cat([w, e.float()], -1)

    assert _invariant(route, dtype) == []
    weights = torch.softmax(torch.randn(1, 4), -1).float()

    def combine(x):  # [M, 96] -> y [M, 4, 24]
        return kernels.moe_combine(x.view(-1, 4, 24), weights.expand(x.shape[0], 4))

    assert _invariant(combine, dtype) == []


def test_moe_route_ties_go_to_lowest_expert():
    w, e = kernels.moe_route(torch.zeros(3, 8), 3, False)
    assert e.tolist() == [[0, 1, 2]] * 3


def test_moe_combine_negative_twin_other_slot_order_differs():
    g = torch.Generator().manual_seed(5)
    y = torch.randn(2000, 4, 64, generator=g)
    w = torch.softmax(torch.randn(2000, 4, generator=g), -1)
    fixed = kernels.moe_combine(y, w)
    reversed_order = kernels.moe_combine(y.flip(1), w.flip(1))  # e.g. ranks answering in another order
    assert not same_bits(fixed, reversed_order)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_rows_independent_of_group_composition(dtype):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(4, 40, 32, generator=g).to(dtype)
    x = torch.randn(50, 32, generator=g).to(dtype)
    full = kernels.grouped_linear(x, w, [10, 0, 25, 15])
    alone = kernels.linear(x[12:13], w[2])
    assert same_bits(full[12:13], alone)
    assert same_bits(kernels.grouped_linear(x[12:20], w, [0, 0, 8, 0])[:1], alone)


def _qkv(T, H=4, Hk=2, D=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g).to(dtype) for h in (H, Hk, Hk)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_equals_prefill_at_every_position(dtype):
    T = 70
    q, k, v = _qkv(T, dtype=dtype)
    pre = kernels.attention_prefill(q, k, v, [0, T])
    for C in (T, 128):  # cache capacity beyond the sequence
        kc = torch.zeros(1, C, 2, 16, dtype=dtype)
        vc = torch.zeros_like(kc)
        kc[0, :T], vc[0, :T] = k, v
        for t in range(T):
            kc_t, vc_t = kc.clone(), vc.clone()
            kc_t[0, t + 1 :] = 0
            vc_t[0, t + 1 :] = 0
            dec = kernels.attention_decode(q[t : t + 1], kc_t, vc_t, torch.tensor([t + 1]))
            assert same_bits(dec[0], pre[t]), (C, t)


def test_attention_decode_negative_twin_default_mode_differs():
    T = 70
    q, k, v = _qkv(T, dtype=torch.float32, seed=1)
    with kernels.use(mode="default"):
        pre = kernels.attention_prefill(q, k, v, [0, T])
        bad = 0
        for t in range(T):
            dec = kernels.attention_decode(q[t : t + 1], k[None], v[None], torch.tensor([t + 1]))
            bad += not same_bits(dec[0], pre[t])
    assert bad > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill_independent_of_batch_and_padding(dtype):
    lens = [5, 33, 17, 1, 40]
    seqs = [_qkv(n, dtype=dtype, seed=10 + i) for i, n in enumerate(lens)]
    alone = [kernels.attention_prefill(*s, [0, n]) for s, n in zip(seqs, lens)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    packed = kernels.attention_prefill(*[torch.cat([s[j] for s in seqs]) for j in range(3)], cu)
    for b, a in enumerate(alone):
        assert same_bits(packed[cu[b] : cu[b + 1]], a)
    # padded: every sequence extended to 40 with junk rows after its end
    width = max(lens)
    pad = [[torch.cat([s[j], torch.randn(width - n, *s[j].shape[1:]).to(dtype)]) for j in range(3)]
           for s, n in zip(seqs, lens)]
    padded = kernels.attention_prefill(*[torch.cat([p[j] for p in pad]) for j in range(3)],
                                       list(range(0, width * len(lens) + 1, width)))
    for b, (a, n) in enumerate(zip(alone, lens)):
        assert same_bits(padded[b * width : b * width + n], a)


def test_full_model_logits_row_invariant_packed_padded_and_alone():
    from conftest import tiny_model

    m = tiny_model("bfloat16")
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(2, 64, (n,), generator=g) for n in (9, 30, 4, 17)]
    with torch.no_grad():
        alone = [m(s, [0, len(s)]) for s in seqs]
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + len(s))
        packed = m(torch.cat(seqs), cu)
        W = 30
        padded = m(torch.cat([torch.cat([s, torch.zeros(W - len(s), dtype=torch.long)]) for s in seqs]),
                   list(range(0, 4 * W + 1, W)))
    for b, a in enumerate(alone):
        assert same_bits(packed[cu[b] : cu[b + 1]], a)
        assert same_bits(padded[b * W : b * W + len(seqs[b])], a)


def test_full_model_negative_twin_default_mode_differs():
    from conftest import tiny_model

    m = tiny_model("float32")
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(2, 64, (n,), generator=g) for n in (9, 30, 4, 17, 25, 12)]
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    with kernels.use(mode="default"), torch.no_grad():
        packed = m(torch.cat(seqs), cu)
        alone = [m(s, [0, len(s)]) for s in seqs]
    assert any(not same_bits(packed[cu[b] : cu[b + 1]], a) for b, a in enumerate(alone))


def test_mode_switch_rejects_unknown():
    with pytest.raises(ValueError, match="kernels.mode"):
        kernels.set_mode("fast")
    with pytest.raises(ValueError, match="kernels.backend"):
        kernels.set_mode(backend="cuda")


def test_attention_runs_on_zero_rows():
    """An EP rank with no rows still runs every layer (its collectives must happen)."""
    from rlalign.model.args import ModelArgs
    from rlalign.model.model import Attention

    args = ModelArgs()
    attn = Attention(args)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    cos, sin = kernels.rope_table(8, args.head_dim, args.rope_theta)
    out = attn(torch.zeros(0, args.hidden_size), cos[:0], sin[:0], [0])
    assert out.shape == (0, args.hidden_size)
    # negative twin: the shape inference the layer used before cannot size an empty batch
    with pytest.raises(RuntimeError):
        torch.zeros(0, args.num_heads, args.head_dim).reshape(0, -1)
