"""The native engine continues multi-turn episodes (Continuations) without recomputing their prefix: a
paused episode keeps its KV pages, its observation is prefilled onto the same sequence, and every
continued turn samples the tokens, with the logprob bits, of a fresh generate over the whole history,
equal to the trainer's rescoring of the whole episode, whatever the schedule, the order the answers
come in, or the expert-parallel size."""

import dataclasses

import numpy
import pytest
import torch
from conftest import TINY, same_bits, tiny_model
from eager_graphs import use_eager_graphs

from rlalign.parallel import launch
from rlalign.rollout.native import graphs as native_graphs
from rlalign.rollout.native.engine import NativeEngine, generate
from rlalign.rollout.native.episodes import EpisodeScheduler
from rlalign.rollout.native.runner import ModelRunner
from rlalign.rollout.types import EngineConfig
from rlalign.sampling_params import SamplingParams
from rlalign.training.scoring import score_micro_batch

PARAMS = SamplingParams(max_new_tokens=6, eos_token_id=1, seed=3, temperature=0.9, top_k=30)  # per turn
STOP = (7,)  # a turn whose last token is 7 stops (a tool call's closing tag)
IDS = [40 + i for i in range(8)]


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def obs_of(b: int, k: int) -> list[int]:
    """Episode b's observation after its turn k (1 to 3 tokens)."""
    return [(11 * b + 5 * k + j) % 60 + 2 for j in range(1 + (b + k) % 3)]


class Script:
    """Continuations of a test: episode b answers its turns with obs_of(b, k) until it has run turns[b]
    turns, then None. An answer is ready `delay * (1 + b % 3)` polls after its turn ended; `reverse`:
    the ready ones come last-ended first. poll(wait=True) with nothing ready returns the next one due."""

    def __init__(self, turns: list[int], max_lens: list[int], delay: int = 0, reverse: bool = False,
                 obs=obs_of):
        self.n_turns, self.max_lens, self.delay, self.reverse, self.obs = turns, max_lens, delay, reverse, obs
        self.ended_turns: list[list[tuple[list[int], str]]] = [[] for _ in turns]
        self.handed: list[tuple[int, int]] = []  # (b, the poll at which its answer is ready)
        self.polls = 0
        self.waits = 0

    def max_len(self, b):
        return self.max_lens[b]

    def stopped(self, b, turn):
        return tuple(turn[-len(STOP):]) == STOP

    def ended(self, b, turn, reason):
        self.ended_turns[b].append((list(turn), reason))
        self.handed.append((b, self.polls + self.delay * (1 + b % 3)))

    def poll(self, wait):
        self.polls += 1
        self.waits += wait
        ready = [h for h in self.handed if h[1] <= self.polls]
        if wait and not ready and self.handed:
            ready = [min(self.handed, key=lambda h: h[1])]
        for h in ready:
            self.handed.remove(h)
        if self.reverse:
            ready.reverse()
        return [(b, self.answer(b)) for b, _ in ready]

    def answer(self, b):
        k = len(self.ended_turns[b])
        return None if k >= self.n_turns[b] else self.obs(b, k - 1)

    def pending(self):
        return len(self.handed)


TURNS = [3, 4, 3, 1, 5]


def _run(model, engine=None, turns=TURNS, prompts=None, **script):
    prompts = prompts or _prompts(len(turns))
    max_lens = [len(p) + 12 * t for p, t in zip(prompts, turns)]
    s = Script(turns, max_lens, **script)
    out = NativeEngine(model, engine).generate(prompts, IDS[:len(turns)], PARAMS, episodes=s)
    return out, s


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def episodes(model):
    return _run(model)


def _turn_starts(turns: list[int]) -> list[int]:
    """Where each assistant turn begins in an episode's tokens."""
    return [i for i, k in enumerate(turns) if k >= 0 and (i == 0 or turns[i - 1] != k)]


