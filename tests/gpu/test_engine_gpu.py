"""GPU: the native engine with the Triton kernels — CUDA-graph decode steps (padded buckets) give
the same tokens and bits as eager steps, every schedule gives the same bits, and the logprobs
equal the trainer's rescoring. Decode graphs kept across generate() calls are replayed, not
captured again, with any seed; after an in-place weight update they sample what eager steps
sample with the new weights; a rebound parameter drops them (twin: kept stale, they differ)."""

import dataclasses
from collections import Counter

import pytest
import torch
from engine_model import PARAMS, engine_model, engine_prompts, same_rollouts

from rlalign import kernels
from rlalign.rollout.native import graphs as native_graphs
from rlalign.rollout.native.engine import NativeEngine, generate
from rlalign.rollout.types import EngineConfig
from rlalign.training.scoring import score

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model():
    return engine_model()


PLAIN = EngineConfig(cuda_graphs=False, keep_state=False, lookahead=False)  # eager, one step at a time


@pytest.fixture(scope="module")
def eager(model):
    with kernels.use(mode="deterministic", backend="triton"):
        return generate(model, engine_prompts(37), list(range(37)), PARAMS, engine=PLAIN)


@pytest.mark.parametrize("engine", [EngineConfig(), EngineConfig(max_num_seqs=5, max_num_batched_tokens=64),
                                    EngineConfig(max_num_seqs=16, page_size=32, num_pages=40),
                                    EngineConfig(lookahead=False), EngineConfig(cuda_graphs=False)],
                         ids=["graphs", "graphs-chunked", "graphs-page-limited", "graphs-no-lookahead",
                              "eager-lookahead"])
def test_graphs_and_schedules_change_no_bit(model, eager, engine):
    with kernels.use(mode="deterministic", backend="triton"):
        got = generate(model, engine_prompts(37), list(range(37)), PARAMS, engine=engine)
    for r, ref in zip(got, eager):
        assert r.tokens == ref.tokens
        assert torch.equal(r.logprobs.view(torch.int32), ref.logprobs.view(torch.int32)), f"sample {r.sample_id}"


def test_engine_logprobs_equal_the_trainers(model, eager):
    with kernels.use(mode="deterministic", backend="triton"):
        lps = score(model, [r.prompt for r in eager], [r.tokens for r in eager], PARAMS, micro_batch_size=8)
    bad = sum(int((r.logprobs.cuda() != lp.float()).sum()) for r, lp in zip(eager, lps))
    assert sum(len(r.tokens) for r in eager) > 500 and bad == 0


def test_negative_twin_default_kernels_disagree_with_the_trainer(model):
    with kernels.use(mode="default"):
        outs = generate(model, engine_prompts(37), list(range(37)), PARAMS, engine=EngineConfig(cuda_graphs=False))
        lps = score(model, [r.prompt for r in outs], [r.tokens for r in outs], PARAMS, micro_batch_size=8)
    assert sum(int((r.logprobs.cuda() != lp.float()).sum()) for r, lp in zip(outs, lps)) > 0


EAGER = EngineConfig(cuda_graphs=False, keep_state=False)  # eager, lookahead


def test_kept_graphs_are_replayed_in_later_calls_with_the_same_bits(model, eager):
    prompts, ids, other = engine_prompts(37), list(range(37)), dataclasses.replace(PARAMS, seed=2**63 + 11)
    with kernels.use(mode="deterministic", backend="triton"):
        engine = NativeEngine(model)
        first = engine.generate(prompts, ids, PARAMS)
        g = engine.state.graphs
        captured, n = dict(g.graphs), g.captures
        assert n > 0
        second = engine.generate(prompts, ids, other)  # another seed: the same graphs (rekeyed ids)
        assert engine.state.graphs is g and all(g.graphs[k] is v for k, v in captured.items())
        n2 = g.captures
        third = engine.generate(prompts, ids, PARAMS)
        assert g.captures == n2  # the same buckets as the first call: nothing captured
        ref_other = generate(model, prompts, ids, other, engine=EAGER)
    assert same_rollouts(first, eager) and same_rollouts(third, eager) and same_rollouts(second, ref_other)
    assert not same_rollouts(second, eager)  # the seed is not baked into the graphs


@pytest.fixture(scope="module")
def model2():
    return engine_model()


