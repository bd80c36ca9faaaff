"""The native engine's schedule changes no token and no bit: continuous batching with few slots,
prompt chunks sharing steps with decode rows, tiny pages, a cache too small for every request at
once (requests wait for pages), all sample what the all-at-once schedule samples, and every
logprob equals the trainer's rescoring of the finished sequence."""

import dataclasses

import pytest
import torch
from conftest import same_bits, tiny_model
from eager_graphs import EagerGraphs

from rlalign import kernels
from rlalign.kernels import sampling
from rlalign.rollout.native.engine import NativeEngine, generate
from rlalign.rollout.native.graphs import DecodeGraphs, bucket, graph_rows
from rlalign.rollout.native.pages import KVState, grow
from rlalign.rollout.native.runner import ModelRunner
from rlalign.rollout.native.scheduler import Scheduler
from rlalign.rollout.sampling import GRAPH_SEED, rekey_sample_ids
from rlalign.rollout.types import EngineConfig
from rlalign.sampling_params import SamplingParams
from rlalign.training.scoring import score


def _prompts(n, seed=0, lo=1, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


PARAMS = SamplingParams(max_new_tokens=14, eos_token_id=1, seed=5, temperature=0.8, top_k=20, top_p=0.9)
SCHEDULES = [
    EngineConfig(),  # every request at once, whole prompts in the first step
    EngineConfig(max_num_seqs=1, page_size=1),  # one at a time
    EngineConfig(max_num_seqs=3, max_num_batched_tokens=5, page_size=4),  # chunks mixed with decode rows
    EngineConfig(max_num_seqs=4, max_num_batched_tokens=4, page_size=16, num_pages=3),  # waits for pages
]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    with kernels.use(mode="deterministic", backend="torch"):
        return generate(model, _prompts(11), [100 + i for i in range(11)], PARAMS)


@pytest.mark.parametrize("engine", SCHEDULES[1:], ids=["one-at-a-time", "chunked-mixed", "page-limited"])
def test_every_schedule_samples_the_same_tokens_and_bits(model, reference, engine):
    got = generate(model, _prompts(11), [100 + i for i in range(11)], PARAMS, engine=engine)
    for r, ref in zip(got, reference):
        assert r.tokens == ref.tokens and r.finish_reason == ref.finish_reason
        assert same_bits(r.logprobs, ref.logprobs), f"sample {r.sample_id}"


def test_engine_logprobs_equal_the_trainers_rescoring(model, reference):
    lps = score(model, [r.prompt for r in reference], [r.tokens for r in reference], PARAMS, micro_batch_size=4)
    assert sum(len(r.tokens) for r in reference) > 60
    assert any(r.finish_reason == "eos" for r in reference) or all(len(r.tokens) == 14 for r in reference)
    for r, lp in zip(reference, lps):
        assert same_bits(r.logprobs, lp.float()), f"sample {r.sample_id}"


def test_schedule_negative_twin_default_kernels_depend_on_the_schedule(model):
    prompts, ids = _prompts(11, seed=1, lo=8, hi=30), list(range(11))
    p = SamplingParams(max_new_tokens=10, seed=2, greedy=True)  # default mode draws from torch's RNG
    with kernels.use(mode="default"):
        a = generate(model, prompts, ids, p)
        b = generate(model, prompts, ids, p, engine=SCHEDULES[2])
    assert any(not same_bits(x.logprobs, y.logprobs) for x, y in zip(a, b) if x.tokens == y.tokens)


def test_a_request_that_cannot_fit_the_cache_is_named(model):
    with pytest.raises(ValueError, match=r"sample 7: prompt of 20 tokens \+ max_new_tokens=14 needs 3 KV pages"):
        generate(model, [[3] * 5, [4] * 20], [6, 7], PARAMS, engine=EngineConfig(page_size=16, num_pages=2))
    with pytest.raises(ValueError, match="max_num_batched_tokens=2 is below generator.max_num_seqs=3"):
        generate(model, [[3]], [0], PARAMS, engine=EngineConfig(max_num_seqs=3, max_num_batched_tokens=2))
    with pytest.raises(ValueError, match="page_size=0"):
        generate(model, [[3]], [0], PARAMS, engine=EngineConfig(page_size=0))


# --- the engine state kept between calls (KV cache, block table, decode graphs) --------------------------------


def test_rekeyed_sample_ids_draw_the_seeds_noise():
    """Decode graphs are captured with GRAPH_SEED baked in; a call's seed enters through rekeyed ids:
    the same uniforms bit for bit, the same tokens (torch sampler and the Triton kernel, interpreted)."""
    ids = torch.tensor([0, 1, 5, 2**40 + 7, 123_456])
    pos = torch.tensor([0, 3, 7, 100, 9])
    z = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for seed in (0, 5, 2**63 + 3, -7, 2**64 - 1, 1_000_003 * 17 + 4):
        k = rekey_sample_ids(ids, seed)
        assert torch.equal(sampling.uniform(seed, ids, pos, 64), sampling.uniform(GRAPH_SEED, k, pos, 64))
        t = kernels.Tempered(z)
        assert torch.equal(kernels.sample_tempered(t, seed, ids, pos), kernels.sample_tempered(t, GRAPH_SEED, k, pos))
    triton_backend = pytest.importorskip("rlalign.kernels.triton")
    k = rekey_sample_ids(ids, 99)
    fused = triton_backend.gumbel_argmax
    assert torch.equal(fused(z, 99, ids, pos), fused(z, GRAPH_SEED, k, pos))
    # twin: without the rekeying, the graph's seed draws other noise
    assert not torch.equal(sampling.uniform(99, ids, pos, 64), sampling.uniform(GRAPH_SEED, ids, pos, 64))


def test_kept_state_is_reused_across_calls_and_changes_no_bit(model, reference):
    """A NativeEngine keeps its KV cache and block table between calls: a later call that fits reuses
    them (stale keys of earlier calls in its pages) with the same tokens and bits as a fresh cache;
    one that does not fit replaces them (grown with headroom); keep_state=False keeps nothing."""
    off = NativeEngine(model, EngineConfig(keep_state=False))
    off.generate(_prompts(11), [100 + i for i in range(11)], PARAMS)
    assert off.state is None
    engine = NativeEngine(model)
    big = _prompts(16, seed=3, lo=15, hi=30)
    engine.generate(big, list(range(16)), SamplingParams(max_new_tokens=20, seed=9))  # fills pages with other keys
    kept = engine.state
    assert kept is not None and kept.rows == 16 and kept.page_size == 16
    got = engine.generate(_prompts(11), [100 + i for i in range(11)], PARAMS)
    assert engine.state is kept  # fits: reused
    for r, ref in zip(got, reference):
        assert r.tokens == ref.tokens and same_bits(r.logprobs, ref.logprobs), f"sample {r.sample_id}"
    engine.generate(big + big, list(range(32)), SamplingParams(max_new_tokens=20, seed=9))  # 32 rows: replaced
    grown = engine.state
    assert grown is not kept and grown.rows == 32 and grown.num_pages >= 2 * kept.num_pages
    engine.config = EngineConfig(page_size=4)
    engine.generate([[3, 4]], [0], PARAMS)  # another page size: replaced
    assert engine.state.page_size == 4
    engine.release_memory()
    assert engine.state is None


def test_grow_leaves_headroom():
    assert grow(10, 12) == 12 and grow(7, 0) == 7
    assert grow(1000, 900) == 1024 and grow(1025, 1024) == 1088
    assert all(n <= grow(n, 0) <= n * 1.07 + 1 for n in range(1, 5000, 37))


def test_decode_graphs_follow_weight_addresses_not_values(model):
    """What decides whether kept decode graphs are valid (no CUDA needed to check the logic): weight
    sync copies new values into the same tensors (GeneratorWorker.load_weights, weight_sync.receive)
    and keeps them; a rebound parameter, another op set or another sampling distribution does not;
    the seed never does (rekeyed ids)."""
    m = tiny_model(seed=4)
    g = DecodeGraphs(None, None, 0, 0)

    def graphs_for(params):
        g.begin(m, params)
        g._check()
        g.end()
        return g.graphs

    graphs_for(PARAMS)[4] = "captured"
    assert graphs_for(dataclasses.replace(PARAMS, seed=77)) == {4: "captured"}
    assert graphs_for(dataclasses.replace(PARAMS, temperature=0.5)) == {}  # another distribution: its own graphs
    assert graphs_for(PARAMS) == {4: "captured"}
    with torch.no_grad():  # weight sync: in place
        for p in m.parameters():
            p.copy_(p * 2 + 1)
    assert graphs_for(PARAMS) == {4: "captured"}
    with kernels.use(mode="default"):
        assert graphs_for(PARAMS) == {}  # another op set: dropped
    graphs_for(PARAMS)[4] = "captured"
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())  # rebound: the graph reads the old one
    assert graphs_for(PARAMS) == {}
    graphs_for(PARAMS)[4] = "captured"
    m.model.layers[0].self_attn.q_proj.weight.data = torch.zeros_like(m.model.layers[0].self_attn.q_proj.weight)
    assert graphs_for(PARAMS) == {}