def test_a_continued_episode_equals_fresh_prefills_of_its_history_and_the_trainer(model, episodes):
    out, script = episodes
    assert [len(e) for e in script.ended_turns] == TURNS
    assert {r for e in script.ended_turns for _, r in e} == {"eos", "stop", "length"}
    starts = [_turn_starts(o.turns) for o in out]
    assert [len(s) for s in starts] == TURNS
    for k in range(max(TURNS)):  # turn k of every episode: a fresh generate over the whole history so far
        bs = [b for b in range(len(out)) if k < TURNS[b]]
        fresh = generate(model, [out[b].prompt + out[b].tokens[:starts[b][k]] for b in bs],
                         [out[b].sample_id for b in bs], PARAMS)
        for b, f in zip(bs, fresh):
            o, i, (turn, _) = out[b], starts[b][k], script.ended_turns[b][k]
            assert o.tokens[i:i + len(turn)] == turn and o.turns[i:i + len(turn)] == [k] * len(turn)
            assert f.tokens[:len(turn)] == turn, (b, k)
            assert same_bits(f.logprobs[:len(turn)], o.logprobs[i:i + len(turn)]), (b, k)
            if k + 1 < TURNS[b]:
                obs, j = obs_of(b, k), i + len(turn)
                assert o.tokens[j:j + len(obs)] == obs and o.turns[j:j + len(obs)] == [-1] * len(obs)
    rescored = score_micro_batch(model, [o.prompt for o in out], [o.tokens for o in out], PARAMS)
    for o, lp in zip(out, rescored):  # the trainer's one packed sequence per episode
        policy = torch.tensor(o.turns) >= 0
        assert len(o.turns) == len(o.tokens) == len(o.logprobs)
        assert same_bits(lp.float()[policy], o.logprobs[policy]), o.sample_id
        assert same_bits(o.logprobs[~policy], torch.zeros(int((~policy).sum())))


def test_negative_twin_an_observation_left_out_of_the_cache_changes_the_bits(model, episodes, monkeypatch):
    """The twin skips the observation's prefill (its keys and values never written, only the row that
    samples runs): the later turns' bits no longer equal the fresh prefill's."""
    real = EpisodeScheduler._continue

    def skip_prefill(sched, seq, obs):
        real(sched, seq, obs)
        seq.n_cached = seq.n_prefill - 1

    monkeypatch.setattr(EpisodeScheduler, "_continue", skip_prefill)
    twin, _ = _run(model)
    ref, _ = episodes
    first = [_turn_starts(o.turns)[1] if len(_turn_starts(o.turns)) > 1 else len(o.tokens) for o in ref]
    assert all(t.tokens[:i] == r.tokens[:i] and same_bits(t.logprobs[:i], r.logprobs[:i])
               for t, r, i in zip(twin, ref, first))  # the first turns are untouched
    assert any(t.tokens != r.tokens or not same_bits(t.logprobs, r.logprobs) for t, r in zip(twin, ref))


def test_negative_twin_an_answer_applied_under_a_lookahead_row_takes_its_token(model, episodes, monkeypatch):
    """The step enqueued ahead (lookahead) holds a row of a sequence whose turn the step before ended with
    a stop or EOS; resume holds that sequence's answer until the row is read back and discarded. The twin
    applies it at once: the stale row's token is taken as the continued turn's first."""
    real = EpisodeScheduler.resume
    monkeypatch.setattr(EpisodeScheduler, "resume", lambda sched, answers, in_flight: real(sched, answers, False))
    twin, _ = _run(model)
    ref, _ = episodes
    assert any(t.tokens != r.tokens for t, r in zip(twin, ref))


SCHEDULES = [
    EngineConfig(max_num_seqs=1, page_size=1),  # one episode at a time
    EngineConfig(max_num_seqs=3, max_num_batched_tokens=4, page_size=4),  # observations chunked beside decode rows
    EngineConfig(max_num_seqs=2, max_num_batched_tokens=3, page_size=8, lookahead=False),
]


@pytest.mark.parametrize("engine,delay,reverse", [(SCHEDULES[0], 0, False), (SCHEDULES[1], 2, True),
                                                  (SCHEDULES[2], 1, True), (EngineConfig(), 3, False)],
                         ids=["one-at-a-time", "chunked-delayed-reversed", "no-lookahead", "all-delayed"])
def test_every_schedule_and_answer_order_gives_the_same_bits(model, episodes, engine, delay, reverse):
    got, script = _run(model, engine, delay=delay, reverse=reverse)
    ref, _ = episodes
    for g, r in zip(got, ref):
        assert g.tokens == r.tokens and g.turns == r.turns and g.finish_reason == r.finish_reason
        assert same_bits(g.logprobs, r.logprobs), g.sample_id
    assert script.pending() == 0 and (delay == 0 or script.waits > 0)


