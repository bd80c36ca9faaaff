"""GPU: steps where multi-turn episodes' observations (and admitted prompts) are prefilled beside decode
rows replay the decode graphs (every row run as a decode row, only the sampling rows' draws kept):
episodes of 3 and 4 turns with answers arriving over several steps give the tokens and logprob bits of
the same generate with CUDA graphs off, equal to the trainer's rescoring, with such steps counted as
replays (NativeEngine.stats). A call whose first step replays keeps its graphs for the next call."""

import dataclasses

import pytest
import torch
from engine_model import ARGS, PARAMS, engine_model, engine_prompts, same_rollouts

from rlalign import kernels
from rlalign.model import ModelArgs, build_model
from rlalign.rollout.native.engine import NativeEngine
from rlalign.rollout.types import EngineConfig
from rlalign.training.scoring import score

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PER_TURN = dataclasses.replace(PARAMS, max_new_tokens=12)
N = 24


def obs_of(b: int, k: int) -> list[int]:
    """Episode b's observation after its turn k: 3 to 40 tokens."""
    return [(97 * b + 31 * k + j) % 4000 + 2 for j in range(3 + (7 * b + 5 * k) % 38)]


class Staggered:
    """Continuations: episode b runs 3 + b % 2 turns, each ended by length or EOS; after its turn k it
    observes obs_of(b, k), ready 1 + b % 5 polls after the turn ended (poll(wait=True): the next due)."""

    def __init__(self, prompts: list[list[int]]):
        self.max_lens = [len(p) + 4 * (PER_TURN.max_new_tokens + 41) for p in prompts]
        self.turns, self.due, self.polls = [0] * len(prompts), [], 0

    def max_len(self, b):
        return self.max_lens[b]

    def stopped(self, b, turn):
        return False

    def ended(self, b, turn, reason):
        self.turns[b] += 1
        self.due.append((self.polls + 1 + b % 5, b))

    def poll(self, wait):
        self.polls += 1
        ready = [d for d in self.due if d[0] <= self.polls] or (sorted(self.due)[:1] if wait else [])
        for d in ready:
            self.due.remove(d)
        return [(b, None if self.turns[b] >= 3 + b % 2 else obs_of(b, self.turns[b] - 1)) for _, b in ready]

    def pending(self):
        return len(self.due)


@pytest.fixture(scope="module")
def model():
    return engine_model()


def _episodes(model, config: EngineConfig):
    prompts = engine_prompts(N)
    with kernels.use(mode="deterministic", backend="triton"):
        engine = NativeEngine(model, config)
        out = engine.generate(prompts, list(range(N)), PER_TURN, episodes=Staggered(prompts))
    return out, engine.stats


@pytest.fixture(scope="module")
def eager(model):
    return _episodes(model, EngineConfig(cuda_graphs=False))


@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(max_num_seqs=8, max_num_batched_tokens=64),
                                    EngineConfig(lookahead=False)], ids=["all-at-once", "chunked", "no-lookahead"])
def test_steps_with_observations_replay_graphs_with_the_eager_bits(model, eager, config):
    ref, ref_stats = eager
    got, stats = _episodes(model, config)
    assert ref_stats["graph_steps"] == 0 and max(max(r.turns) for r in ref) >= 2  # episodes of 3 turns or more
    assert [r.turns for r in got] == [r.turns for r in ref] and same_rollouts(got, ref)
    assert stats["mixed_graph_steps"] > 0, stats
    if config.max_num_batched_tokens == 64:  # every step within graph_rows(8) = 64 rows: prompt chunks replay too
        assert stats["graph_steps"] == stats["steps"], stats
    else:  # the first step prefills 24 prompts (2,079 rows, over graph_rows(24) = 256): eager
        assert stats["steps"] > stats["graph_steps"] > stats["mixed_graph_steps"], stats


def test_replayed_episodes_equal_the_trainers_rescoring(model):
    got, _ = _episodes(model, EngineConfig())
    with kernels.use(mode="deterministic", backend="triton"):
        lps = score(model, [r.prompt for r in got], [r.tokens for r in got], PER_TURN, micro_batch_size=8)
    for r, lp in zip(got, lps):
        policy = torch.tensor(r.turns) >= 0
        assert torch.equal(lp.float().cpu()[policy].view(torch.int32), r.logprobs[policy].view(torch.int32))


def test_a_call_whose_first_step_replays_keeps_its_graphs_twin_a_host_rope_table_recaptures():
    """A model moved to CUDA after it was built keeps its rope table on the host until a step reads it;
    a call whose first step (8 short prompts) replays a graph moves it first, so the graphs it captures
    are valid in the next call. Twin: the table put back on the host moves again, to another address
    (the old device table is held, so the allocator cannot hand its block back): captured again."""
    model = build_model(ModelArgs(**ARGS), "bfloat16", seed=0).cuda()
    prompts, ids = [[3 + i] * (1 + i % 5) for i in range(8)], list(range(8))
    with kernels.use(mode="deterministic", backend="triton"):
        engine = NativeEngine(model)
        first = engine.generate(prompts, ids, PARAMS)
        g, n = engine.state.graphs, engine.state.graphs.captures
        assert engine.stats["graph_steps"] == engine.stats["steps"] and n > 0
        again = engine.generate(prompts, ids, PARAMS)
        assert g.captures == n and same_rollouts(first, again)
        held = model._rope_table
        model._rope_table = tuple(t.cpu() for t in held)
        moved = engine.generate(prompts, ids, PARAMS)
        assert g.captures > n and model._rope_table[0].data_ptr() != held[0].data_ptr()
        assert same_rollouts(first, moved)