def test_lookahead_changes_no_token_and_no_bit(model, reference, monkeypatch):
    """The next step enqueued before this one's tokens are read back (EngineConfig.lookahead), prompt
    chunks and admissions included: rows of sequences that this step ends with EOS run once more and
    are discarded; every schedule samples the same tokens with the same bits as without it, and as the
    reference."""
    discarded, mixed = 0, []
    ahead = Scheduler.lookahead

    def spy(sched, pending):  # lookahead steps that also hold prompt rows (prefill beside the follow rows)
        step = ahead(sched, pending)
        mixed.append(step is not None and len(step.rows) > len(step.follow))
        return step

    monkeypatch.setattr(Scheduler, "lookahead", spy)
    for engine in SCHEDULES:
        eng = NativeEngine(model, dataclasses.replace(engine, lookahead=False))
        off = eng.generate(_prompts(11), [100 + i for i in range(11)], PARAMS)
        assert eng.stats["lookahead_steps"] == 0
        eng.config = engine
        on = eng.generate(_prompts(11), [100 + i for i in range(11)], PARAMS)
        stats = eng.stats
        assert stats["lookahead_steps"] > 0
        discarded += stats["discarded_rows"]
        for a, b, ref in zip(off, on, reference):
            assert a.tokens == b.tokens == ref.tokens and a.finish_reason == b.finish_reason == ref.finish_reason
            assert same_bits(a.logprobs, ref.logprobs) and same_bits(b.logprobs, ref.logprobs), f"sample {a.sample_id}"
    assert discarded > 0  # sequences ended by EOS while their next row was already enqueued
    assert any(mixed)  # prompt chunks enqueued ahead too, beside decode rows whose tokens were not read back