def _graph_run(model, engine, **script):
    """_run on an engine whose steps replay graphs (after use_eager_graphs); (rollouts, the engine's stats)."""
    prompts = _prompts(len(TURNS))
    s = Script(TURNS, [len(p) + 12 * t for p, t in zip(prompts, TURNS)], **script)
    eng = NativeEngine(model, engine)
    out = eng.generate(prompts, IDS[:len(TURNS)], PARAMS, episodes=s)
    return out, eng.stats


@pytest.mark.parametrize("engine,per_seq,delay", [(EngineConfig(), 8, 2), (EngineConfig(), 1, 3),
                                                  (SCHEDULES[1], 8, 1), (SCHEDULES[2], 2, 2)],
                         ids=["all-at-once", "all-at-once-small-cap", "chunked", "chunked-no-lookahead"])
def test_steps_with_observations_replay_graphs_with_the_eager_bits(model, episodes, monkeypatch, engine, per_seq,
                                                                   delay):
    """Observations prefilled beside decode rows, in steps of up to per_seq x bucket(max_seqs) rows, replay
    the decode graphs (EagerGraphs: their computation on CPU); larger steps run eagerly. The same tokens and
    bits as the eager engine."""
    monkeypatch.setattr(native_graphs, "MIXED_ROWS_PER_SEQ", per_seq)
    use_eager_graphs(monkeypatch)
    got, stats = _graph_run(model, engine, delay=delay, reverse=True)
    ref, _ = episodes
    for g, r in zip(got, ref):
        assert g.tokens == r.tokens and g.turns == r.turns and same_bits(g.logprobs, r.logprobs), g.sample_id
    assert stats["mixed_graph_steps"] > 0 and stats["graph_steps"] > stats["mixed_graph_steps"], stats
    assert (stats["steps"] > stats["graph_steps"]) == (per_seq == 1), stats  # the small cap: the prefill eager


def test_negative_twin_observation_tokens_lost_in_replayed_steps_change_the_bits(model, episodes, monkeypatch):
    """The twin feeds a replayed step's prompt-chunk rows token 0 (eager steps untouched): their keys and
    values are wrong, and the turns after them sample other tokens or bits."""
    monkeypatch.setattr(native_graphs, "MIXED_ROWS_PER_SEQ", 8)
    use_eager_graphs(monkeypatch)
    replay = ModelRunner._replay

    def tokens_lost(runner, step, meta, *a):
        meta = meta.clone()
        meta[0, step.runs[0][0] if step.runs else len(step.rows):] = 0
        return replay(runner, step, meta, *a)

    monkeypatch.setattr(ModelRunner, "_replay", tokens_lost)
    got, stats = _graph_run(model, SCHEDULES[1], delay=1)
    ref, _ = episodes
    assert stats["steps"] == stats["graph_steps"]
    assert any(g.tokens != r.tokens or not same_bits(g.logprobs, r.logprobs) for g, r in zip(got, ref))


def test_a_stop_that_never_appears_ends_each_turn_at_its_limit(model):
    """No stop, no EOS: every turn ends at max_new_tokens ("length"), and a turn that reaches the
    episode's max_len ends there (3 + 6 + 1 + 6 + 2 tokens, then 3 of the 6 that max_len=21 leaves)."""
    s = Script([3, 3], [21, 40])
    s.stopped = lambda b, turn: False
    params = dataclasses.replace(PARAMS, eos_token_id=None)
    out = NativeEngine(model).generate([[3, 4, 5], [6, 8]], [1, 2], params, episodes=s)
    assert [[(len(t), r) for t, r in e] for e in s.ended_turns] == [[(6, "length"), (6, "length"), (3, "length")],
                                                                     [(6, "length")] * 3]
    assert len(out[0].prompt) + len(out[0].tokens) == 21 and out[0].finish_reason == "length"


