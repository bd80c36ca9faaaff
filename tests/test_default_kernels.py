"""kernels.mode=default, the fast vendor path (kernels/torch_default.py), on CPU: the same functions as
the deterministic reference to rounding (attention through pages, ragged prefill, top-k / top-p sets,
AdamW), the split-KV decode kernel under the Triton interpreter, and a missing vendor kernel named in one
logged line. Its bits differing from the deterministic mode's: the negative twins in test_ops.py,
test_paged.py and test_engine.py."""

import logging
import math
import os

import pytest
import torch

from rlalign import kernels
from rlalign.kernels import sampling
from rlalign.kernels import torch_default as dflt
from rlalign.kernels import torch_deterministic as det


def _pages(lens, H=4, Hk=2, D=16, page=4, seed=0, dtype=torch.float32):
    """k, v of sequences `lens` in shuffled pages (NaN in every slot no sequence wrote)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(need) + 3, generator=g)
    table = torch.zeros(len(lens), max(need) + 2, dtype=torch.int32)
    off = 0
    for s, c in enumerate(need):
        table[s, :c] = perm[off : off + c].int()
        off += c
    kp = torch.full((len(perm), page, Hk, D), float("nan"), dtype=dtype)
    vp = kp.clone()
    for s, n in enumerate(lens):
        for j in range(n):
            kp[table[s, j // page], j % page] = torch.randn(Hk, D, generator=g).to(dtype)
            vp[table[s, j // page], j % page] = torch.randn(Hk, D, generator=g).to(dtype)
    return kp, vp, table


def test_default_paged_attention_prefill_runs_and_decode_rows_match_the_reference():
    lens = [9, 30, 5]
    kp, vp, table = _pages(lens)
    # decode rows of sequences 0 and 1, then two fresh prompt chunks (sequence 2 whole, sequence 1 whole)
    seq = torch.tensor([0, 1] + [2] * 5 + [1] * 30)
    pos = torch.cat([torch.tensor([8, 29]), torch.arange(5), torch.arange(30)])
    q = torch.randn(len(seq), 4, 16, generator=torch.Generator().manual_seed(1))
    ref = det.attention_paged(q, kp, vp, table, seq, pos, 0.25)
    with kernels.use(mode="default"):
        out = kernels.attention_paged(q, kp, vp, table, seq, pos, 0.25, runs=[(2, 5, 0, 2), (7, 30, 0, 1)])
        plain = kernels.attention_paged(q, kp, vp, table, seq, pos, 0.25)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(plain, ref, atol=1e-5)


def test_default_prefill_ragged_matches_the_reference():
    g = torch.Generator().manual_seed(2)
    cu = [0, 7, 30, 31, 50]
    q, k, v = (torch.randn(50, h, 16, generator=g) for h in (4, 2, 2))
    with kernels.use(mode="default"):
        out = kernels.attention_prefill(q, k, v, cu)
    assert torch.allclose(out, det.attention_prefill(q, k, v, cu, 0.25), atol=1e-5)


def test_a_missing_vendor_kernel_is_named_in_one_logged_line(caplog):
    dflt.LOGGED_FALLBACKS.clear()
    x, w = torch.randn(10, 32), torch.randn(3, 16, 32)
    with caplog.at_level(logging.WARNING, logger="rlalign.kernels"), kernels.use(mode="default"):
        a = kernels.grouped_linear(x, w, [3, 4, 3])
        kernels.grouped_linear(x, w, [3, 4, 3])
    lines = [r.getMessage() for r in caplog.records if "grouped_linear" in r.getMessage()]
    assert len(lines) == 1 and "torch._grouped_mm needs CUDA" in lines[0], lines
    assert torch.allclose(a[3:7], x[3:7] @ w[1].t(), atol=1e-5)
    assert not kernels.capturable(x)


@pytest.mark.parametrize("rank, level", [(1, logging.DEBUG), (0, logging.WARNING)])
def test_in_a_process_group_rank_0_says_a_fallback_for_its_peers(monkeypatch, caplog, rank, level):
    dflt.LOGGED_FALLBACKS.clear()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    with caplog.at_level(logging.DEBUG, logger="rlalign.kernels"), kernels.use(mode="default"):
        kernels.grouped_linear(torch.randn(4, 8), torch.randn(2, 8, 8), [2, 2])
    assert [(r.levelno, "torch._grouped_mm needs CUDA" in r.getMessage()) for r in caplog.records] == [(level, True)]


def _engine_with_graphs_on():
    from types import SimpleNamespace

    from rlalign.rollout.native.engine import NativeEngine

    model = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(2, 2)))
    return SimpleNamespace(config=SimpleNamespace(cuda_graphs=True), model=model), NativeEngine.graphs_allowed


@pytest.mark.parametrize("mode, logged", [("default", 2), ("deterministic", 0)])
def test_the_eager_chains_and_steps_on_a_cpu_are_one_logged_line_each_in_default_mode(caplog, mode, logged):
    """On a CPU the compiled elementwise chains run eagerly and the engine steps without CUDA graphs: each
    said once however often it runs; the deterministic mode (twin) has no vendor path to miss."""
    dflt.LOGGED_FALLBACKS.clear()
    engine, graphs_allowed = _engine_with_graphs_on()
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="rlalign.kernels"), kernels.use(mode=mode):
        for _ in range(3):
            out = kernels.swiglu(x, x)
            assert not graphs_allowed(engine)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == logged, lines
    if logged:
        assert sorted(lines) == [
            "kernels.mode=default: elementwise chains: torch.compile of them runs on CUDA only; running eager "
            "torch ops instead",
            "kernels.mode=default: engine steps: CUDA graphs need CUDA; running eager steps instead"]
    assert torch.allclose(out, torch.nn.functional.silu(x) * x)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.9), (20, 0.7)])
def test_default_filter_keeps_the_deterministic_set(top_k, top_p):
    z = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)) * 3  # no ties
    kept = torch.isfinite(dflt.filter_logits(z, top_k, top_p, 1.0))
    assert torch.equal(kept, torch.isfinite(sampling.filter_logits(z, top_k, top_p)))


def test_default_sampler_draws_from_the_filtered_set_and_scores_it():
    z = torch.randn(256, 100, generator=torch.Generator().manual_seed(4)) * 2
    with kernels.use(mode="default"):
        f = kernels.tempered(z, temperature=0.8, top_p=0.9)
        tok, lp = kernels.sample_tempered_logprobs(f, 7, torch.arange(256), torch.zeros(256, dtype=torch.long))
    assert torch.isfinite(f.values().gather(-1, tok[:, None])).all()
    assert torch.allclose(lp, torch.log_softmax(f.values(), -1).gather(-1, tok[:, None])[:, 0])
    assert len(set(tok.tolist())) > 10  # a draw, not an argmax


def test_default_adamw_is_torchs():
    from omegaconf import OmegaConf

    from rlalign.training.optimizer import MasterWeights

    m = torch.nn.Linear(8, 4, bias=False)
    t = OmegaConf.create({"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1})
    mw = MasterWeights(m, t, ["weight"], [], 0, 1)
    ref = torch.nn.Parameter(m.weight.detach().clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    with kernels.use(mode="default"):
        for s in range(3):
            g = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
            assert mw.step({"weight": g}, 1.0, m) == set()
            ref.grad = g
            opt.step()
    assert torch.allclose(mw.master["weight"], ref, atol=1e-6)
    assert float(mw.opt.state[mw.master["weight"]]["step"]) == 3.0


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or the Triton interpreter")
@pytest.mark.parametrize("programs_per_sm", [1, 40])  # one split per row / several, folded
def test_splitkv_decode_kernel_matches_the_reference(monkeypatch, programs_per_sm):
    pytest.importorskip("triton")
    from rlalign.kernels.triton import splitkv

    monkeypatch.setattr(splitkv, "PROGRAMS_PER_SM", programs_per_sm)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kp, vp, table = _pages([5, 37, 70, 1], dtype=torch.bfloat16)
    seq, pos = torch.tensor([0, 1, 2, 3, 2, 1]), torch.tensor([4, 36, 69, 0, 10, 20])
    q = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = det.attention_paged(q.float(), kp.float(), vp.float(), table, seq, pos, 0.25)
    out = splitkv.paged_decode(*(t.to(dev) for t in (q, kp, vp, table, seq, pos)), 0.25).cpu()
    assert splitkv.num_splits(6, 2, table.shape[1] * 4, torch.device(dev)) > 1 or programs_per_sm == 1
    assert not out.isnan().any() and (out.float() - ref).abs().max() < 2e-2
    assert math.isclose(float(out.float().norm()), float(ref.norm()), rel_tol=1e-2)
