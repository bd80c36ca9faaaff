"""The Triton backend on CPU through TRITON_INTERPRET=1 (tiny shapes): against the torch
reference within tolerance, and its batch invariance. GPU bits and speed: tests/gpu, experiments."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import same_bits

pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or the Triton interpreter", allow_module_level=True)

from rlalign import kernels  # noqa: E402
from rlalign.kernels import torch_deterministic as ref  # noqa: E402
from rlalign.kernels import triton as tb  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_matches_fp64_and_rows_are_batch_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g).to(dtype).to(DEV)
    x = torch.randn(70, 72, generator=g).to(dtype).to(DEV)
    full = tb.linear(x, w)
    assert _rel(full, x.double() @ w.double().t()) < TOL[dtype]
    for m in range(1, 71):  # every batch size: the rows computed are the same bits
        assert same_bits(tb.linear(x[:m], w), full[:m]), m


def test_matmul_negative_twin_other_k_order_differs():
    # the same products with K reduced in another order (K reversed) change bits: the order is the contract
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 200, generator=g).to(DEV)
    x = torch.randn(64, 200, generator=g).to(DEV)
    assert not same_bits(tb.linear(x, w), tb.linear(x.flip(1), w.flip(1)))


def _attn_grads(q, k, v, cu, go):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    tb.attention_prefill(qq, kk, vv, cu, 0.25).backward(go)
    return qq.grad, kk.grad, vv.grad


def test_a_sequences_attention_gradients_do_not_depend_on_the_sequences_beside_it(monkeypatch):
    # 45 keys: key blocks whose query blocks take the masked diagonal, the unmasked full and the masked tail loops
    g = torch.Generator().manual_seed(5)
    lens = (9, 45, 30)
    N = sum(lens)
    q, k, v = (torch.randn(N, h, 16, generator=g).to(DEV) for h in (4, 2, 2))
    go = torch.randn(N, 4, 16, generator=g).to(DEV)
    mid = slice(9, 54)
    packed = _attn_grads(q, k, v, [0, 9, 54, N], go)
    alone = _attn_grads(q[mid], k[mid], v[mid], [0, 45], go[mid])
    assert all(same_bits(a[mid], b) for a, b in zip(packed, alone))
    # twin: the same sequence with the backward's blocks another size sums in another order, and the check sees it
    at = sys.modules[tb.attention_prefill.__module__]
    cfg = at.ATTN_BWD[torch.float32] if DEV == "cuda" else at.INTERPRET_ATTN
    monkeypatch.setitem(cfg, "bwd", dict(cfg["bwd"], BLOCK_M=cfg["bwd"]["BLOCK_M"] * 2))
    monkeypatch.setitem(cfg, "bwd_dq", dict(cfg["bwd_dq"], BLOCK_N=cfg["bwd_dq"]["BLOCK_N"] * 2))
    other = _attn_grads(q[mid], k[mid], v[mid], [0, 45], go[mid])
    assert not all(same_bits(a, b) for a, b in zip(other, alone))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_decode_equals_prefill_and_backward(dtype):
    g = torch.Generator().manual_seed(2)
    T = 40
    q, k, v = (torch.randn(T, h, 16, generator=g).to(dtype).to(DEV) for h in (4, 2, 2))
    pre = tb.attention_prefill(q, k, v, [0, T], 0.25)
    assert _rel(pre, ref.attention_prefill(q.double().float(), k.float(), v.float(), [0, T], 0.25)) < TOL[dtype]
    kc = torch.zeros(1, 64, 2, 16, dtype=dtype, device=DEV)
    vc = torch.zeros_like(kc)
    kc[0, :T], vc[0, :T] = k, v
    for t in range(T):
        dec = tb.attention_decode(q[t : t + 1], kc, vc, torch.tensor([t + 1], device=DEV), 0.25)
        assert same_bits(dec[0], pre[t]), t
    # backward: against the reference's gradients, and identical run to run (no atomics)
    cu = [0, 17, T]
    grads = []
    for _ in range(2):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = tb.attention_prefill(qq, kk, vv, cu, 0.25)
        out.backward(torch.ones_like(out))
        grads.append((qq.grad, kk.grad, vv.grad))
    rq, rk, rv = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref.attention_prefill(rq, rk, rv, cu, 0.25).backward(torch.ones(T, 4, 16, device=DEV))
    for a, b in zip(grads[0], (rq.grad, rk.grad, rv.grad)):
        assert _rel(a, b) < TOL[dtype] * 2
    assert all(same_bits(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_and_logprobs_match_reference_and_backward_is_repeatable(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, 64, generator=g).to(dtype).to(DEV)
    w = (torch.rand(64, generator=g) + 0.5).to(dtype).to(DEV)
    assert _rel(tb.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6)) < TOL[dtype]
    runs = []
    for _ in range(2):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        tb.rmsnorm(xx, ww, 1e-6).float().pow(2).sum().backward()
        runs.append((xx.grad, ww.grad))
    assert all(same_bits(a, b) for a, b in zip(*runs))
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref.rmsnorm(rx, rw, 1e-6).float().pow(2).sum().backward()
    assert _rel(runs[0][0], rx.grad) < TOL[dtype] * 2 and _rel(runs[0][1], rw.grad) < TOL[dtype] * 2
    z = (torch.randn(50, 300, generator=g) * 3).to(DEV).requires_grad_()
    tok = torch.randint(0, 300, (50,), generator=g).to(DEV)
    lp = tb.log_softmax_gather(z, tok)
    zr = z.detach().clone().requires_grad_()
    lr = torch.log_softmax(zr, -1).gather(-1, tok[:, None])[:, 0]
    assert (lp - lr).abs().max() < 1e-5
    lp.sum().backward()
    lr.sum().backward()
    assert (z.grad - zr.grad).abs().max() < 1e-6
    assert same_bits(tb.log_softmax_gather(z[7:8], tok[7:8]), lp[7:8])  # a row alone


@pytest.mark.slow  # the whole model through the interpreter: ~40 s on 2 cores
def test_full_model_agrees_on_the_triton_backend():
    from rlalign.agree import run_agree
    from rlalign.config import load_config

    res, _ = run_agree(load_config(["kernels.backend=triton", f"device={DEV}", "agree.num_prompts=4",
                                    "agree.max_new_tokens=4", "trainer.ep_size=1", "trainer.micro_batch_size=3"]))
    assert res["backend"] == "triton" and res["tokens"] > 0 and res["mismatched_tokens"] == 0


def test_bad_input_is_refused_clearly():
    with pytest.raises(TypeError, match="triton matmul: dtype torch.float64 is not supported"):
        tb.matmul(torch.zeros(2, 2, dtype=torch.float64, device=DEV), torch.zeros(2, 2, dtype=torch.float64,
                                                                                device=DEV))
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) @ \(2, 2\) do not chain"):
        tb.matmul(torch.zeros(2, 3, device=DEV), torch.zeros(2, 2, device=DEV))
    with pytest.raises(ValueError, match="head_dim=12 must be a power of two"):
        tb.attention_prefill(*(torch.zeros(4, 2, 12, device=DEV) for _ in range(3)), [0, 4], 0.3)
    if DEV == "cpu":  # without the interpreter, CPU tensors are refused with the way out
        code = ("import torch; from rlalign import kernels; kernels.set_mode('deterministic', 'triton'); "
                "kernels.linear(torch.zeros(2, 2), torch.zeros(2, 2))")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert p.returncode != 0 and "kernels.backend=triton needs CUDA tensors" in p.stderr
    kernels.set_mode("deterministic", "torch")


def test_matmul_k_padding_keeps_the_bits():
    # K = 37 takes the zero-padded path; the same data with explicit zero columns the direct one
    g = torch.Generator().manual_seed(5)
    a = torch.randn(50, 37, generator=g).bfloat16().to(DEV)
    b = torch.randn(37, 24, generator=g).bfloat16().to(DEV)
    k = 64
    a_pad = torch.zeros(50, k, dtype=a.dtype, device=DEV)
    b_pad = torch.zeros(k, 24, dtype=a.dtype, device=DEV)
    a_pad[:, :37], b_pad[:37] = a, b
    assert same_bits(tb.matmul(a, b), tb.matmul(a_pad, b_pad))
    assert same_bits(tb.matmul(a.t().contiguous().t(), b), tb.matmul(a, b))  # a non-K-contiguous A


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_is_one_launch_equal_to_the_per_expert_linears(dtype):
    # forward rows, dX and dW of the one-launch grouped GEMM have the bits of the per-expert loop of
    # linear (same kernel, same K order; dW's zero-padded token groups add exact zeros); an empty
    # expert gets a zero dW; a row's bits ignore which other rows its group holds
    g = torch.Generator().manual_seed(6)
    counts = [5, 0, 13, 9]
    x = torch.randn(sum(counts), 40, generator=g).to(dtype).to(DEV)
    w = torch.randn(4, 24, 40, generator=g).to(dtype).to(DEV)
    go = torch.randn(sum(counts), 24, generator=g).to(dtype).to(DEV)
    grads = []
    for fn in (tb.grouped_linear, lambda a, b, c: ref.grouped_with(tb.linear, a, b, c)):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww, counts)
        y.backward(go)
        grads.append((y, xx.grad, ww.grad))
    assert all(same_bits(a, b) for a, b in zip(*grads))
    assert not grads[0][2][1].any()
    assert _rel(grads[0][0], torch.cat([x[:5].double() @ w[0].double().t(), x[5:18].double() @ w[2].double().t(),
                                        x[18:].double() @ w[3].double().t()])) < TOL[dtype]
    sub = tb.grouped_linear(torch.cat([x[2:4], x[10:11], x[20:27]]), w, [2, 0, 1, 7])
    assert same_bits(sub, torch.cat([grads[0][0][2:4], grads[0][0][10:11], grads[0][0][20:27]]))
    # negative twin: the same products summed in another K order give other bits
    xf, wf = torch.randn(27, 200, generator=g).to(DEV), torch.randn(4, 24, 200, generator=g).to(DEV)
    assert not same_bits(tb.grouped_linear(xf.flip(1), wf.flip(2), counts), tb.grouped_linear(xf, wf, counts))
    with pytest.raises(ValueError, match="grouped_linear: x .* and counts .* do not fit"):
        tb.grouped_linear(x, w, [1, 2, 3, 4])


@pytest.mark.parametrize("renorm", [True, False])
def test_router_and_rope_kernels_match_the_reference_row_by_row(renorm):
    # router: the same expert ids as the reference (ties to the lowest id), weights and dlogits
    # within tolerance; a row's bits ignore the other rows; RoPE likewise, fwd and bwd
    g = torch.Generator().manual_seed(7)
    z = torch.randn(37, 12, generator=g).bfloat16().to(DEV)
    z[3, 5] = z[3, 7]
    runs = []
    for fn in (tb.moe_route, ref.moe_route):
        zz = z.clone().requires_grad_()
        w, ids = fn(zz, 3, renorm)
        w.backward(torch.linspace(-1, 1, 111, device=DEV).view(37, 3))
        runs.append((w, ids, zz.grad))
    assert torch.equal(runs[0][1], runs[1][1])
    assert _rel(runs[0][0], runs[1][0]) < 1e-5 and _rel(runs[0][2], runs[1][2]) < 2e-2
    w_sub, ids_sub = tb.moe_route(z[10:13], 3, renorm)
    assert same_bits(w_sub, runs[0][0][10:13]) and torch.equal(ids_sub, runs[0][1][10:13])
    cos, sin = (t[:9].to(DEV) for t in kernels.rope_table(32, 16, 10000.0))
    x = torch.randn(9, 4, 16, generator=g).bfloat16().to(DEV)
    outs = []
    for fn in (tb.rope, ref.rope):
        xx = x.clone().requires_grad_()
        y = fn(xx, cos, sin)
        y.backward(torch.ones_like(y))
        outs.append((y, xx.grad))
    assert _rel(outs[0][0], outs[1][0]) < TOL[torch.bfloat16] and _rel(outs[0][1], outs[1][1]) < TOL[torch.bfloat16]
    assert same_bits(tb.rope(x[4:6], cos[4:6], sin[4:6]), outs[0][0][4:6])


@pytest.mark.parametrize("experts", [12, 16])
def test_router_picks_by_one_key_max_ties_lowest_id_and_nan_rows_no_expert(experts):
    """Each pick is the largest remaining weight, ties to the lowest id, weights in pick order (a torch
    sort of the kernel's own softmax values by (-p, id)); a row with a NaN or infinite logit gets ids
    outside [0, E) (no expert; the dispatch leaves it in no group) while its neighbours keep theirs.
    Twins: a row of distinct logits reversed picks other ids; a finite row's ids are experts."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, experts, generator=g)
    z[1] = z[1].round()  # exact ties
    z[2, :4] = 2.5
    z[4, 3] = float("nan")
    z[5, 0] = float("inf")
    w, ids = tb.moe_route(z.to(DEV), 4, False)
    w, ids = w.cpu(), ids.cpu()
    for r in range(4):
        p = w[r]
        assert torch.equal(ids[r], torch.tensor(sorted(range(experts), key=lambda e: (-z[r, e].item(), e))[:4]))
        assert torch.equal(p, p.sort(descending=True, stable=True).values)
    assert ids[2].tolist() == [0, 1, 2, 3]
    assert bool(((ids[4:] >= experts) & (ids[4:] < 2 * experts)).all())
    assert not bool(((w[4:] >= 0) & (w[4:] <= 1)).any())  # NaN, or the padding's -1: no probability
    assert bool((ids[:4] < experts).all())
    flipped = tb.moe_route(z[:1].flip(1).to(DEV), 4, False)[1].cpu()
    assert not torch.equal(flipped, ids[:1])


def test_embedding_backward_sums_each_tokens_rows_in_order_without_atomics():
    # equal to the sequential index backward (position order), bits; repeated tokens and unused rows
    g = torch.Generator().manual_seed(8)
    w = torch.randn(50, 24, generator=g).to(DEV)
    tok = torch.randint(0, 20, (200,), generator=g).to(DEV)
    go = torch.randn(200, 24, generator=g).to(DEV)
    a = w.clone().requires_grad_()
    tb.embedding(a, tok).backward(go)
    expect = torch.zeros_like(w)
    for i in range(200):  # the order the kernel promises
        expect[tok[i]] += go[i]
    assert same_bits(a.grad, expect) and not a.grad[20:].any()
    backwards = torch.zeros_like(w)  # negative twin: the same rows summed in reverse order differ
    for i in reversed(range(200)):
        backwards[tok[i]] += go[i]
    assert not same_bits(a.grad, backwards)
    assert same_bits(tb.embedding(w, tok), w[tok])


@pytest.mark.skipif(DEV == "cuda", reason="its twin's fp32 rows reduce alike rolled on the GPU: the GPU's version "
                    "is tests/gpu/test_triton_gpu.py::test_rmsnorm_rows_identical_in_any_batch")
@pytest.mark.parametrize("D", [96, 2048])
def test_rmsnorm_rows_are_the_same_bits_in_any_batch(D):
    # the forward holds fwd_config(D)["ROWS"] rows a program: a row alone, at any place in a tile or in a
    # partial last tile has the bits it has in the whole batch (plain and with the residual add)
    from rlalign.kernels.triton import norm

    rows = norm.fwd_config(D)["ROWS"]
    g = torch.Generator().manual_seed(11)
    R = 2 * rows + 5
    x, a = (torch.randn(R, D, generator=g).to(DEV) for _ in range(2))
    w = (torch.rand(D, generator=g) + 0.5).to(DEV)
    full, (s_full, y_full) = tb.rmsnorm(x, w, 1e-6), tb.add_rmsnorm(x, a, w, 1e-6)
    for lo, hi in ((0, 1), (3, 4), (rows - 1, rows + 2), (R - 1, R), (5, R), (0, R - 2)):
        assert same_bits(tb.rmsnorm(x[lo:hi], w, 1e-6), full[lo:hi]), (lo, hi)
        s, y = tb.add_rmsnorm(x[lo:hi], a[lo:hi], w, 1e-6)
        assert same_bits(s, s_full[lo:hi]) and same_bits(y, y_full[lo:hi]), (lo, hi)
    # negative twin: the same rows with the columns in another order (the same sums, reduced in another
    # order) change bits, so the comparisons above see the reduction order
    rolled = tb.rmsnorm(x.roll(1, -1), w.roll(1, -1), 1e-6).roll(-1, -1)
    assert not same_bits(rolled, full)


def test_rmsnorm_dw_column_sum_is_the_chunked_order_of_the_partials():
    # the weight gradient's partials [P, D] are summed in chunks of _COLSUM_CHUNK rows in order, then
    # the chunk sums the same way: an order fixed by P alone (the same at every EP size), parallel
    # over the chunks (one program walking all P rows was 10% of a bench-moe train step's GPU time)
    from rlalign.kernels.triton import norm

    g = torch.Generator().manual_seed(9)
    for P in (1, 5, norm._COLSUM_CHUNK, norm._COLSUM_CHUNK + 1, 100, 1100):
        x = torch.randn(P, 70, generator=g).to(DEV)
        expect = x.clone()
        while expect.shape[0] > 1:  # the promised order, in plain fp32 adds
            parts = []
            for c0 in range(0, expect.shape[0], norm._COLSUM_CHUNK):
                acc = expect[c0].clone()
                for r in range(c0 + 1, min(expect.shape[0], c0 + norm._COLSUM_CHUNK)):
                    acc = acc + expect[r]
                parts.append(acc)
            expect = torch.stack(parts)
        assert same_bits(norm._colsum(x), expect[0]), P


def test_weight_gradient_keeps_the_k_mask_for_every_token_count_with_the_same_bits():
    # a linear's dW = g^T x reduces over the tokens; the plan keeps the masked K loop whatever the
    # token count (no compiled variant per count), and its bits equal the plain matmul's (unmasked
    # when the count is a multiple of BLOCK_K); the grouped dW with host-list counts equals the one
    # with device counts
    from rlalign.kernels.triton import gemm

    g = torch.Generator().manual_seed(10)
    bk = gemm._config(torch.float32)["BLOCK_K"]
    for T in (4 * bk, 4 * bk + 3):
        x = torch.randn(T, 24, generator=g).to(DEV).requires_grad_()
        w = torch.randn(40, 24, generator=g).to(DEV).requires_grad_()
        go = torch.randn(T, 40, generator=g).to(DEV)
        tb.linear(x, w).backward(go)
        assert same_bits(w.grad, tb.matmul(go.t(), x.detach())), T
    counts = [bk, 0, 2 * bk + 5, 7]
    xg = torch.randn(sum(counts), 24, generator=g).to(DEV)
    gg = torch.randn(sum(counts), 40, generator=g).to(DEV)
    host = gemm.grouped_wgrad(gg, xg, counts)
    dev = gemm.grouped_wgrad(gg, xg, torch.tensor(counts, device=DEV))
    assert same_bits(host, dev) and not host[1].any()
    s = 0
    for e, c in enumerate(counts):
        if c:
            assert same_bits(host[e], tb.matmul(gg[s : s + c].t(), xg[s : s + c])), e
        s += c


def test_gemm_small_m_configs_pick_by_tiles_per_sm_and_keep_the_k_chunks(monkeypatch):
    # the pinned configs are a pure function of (dtype, rows, columns, SMs): at M <= 256 the narrowest
    # 64-row tiles whose count fits one wave, else the main config where its tiles fill a wave, else 128
    # columns; past 256 rows the main config unless its tiles fill less than half a wave; the tile loop
    # flattened for 64 columns and where a program runs several tiles; rows past M masked at M <= 32; every
    # config keeps BLOCK_M 64 or the main 128 and a BLOCK_K that cuts the main config's k16 MMA chain (64,
    # 128 or 256), never reorders it
    from rlalign.kernels.triton import gemm, gemm_configs

    monkeypatch.setattr(gemm, "INTERPRET", False)
    bf = torch.bfloat16

    def pick(m, n):
        cfg = gemm.small_m_config(bf, m, [n], 132)
        return cfg["BLOCK_N"], bool(cfg.get("MASK_M")), bool(cfg.get("FLATTEN"))

    assert [pick(1, n) for n in (512, 2048, 4096, 32000)] == [(16, True, False), (16, True, False),
                                                              (32, True, False), (128, True, True)]
    assert pick(64, 2048) == (16, False, False) and pick(64, 4096) == (32, False, False)
    assert pick(33, 4096) == (32, False, False) and pick(128, 32000) == (128, False, True)
    assert [pick(256, n) for n in (512, 2048, 4096)] == [(16, False, False), (64, False, True), (128, False, False)]
    assert gemm.small_m_config(bf, 256, [32000], 132) == gemm.MATMUL_CONFIGS[bf]
    # past 256 rows: the main config, unless its tiles fill less than half a wave (then the main tiles half as
    # wide, or the widest member, whichever first fills half a wave)
    widest = gemm.MATMUL_SMALL_M[bf][2][-1]
    assert [(pick(m, n)[0], gemm.small_m_config(bf, m, [n], 132)["BLOCK_M"]) for m, n in
            ((257, 2048), (512, 2048), (2048, 2048), (10240, 512), (512, 32000))] == [
        (widest["BLOCK_N"], 64), (widest["BLOCK_N"], 64), (256, 128), (256, 128), (256, 128)]
    assert gemm.small_m_config(torch.float32, 8, [2048], 132) == gemm.MATMUL_CONFIGS[torch.float32]
    # a decode step's router [64, 2048] at 2,048 rows: 16 main tiles, the 128-column member
    assert pick(2048, 64) == (128, False, False)
    # between: the main tiles half as wide, where their 2x tiles fill half a wave (1,024 x 2,048: 64 main tiles)
    half = gemm_configs.MATMUL_PAST_SMALL_M[bf][0]
    for m, n in ((1024, 2048), (2048, 768), (4096, 512)):
        assert gemm.small_m_config(bf, m, [n], 132) == dict(half, FLATTEN=False), (m, n)
    assert half["BLOCK_M"] == 128 and half["BLOCK_K"] == gemm_configs.MATMUL_CONFIGS[bf]["BLOCK_K"]
    assert gemm.small_m_config(bf, 4096, [768], 132) == gemm.MATMUL_CONFIGS[bf]  # 96 main tiles: the main config
    # grouped: 64 x 128 tiles with two programs per SM up to 32 rows per expert; up to 512 the main tiles with a
    # fourth stage, a program per tile, an expert's last tile of <= 64 rows half high; then the main config;
    # short K (the experts' down, K 768, weights read K-contiguous) past 128 rows per group: the main tiles, the
    # tile loop flattened
    assert gemm._grouped_config(bf, 32)["BLOCK_N"] == 128 and gemm._grouped_config(bf, 32)["PER_SM"] == 2
    half = dict(gemm.MATMUL_CONFIGS[bf], num_stages=4, HALF_TAIL=True, PER_SM=gemm_configs.TILE_PER_PROGRAM, TMA=False)
    assert gemm._grouped_config(bf, 33) == gemm._grouped_config(bf, 128, 768) == half
    assert gemm._grouped_config(bf, 256) == gemm._grouped_config(bf, 512) == half
    assert gemm._grouped_config(bf, 513) == gemm.MATMUL_CONFIGS[bf] == gemm._config(bf)
    flat = dict(gemm.MATMUL_CONFIGS[bf], FLATTEN=True)
    assert gemm._grouped_config(bf, 129, 768) == gemm._grouped_config(bf, 10**6, 64) == flat
    assert gemm._grouped_config(bf, 129, 769) == gemm._grouped_config(bf, 129) == gemm._grouped_config(bf, 512)
    main = gemm.MATMUL_CONFIGS[bf]
    for cfg in [*gemm.MATMUL_SMALL_M[bf][2], *(c for _, c in gemm.GROUPED_SMALL_M[bf]), flat]:  # the main K chunks, cut
        assert cfg["BLOCK_K"] % main["BLOCK_K"] == 0 and cfg["BLOCK_M"] in (64, main["BLOCK_M"])


def test_linear_rows_identical_across_the_small_m_buckets(monkeypatch):
    # a linear's rows have the main config's bits at every M, on both sides of the small-M bucket (the
    # interpreter's: 16-row tiles, rows past M masked). Negative twin: a bucket with other K chunks
    # (BLOCK_K 32; the interpreter rounds once per chunk) changes the bits
    from rlalign.kernels.triton import gemm

    g = torch.Generator().manual_seed(12)
    w = torch.randn(48, 96, generator=g).to(DEV)
    x = torch.randn(40, 96, generator=g).to(DEV)
    full = tb.linear(x, w)
    for m in range(1, 41):
        assert same_bits(tb.linear(x[:m], w), full[:m]), m
    if DEV == "cpu":
        assert gemm.small_m_config(torch.float32, 8, [48], 4)["MASK_M"]
        assert "MASK_M" not in gemm.small_m_config(torch.float32, 9, [48], 4)
        monkeypatch.setattr(gemm, "INTERPRET_SMALL_M", (8, dict(gemm.INTERPRET_SMALL_M[1], BLOCK_K=32)))
        monkeypatch.setattr(gemm, "_MATMUL_PLANS", {})
        assert not same_bits(tb.linear(x[:4], w), full[:4])


def test_gemm_flattened_tile_loop_changes_no_bit():
    # FLATTEN (the tile loop and the K loop as one) schedules the same tiles: plain matmul, the host-table
    # grouped GEMM and the device-counts one give the same bits
    from rlalign.kernels.triton import gemm

    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 64, generator=g).to(DEV)
    w = torch.randn(4, 48, 64, generator=g).to(DEV)
    counts = [10, 0, 25, 5]
    ref_g = gemm.grouped_mm(x, w, counts)
    ref_m = tb.matmul(x, w[0].t().contiguous())
    cfg = {**gemm._config(torch.float32), "num_stages": 2, "num_warps": 4, "FLATTEN": True}
    out = torch.empty(40, 48, device=DEV)
    gemm._gemm_counts(x, w, out, torch.tensor(counts, device=DEV), 40, 48, 0, 64, (64, 1, 1, 64, 48, 1),
                      (64, 0, 48 * 64, 48, 0), False, cfg)
    assert same_bits(out, ref_g)
    out = torch.empty(40, 48, device=DEV)
    probs = [(c, 64, s * 64, e * 48 * 64, s * 48) for e, (c, s) in enumerate(zip(counts, gemm._starts(counts)))
             if c]
    gemm._gemm(x, w, out, probs, 48, (64, 1, 1, 64, 48, 1), cfg)
    assert same_bits(out, ref_g)
    out = torch.empty(40, 48, device=DEV)
    gemm._gemm(x, w[0].t().contiguous(), out, [(40, 64, 0, 0, 0)], 48, (64, 1, 48, 1, 48, 1), cfg)
    assert same_bits(out, ref_m)