def _runs_of(step) -> list[tuple[int, int, int, int]]:
    """The prompt chunks of a step read from its rows (a prompt row: a position inside its prompt):
    maximal runs of consecutive positions of one sequence, as (row0, n, pos0, slot)."""
    runs: list[tuple[int, int, int, int]] = []
    for i, (seq, p) in enumerate(step.rows):
        if p >= seq.n_prefill:
            continue
        r0, n, p0, slot = runs[-1] if runs else (0, 0, 0, -1)
        if slot == seq.slot and r0 + n == i and p0 + n == p:
            runs[-1] = (r0, n + 1, p0, slot)
        else:
            runs.append((i, 1, p, seq.slot))
    return runs


def test_steps_name_their_prompt_chunks(model, monkeypatch):
    """Step.runs (the Triton attention's prefill tiles) names every prompt chunk of every step, after its
    decode rows, with and without lookahead, chunks beside decode rows included. Twin: runs that misstate
    one chunk's first position are told apart."""
    seen, run = [], ModelRunner.run

    def spy(runner, step, *a, **k):
        seen.append((list(step.runs), _runs_of(step), len(step.rows)))
        return run(runner, step, *a, **k)

    monkeypatch.setattr(ModelRunner, "run", spy)
    for lookahead in (False, True):
        NativeEngine(model, dataclasses.replace(SCHEDULES[2], lookahead=lookahead)).generate(
            _prompts(11), [100 + i for i in range(11)], PARAMS)
    assert all(named == read and (not named or sum(r[1] for r in named) == rows - named[0][0])
               for named, read, rows in seen)
    mixed = [named for named, _, _ in seen if named and named[0][0] > 0]
    assert mixed  # chunks behind decode rows
    r0, n, p0, slot = mixed[0][0]
    assert [(r0, n, p0 + 1, slot), *mixed[0][1:]] != mixed[0]


def test_both_engines_implement_the_generator_protocol():
    """make_generator returns either engine: each has every method of rollout.generator.Generator.
    Twin: a class without one is caught by the same check."""
    from rlalign.rollout.generator import Generator
    from rlalign.rollout.vllm.engine import VllmRankGenerator

    methods = [m for m in vars(Generator) if not m.startswith("_")]
    assert set(methods) == {"generate", "load_weights", "release_memory", "resume_memory", "close", "resident_bytes",
                            "weights_stale"}

    def missing(cls):
        return [m for m in methods if not callable(getattr(cls, m, None))]

    assert missing(NativeEngine) == [] and missing(VllmRankGenerator) == []
    assert missing(type("NoClose", (), {m: lambda self: None for m in methods if m != "close"})) == ["close"]