def test_kept_graphs_after_an_in_place_weight_update_sample_the_new_weights(model2):
    """Weight sync copies into the generator's parameters (weight_sync.receive):
    the kept graphs read the new values."""
    prompts, ids = engine_prompts(37, seed=1), list(range(37))
    new = engine_model(seed=1).state_dict()
    with kernels.use(mode="deterministic", backend="triton"):
        engine = NativeEngine(model2)
        before = engine.generate(prompts, ids, PARAMS)
        g = engine.state.graphs
        captured = dict(g.graphs)
        with torch.no_grad():
            for name, p in model2.named_parameters():
                p.copy_(new[name])
        after = engine.generate(prompts, ids, PARAMS)
        assert engine.state.graphs is g and all(g.graphs[k] is v for k, v in captured.items())
        ref = generate(model2, prompts, ids, PARAMS, engine=EAGER)
    assert same_rollouts(after, ref)
    assert not same_rollouts(after, before)  # the update changed what is sampled


def test_a_rebound_parameter_drops_kept_graphs_twin_stale_graphs_differ(model2, monkeypatch):
    prompts, ids = engine_prompts(37, seed=2), list(range(37))
    g0 = torch.Generator(device="cuda").manual_seed(5)
    old = model2.lm_head.weight
    with kernels.use(mode="deterministic", backend="triton"):
        engine = NativeEngine(model2)
        monkeypatch.setattr(native_graphs, "graph_inputs", lambda m: ("frozen",))  # the twin: no invalidation
        engine.generate(prompts, ids, PARAMS)
        model2.lm_head.weight = torch.nn.Parameter(
            (torch.randn(old.shape, generator=g0, device="cuda") * 0.02).to(old.dtype))  # `old` stays alive
        stale = engine.generate(prompts, ids, PARAMS)  # the graphs still read the old lm head
        ref = generate(model2, prompts, ids, PARAMS, engine=EAGER)
        monkeypatch.undo()
        n = engine.state.graphs.captures
        fresh = engine.generate(prompts, ids, PARAMS)
        assert engine.state.graphs.captures > n  # the new address: captured again
        model2.lm_head.weight = old
    assert not same_rollouts(stale, ref)
    assert same_rollouts(fresh, ref)


@pytest.mark.parametrize("n,e", [(1, 64), (148, 16), (2048, 64), (2048, 128), (16384, 64), (999, 7), (79920, 64),
                                 (20000, 7)])
def test_triton_dispatch_equals_the_torch_counting_sort(n, e):
    from rlalign.kernels.torch_deterministic import moe_dispatch as dispatch_torch
    from rlalign.kernels.triton.dispatch import moe_dispatch

    g = torch.Generator(device="cuda").manual_seed(n)
    for flat in (torch.randint(0, e, (n,), generator=g, device="cuda"),
                 torch.randint(0, 2, (n,), generator=g, device="cuda") * (e - 1)):  # skewed: two experts
        for w, got in zip(dispatch_torch(flat, e), moe_dispatch(flat, e), strict=True):
            assert torch.equal(got, w)


def test_engine_bits_do_not_depend_on_the_dispatch_kernel(model, eager, monkeypatch):
    from rlalign.kernels.triton import dispatch

    monkeypatch.setattr(dispatch, "MAX_ROWS", -1)  # no row count fits the Triton kernel: the torch counting sort
    with kernels.use(mode="deterministic", backend="triton"):
        torch_dispatch = generate(model, engine_prompts(37), list(range(37)), PARAMS, engine=EAGER)
    assert same_rollouts(torch_dispatch, eager)


def test_lookahead_rows_of_sequences_ended_by_eos_are_discarded(model, eager):
    """EOS = the token that most sequences sample before their last one: they end at different steps while
    their next row is already enqueued (lookahead); graph and eager steps with lookahead == one step at a
    time, bit for bit."""
    seqs_with = Counter(t for r in eager for t in set(r.tokens[:-1]))
    p = dataclasses.replace(PARAMS, eos_token_id=max(seqs_with, key=lambda t: (seqs_with[t], -t)))
    with kernels.use(mode="deterministic", backend="triton"):
        ref = generate(model, engine_prompts(37), list(range(37)), p, engine=PLAIN)
        assert any(r.finish_reason == "eos" for r in ref)
        for config in (EngineConfig(), EngineConfig(cuda_graphs=False)):
            engine = NativeEngine(model, config)
            got = engine.generate(engine_prompts(37), list(range(37)), p)
            stats = engine.stats
            assert stats["lookahead_steps"] > 0 and stats["discarded_rows"] > 0
            assert same_rollouts(got, ref) and [r.finish_reason for r in got] == [r.finish_reason for r in ref]