def test_bad_answers_are_refused_naming_the_sample(model):
    prompts = [[3, 4, 5]]
    with pytest.raises(ValueError, match=r"sample 9: an observation of 30 tokens after turn 0 makes the episode "
                                         r"\d+ tokens long, leaving no room to sample within its max_len=20"):
        NativeEngine(model).generate(prompts, [9], PARAMS, episodes=Script([2], [20], obs=lambda b, k: [2] * 30))
    with pytest.raises(ValueError, match=r"sample 9: observation token 64 after turn 0 is not a token id in \[0, 64\)"):
        NativeEngine(model).generate(prompts, [9], PARAMS, episodes=Script([2], [40], obs=lambda b, k: [5, 64]))
    with pytest.raises(ValueError, match=r"sample 9: observation token 5.0 after turn 0 is not a token id"):
        NativeEngine(model).generate(prompts, [9], PARAMS, episodes=Script([2], [40], obs=lambda b, k: [5.0]))
    np_obs = NativeEngine(model).generate(prompts, [9], PARAMS, episodes=Script([2], [40], obs=lambda b, k: [
        numpy.int64(5), numpy.int32(6)]))  # twin: numpy ints are the token ids they hold
    assert np_obs[0].tokens == NativeEngine(model).generate(prompts, [9], PARAMS, episodes=Script(
        [2], [40], obs=lambda b, k: [5, 6]))[0].tokens
    with pytest.raises(ValueError, match=r"sample 9: Continuations.max_len=3 must be an int above its prompt's 3"):
        NativeEngine(model).generate(prompts, [9], PARAMS, episodes=Script([2], [3]))
    with pytest.raises(ValueError, match=r"sample 9: prompt of 3 tokens \+ the rest of its episode \(max_len=20\) "
                                         r"needs 5 KV pages of 4 tokens; the cache has 2"):
        NativeEngine(model, EngineConfig(page_size=4, num_pages=2)).generate(prompts, [9], PARAMS,
                                                                             episodes=Script([2], [20]))
    never = Script([2], [40])
    never.poll = lambda wait: []
    never.pending = lambda: 0
    with pytest.raises(RuntimeError, match="sample 9: its turn ended .* but poll never answered it"):
        NativeEngine(model).generate(prompts, [9], PARAMS, episodes=never)


def test_vllm_refuses_episodes():
    from rlalign.rollout.vllm.engine import VllmRankGenerator

    fake = VllmRankGenerator.__new__(VllmRankGenerator)
    with pytest.raises(ValueError, match="vLLM backend does not run multi-turn episodes; use generator.backend=native"):
        fake.generate([[3]], [0], PARAMS, episodes=Script([1], [9]))


def _ep_rank(rank, world, group, turns, prompts):
    """This rank's share of the episodes on a NativeEngine over its expert shard (world 1: all of them)."""
    from rlalign import kernels
    from rlalign.model import ModelArgs, build_model
    from rlalign.parallel.ep import apply_ep
    from rlalign.parallel.launch import Lockstep

    with kernels.use(mode="deterministic", backend="torch"):
        model = build_model(ModelArgs(**TINY), "bfloat16", seed=0)
        if group is not None:
            apply_ep(model, group)
        engine = NativeEngine(model, lockstep=Lockstep(group) if group is not None else None)
        part = list(launch.shard_range(len(prompts), world, rank))
        ps = [prompts[i] for i in part]
        s = Script([turns[i] for i in part], [len(p) + 12 * turns[i] for p, i in zip(ps, part)], delay=rank + 1,
                   obs=lambda b, k: obs_of(part[b], k))  # the observations of the episode's index in the batch
        return engine.generate(ps, [IDS[i] for i in part], PARAMS, episodes=s), s.waits


@pytest.mark.slow
def test_generator_ep2_runs_episodes_of_other_turn_counts_with_the_bits_of_ep1():
    """Rank 0's episodes run 1 turn, rank 1's 3 to 5: rank 0 steps empty steps (and polls) until
    rank 1's last episode is over, both wait for answers with no rows to run; the loop ends on both."""
    turns = [1, 1, 1, 5, 3, 4]
    prompts = _prompts(len(turns), seed=2)
    one, _ = _ep_rank(0, 1, None, turns, prompts)
    ranks = launch.run_workers(2, _ep_rank, (turns, prompts), timeout_s=120)
    two = [r for part, _ in ranks for r in part]
    assert [len(_turn_starts(r.turns)) for r in two] == turns
    assert all(waits > 0 for _, waits in ranks)  # blocked in poll(wait=True) when no rank had rows
    for a, b in zip(one, two):
        assert a.tokens == b.tokens and a.turns == b.turns and same_bits(a.logprobs, b.logprobs), a.sample_id