def test_release_memory_frees_the_kept_state_and_changes_no_bit(model, reference):
    engine = NativeEngine(model)
    engine.generate(_prompts(11), [100 + i for i in range(11)], PARAMS)
    assert engine.state is not None
    engine.release_memory()
    assert engine.state is None  # twin of the kept state above
    engine.resume_memory()
    got = engine.generate(_prompts(11), [100 + i for i in range(11)], PARAMS)
    assert all(r.tokens == ref.tokens and same_bits(r.logprobs, ref.logprobs) for r, ref in zip(got, reference))


def _mixed_steps(model, runner_of, budget=6):
    """Steps of a Scheduler (3 slots, `budget` rows: prompt chunks beside decode rows, chunks that end
    their prompt and sample, chunks that do not), each run by the graph runner and then by the eager one
    (both on the same cache: each writes the same keys); yields (step, graph launch, eager launch)."""
    prompts, ids = [[5, 6, 7], [8, 9, 10, 11], [12] * 3 + list(range(20, 33))], [30, 31, 32]
    params = dataclasses.replace(PARAMS, eos_token_id=None, max_new_tokens=6)
    state = KVState(model.args, 12, 4, 3, 6, model.dtype, "cpu")
    sched = Scheduler(prompts, ids, params, state, 3, [len(p) + 6 for p in prompts], budget)
    graphs = EagerGraphs(state.cache, state.block_table, state.rows, state.num_pages * state.page_size)
    graphs.begin(model, params)
    stats = {"steps": 0, "lookahead_steps": 0, "graph_steps": 0, "mixed_graph_steps": 0}
    replay = runner_of(ModelRunner(model, state, sched, ids, params, graphs, stats, graph_rows(3)))
    eager = ModelRunner(model, state, sched, ids, params, None, dict(stats))
    while (step := sched.schedule()).rows:
        g, e = replay.run(step), eager.run(step)
        yield step, g, e
        if e is not None:
            sched.postprocess(step, e.read_tokens())
    assert stats["mixed_graph_steps"] > 1 and stats["graph_steps"] == stats["steps"]


def test_a_mixed_step_run_row_by_row_in_a_graph_has_the_eager_bits(model, monkeypatch):
    """A step with prompt chunks replays a decode graph (EagerGraphs: the graph's computation on CPU):
    every row run as a decode row without the prompt-chunk hint, every row's logits and draw, then the
    sampling rows' draws picked. Their tokens and logprob bits equal the eager step's (the hint, logits
    of the sampling rows only)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    kinds = set()
    for step, g, e in _mixed_steps(model, lambda runner: runner):
        assert (g is None) == (e is None)
        if e is not None:
            assert torch.equal(g.tokens, e.tokens) and same_bits(g.logprobs, e.logprobs)
        n_dec = step.runs[0][0] if step.runs else len(step.rows)
        kinds.add((n_dec > 0, bool(step.runs), len(step.sample_at) - n_dec))
    assert {(True, True, 0), (True, True, 1)} <= kinds  # chunks beside decode rows: sampling none, one


def test_negative_twin_chunk_rows_drawing_with_another_id_change_the_draws(model, monkeypatch):
    """The twin feeds a prompt chunk's rows with sample id 0 instead of their sequence's: the rows that
    end their prompt draw other tokens."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)

    def wrong_ids(runner):
        meta = runner._meta

        def with_id_zero(step, ahead):
            m = meta(step, ahead)
            m[4, step.runs[0][0] if step.runs else len(step.rows):] = 0
            return m

        runner._meta = with_id_zero
        return runner

    differ = [not torch.equal(g.tokens, e.tokens) for step, g, e in _mixed_steps(model, wrong_ids)
              if e is not None and step.runs]
    assert any(differ)


def test_graph_rows_cover_the_decode_bucket_and_bound_the_graphs_of_steps_with_prompt_rows():
    """8 rows a sequence in flight, at most 2,048 (a graph holds every row's logits), never below the decode
    step's own bucket; the twin: a first prefill chunk of max_num_batched_tokens=8192 rows at 1,024 sequences
    runs eagerly, where 8 x bucket alone would have replayed it."""
    assert [graph_rows(n) for n in (1, 3, 24, 256, 1024, 4096)] == [8, 32, 256, 2048, 2048, 4096]
    assert 8192 > graph_rows(1024) and 8192 <= 8 * bucket(1024)