def _grouped_inputs(seed: int, counts: list[int]):
    """(generator, rows, x [R, 64], w [E, 48, 64], a row order) for the grouped GEMM's schedule tests."""
    g = torch.Generator().manual_seed(seed)
    R = sum(counts)
    x = torch.randn(R, 64, generator=g).to(DEV)
    w = torch.randn(len(counts), 48, 64, generator=g).to(DEV)
    return g, R, x, w, torch.randperm(R, generator=g).to(DEV)


def test_gemm_half_tail_tiles_change_no_bit():
    # HALF_TAIL (a problem's last tile of at most BLOCK_M / 2 rows runs half as high) schedules the same rows
    # through the same K chunks: device counts (rows read in place or gathered), the host table and a plain
    # matmul give the main tiles' bits; remainders below, at and past half a tile (the interpreter's 32-row
    # tiles). Negative twin: half tiles with other K chunks (BLOCK_K 32; the interpreter rounds per chunk)
    from rlalign.kernels.triton import gemm

    counts = [40, 0, 25, 16, 32, 49]
    g, R, x, w, order = _grouped_inputs(13, counts)
    base = gemm._config(torch.float32)
    ref_g = gemm.grouped_mm(x, w, counts)
    ref_r = gemm.grouped_mm(x, w, torch.tensor(counts, device=DEV), order, 2)
    assert same_bits(ref_r, gemm.grouped_mm(x[order // 2], w, counts))
    strides, steps = (64, 1, 1, 64, 48, 1), (64, 0, 48 * 64, 48, 0)
    probs = [(c, 64, s * 64, e * 48 * 64, s * 48) for e, (c, s) in enumerate(zip(counts, gemm._starts(counts))) if c]
    for cfg in ({**base, "HALF_TAIL": True}, {**base, "HALF_TAIL": True, "BLOCK_K": 32}):
        outs = [torch.empty(R, 48, device=DEV) for _ in range(3)]
        gemm._gemm_counts(x, w, outs[0], torch.tensor(counts, device=DEV), R, 48, 0, 64, strides, steps, False, cfg)
        gemm._gemm_counts(x, w, outs[1], torch.tensor(counts, device=DEV), R, 48, 0, 64, strides,
                          (0, *steps[1:]), False, cfg, order, 2)
        gemm._gemm(x, w, outs[2], probs, 48, strides, cfg)
        m = torch.empty(40, 48, device=DEV)
        gemm._gemm(x, w[0].t().contiguous(), m, [(40, 64, 0, 0, 0)], 48, (64, 1, 48, 1, 48, 1), cfg)
        same = [same_bits(outs[0], ref_g), same_bits(outs[1], ref_r), same_bits(outs[2], ref_g),
                same_bits(m, tb.matmul(x[:40], w[0].t().contiguous()))]
        assert same == ([True] * 4 if cfg["BLOCK_K"] == base["BLOCK_K"] else [False] * 4), (cfg, same)


@pytest.mark.skipif(DEV == "cuda", reason="it sets the interpreter's configs: the GPU's version is "
                    "tests/gpu/test_triton_gpu.py::test_gemm_tma_loads_keep_the_pointer_paths_bits")
def test_gemm_tma_loads_change_no_bit(monkeypatch):
    # operands through tensor descriptors (a config's TMA key) read the same values into the same K chunks:
    # device counts, the host table, a plain matmul and a linear give the pointer path's bits, with rows past a
    # group read from the next group or past the operand; gathered rows, the one-launch linears, the SwiGLU
    # epilogue's [gate | up] columns and an operand at an address off 16 bytes keep pointers. Negative twin:
    # descriptors with other K chunks (BLOCK_K 32; the interpreter rounds per chunk)
    from rlalign.kernels.triton import common, gemm

    counts = [40, 0, 25, 16, 33, 7]
    g, R, x, w, order = _grouped_inputs(17, counts)
    ws = [torch.randn(n, 64, generator=g).to(DEV) for n in (48, 16, 16)]
    flat = torch.empty(R * 64 + 1, device=DEV)
    off = flat[1:].view(R, 64)  # 4 bytes past an aligned address
    off.copy_(x)

    def run():
        dev = torch.tensor(counts, device=DEV)
        return [gemm.grouped_mm(x, w, dev), gemm.grouped_mm(x, w, dev, order, 2), gemm.grouped_mm(x, w, counts),
                tb.matmul(x, w[0].t()), tb.linear(x[:5], w[1]), *tb.linears(x, ws, [None] * 3),
                gemm.grouped_mm(off, w, counts), tb.linear(off, w[2]), gemm.grouped_mm(x, w, counts, swiglu=True),
                gemm.grouped_mm(x, w, dev, swiglu=True)]

    ref = run()
    for extra, equal in (({"TMA": True}, True), ({"TMA": True, "BLOCK_K": 32}, False)):
        monkeypatch.setattr(gemm, "INTERPRET_MATMUL", dict(gemm.INTERPRET_MATMUL, **extra))
        monkeypatch.setattr(gemm, "INTERPRET_SMALL_M", (8, dict(gemm.INTERPRET_SMALL_M[1], **extra)))
        gemm._MATMUL_PLANS.clear()
        outs = run()
        tma = [v for v in [*common.cached_entries(), *gemm._MATMUL_PLANS.values()]
               for v in (v if isinstance(v, tuple) else (v,)) if isinstance(v, gemm._TmaLaunch)]
        assert len({id(t) for t in tma if t.tma.meta["BLOCK_K"] == extra.get("BLOCK_K", 16)}) == 5  # taken
        same = [same_bits(a, b) for a, b in zip(outs, ref)]
        assert same == [equal] * len(ref), (extra, same)
