"""The monitor on episodes (rlalign.sequences.Rollout.turns): the comparison counts policy tokens only,
per turn; the mismatch detail names positions across turns and skips observation tokens; the step's
episode numbers, the samples table's rendering and the report. Each with a negative twin."""

from __future__ import annotations

import json

import torch

from rlalign.config import load_config, model_args
from rlalign.monitor.consistency import logprob_consistency
from rlalign.monitor.divergence import tap_order
from rlalign.monitor.report import make_report, mismatch_figure
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout, render_episode
from rlalign.step import episode_tokens, mismatch_detail, sample_rows, step_metrics
from rlalign.tasks import Example

PROMPT = [3, 4, 5]
TURNS = [0, 0, -1, -1, 1, 1, -1, 2]  # 3 assistant turns, 3 observation tokens


def _pair():
    """An episode and a single-turn rollout; the trainer's logprobs equal the generator's at policy
    tokens and differ at observation tokens (the generator has none there: 0.0; the trainer scores them)."""
    g = torch.tensor([-0.5, -1.0, 0.0, 0.0, -0.25, -2.0, 0.0, -0.75])
    ep = Rollout(7, PROMPT, list(range(10, 18)), g, "eos", params=SamplingParams(), turns=TURNS)
    one = Rollout(8, [5, 4], [9, 2], torch.tensor([-0.1, -0.2]), "eos", params=SamplingParams())
    scored = torch.tensor([-3.0, -3.0, -3.0, -3.0, -3.0, -3.0, -float("inf"), -3.0])
    t = torch.where(torch.tensor(TURNS) >= 0, g, scored)
    return [ep, one], [t, one.logprobs.clone()]


def _flip(x: torch.Tensor, j: int) -> torch.Tensor:
    """x with element j's last bit flipped."""
    y = x.clone()
    y.view(torch.int32)[j] ^= 1
    return y


def test_a_flipped_policy_token_is_counted_in_its_turn_and_observation_tokens_never():
    rollouts, train = _pair()
    gen, turns = [r.logprobs for r in rollouts], [r.turns for r in rollouts]
    same = logprob_consistency(gen, train, turns)
    assert same["tokens"] == 5 + 2 and same["mismatched_tokens"] == 0 and same["logprob_abs_diff_max"] == 0.0
    assert {k: v for k, v in same.items() if k.startswith("turn_")} == {
        "turn_0/tokens": 4, "turn_0/mismatched_tokens": 0, "turn_1/tokens": 2, "turn_1/mismatched_tokens": 0,
        "turn_2/tokens": 1, "turn_2/mismatched_tokens": 0}  # the single-turn rollout counts as turn 0
    c = logprob_consistency(gen, [_flip(train[0], 5), train[1]], turns)  # response token 5: turn 1
    assert c["mismatched_tokens"] == 1 and c["turn_1/mismatched_tokens"] == 1 and c["mismatch_seq_frac"] == 0.5
    assert c["turn_0/mismatched_tokens"] == 0 and c["turn_2/mismatched_tokens"] == 0
    # negative twins: without turns, the observation tokens' differences are counted (one is -inf)
    plain = logprob_consistency(gen, train)
    assert plain["tokens"] == 10 and plain["mismatched_tokens"] == 3 and "turn_0/tokens" not in plain
    assert logprob_consistency(gen, [_flip(train[0], 3), train[1]], turns)["mismatched_tokens"] == 0


def _tables(rollouts, diverge_at: int):
    """Row fingerprints of both sides, every op equal except layers.0.attn at row `diverge_at` of sample 7."""
    cfg = load_config(["model.num_layers=1"])
    taps = tap_order(model_args(cfg))
    gen = {(r.sample_id, p): dict.fromkeys(taps, 1) for r in rollouts for p in range(len(r.prompt) + len(r.tokens))}
    train = {k: dict(v) for k, v in gen.items()}
    train[(7, diverge_at)]["layers.0.attn"] = 2
    return cfg, gen, train


def test_mismatch_detail_places_a_token_across_turns_and_skips_observations():
    """Response token 5 (turn 1, after two observation tokens) is predicted by logits row 3 + 5 - 1 = 7;
    its divergence began at layers.0.attn of row 7; the worst-token table gives its turn. The twin: an
    observation token's difference alone yields no token."""
    rollouts, train = _pair()
    cfg, gt, tt = _tables(rollouts, 7)
    d = mismatch_detail(cfg, [r.prompt for r in rollouts], rollouts, [_flip(train[0], 5), train[1]], gt, tt)
    assert d["tokens"] == [{"sample_id": 7, "position": 7, "first_op": "layers.0.attn", "at_position": 7}]
    assert [(w["position"], w["token"], w["turn"]) for w in d["worst_tokens"]] == [(8, 15, 1)]
    obs = mismatch_detail(cfg, [r.prompt for r in rollouts], rollouts, train, gt, tt)
    assert obs["tokens"] == [] and obs["worst_tokens"] == []


def test_step_metrics_add_episode_tokens_only_for_episodes():
    rollouts, train = _pair()
    cfg = load_config([])
    cons = logprob_consistency([r.logprobs for r in rollouts], train, [r.turns for r in rollouts])
    m = step_metrics(cfg, [1.0, 0.0], rollouts, cons, {})
    assert m["episode/policy_tokens"] == 7 and m["episode/observation_tokens"] == 3
    assert m["consistency/turn_2/tokens"] == 1 and m["response/tokens"] == 10
    assert m["response/entropy"] == float(torch.tensor([0.5, 1.0, 0.25, 2.0, 0.75, 0.1, 0.2]).double().mean())
    single = step_metrics(cfg, [0.0], rollouts[1:], logprob_consistency([rollouts[1].logprobs], [train[1]]), {})
    assert episode_tokens(rollouts[1:]) == {} and not any(k.startswith("episode/") for k in single)


def test_clip_and_eos_fractions_count_an_episodes_assistant_turns():
    """An episode ends for its own reasons (done, turns, ...): response/clip_frac and eos_frac count how its
    turns ended, and episode/turn_stop_frac those at a stop string. The twin: without its turns' ends the
    episode counts as one response that ended neither way."""
    from rlalign.agent.driver import Episode
    from rlalign.agent.metrics import episode_metrics

    rollouts, train = _pair()
    ep = Episode(7, Example("p", "a"), None, len(PROMPT), turn=3, turn_ends=["length", "stop", "eos"])
    rollouts[0].finish_reason, rollouts[0].episode = "done", ep.summary()
    cons = logprob_consistency([r.logprobs for r in rollouts], train, [r.turns for r in rollouts])
    m = step_metrics(load_config([]), [1.0, 0.0], rollouts, cons, {})
    assert (m["response/clip_frac"], m["response/eos_frac"]) == (1 / 4, 2 / 4)  # 3 turns + the single-turn one
    assert episode_metrics(rollouts[:1])["episode/turn_stop_frac"] == 1 / 3
    rollouts[0].episode = None
    m = step_metrics(load_config([]), [1.0, 0.0], rollouts, cons, {})
    assert (m["response/clip_frac"], m["response/eos_frac"]) == (0.0, 1 / 2)


class _Tok:
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_the_samples_table_shows_an_episodes_turns_and_observations():
    rollouts, _ = _pair()
    text = render_episode(_Tok(), rollouts[0].tokens, TURNS)
    assert text == "[assistant 0] kl\n[observation] mn\n[assistant 1] op\n[observation] q\n[assistant 2] r"
    assert render_episode(_Tok(), [9, 2], None) == "jc"  # single turn: the plain text
    ex = [Example("p", 1), Example("q", 2)]
    rows = sample_rows(_Tok(), ex, rollouts, ["plain", "jc"], [1.0, 0.0])
    assert rows[0]["completion"] == text and rows[1]["completion"] == "jc"


def test_the_report_draws_and_lists_mismatch_per_turn(tmp_path):
    rows = [{"step": s, "reward/mean": 0.5, "consistency/tokens": 7, "consistency/mismatched_tokens": s,
             "consistency/logprob_abs_diff_max": 1e-7 * s, "time/step_s": 0.5,
             "consistency/abs_diff_hist": [7 - s, 0, s, 0, 0, 0, 0, 0, 0], "episode/policy_tokens": 7,
             "episode/observation_tokens": 3, "consistency/turn_0/tokens": 4, "consistency/turn_0/mismatched_tokens": 0,
             "consistency/turn_1/tokens": 3, "consistency/turn_1/mismatched_tokens": s} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = (make_report(tmp_path) / "summary.md").read_text()
    assert "| mismatched policy tokens by turn | turn 0: 0 of 12, turn 1: 3 of 9 |" in summary
    assert "| episode tokens, policy / observation | 21 / 9 |" in summary
    labels = [ln.get_label() for ax in mismatch_figure(rows).axes for ln in ax.lines]
    assert "turn 0 (left axis)" in labels and "turn 1 (left axis)" in labels
    single = [{k: v for k, v in r.items() if "turn" not in k and "episode" not in k} for r in rows]
    assert not any("turn" in lb for ax in mismatch_figure(single).axes for lb in [ln.get_label() for ln in ax.lines])


def _gate_run(run, env: str | None, step_rows: int, tokens: list[int], **metrics: float) -> None:
    """A run dir of one step: its metrics and a generator trace of an engine step's op record over
    `step_rows` rows, then the step's tokens."""
    from rlalign.monitor.trace import Trace

    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5, **metrics}) + "\n")
    tr = Trace(run / "traces" / "generator-rank0.jsonl", "generator", 0, {"seed": 0, "task": {"env": env}})
    tr.step = 0
    tr.record("gen.step.embed", torch.arange(step_rows * 2, dtype=torch.float32).view(step_rows, 2))
    tr.record("gen.tokens", torch.tensor(tokens))
    tr.close()


def test_gates_leave_a_multiturn_runs_per_step_generator_records_out_and_compare_its_tokens(tmp_path):
    """An engine step's rows depend on when the environments answer: two multi-turn runs whose steps
    grouped rows differently pass; their tokens are compared (twin), and a single-turn run's per-step
    records are (twin)."""
    from rlalign.gates import compare_runs

    def compare(env, rows_b, tokens_b, name):
        _gate_run(tmp_path / f"{name}a", env, 3, [5, 6])
        _gate_run(tmp_path / f"{name}b", env, rows_b, tokens_b)
        return compare_runs(tmp_path / f"{name}a", tmp_path / f"{name}b")

    res = compare("guess", 2, [5, 6], "same")
    assert res.ok and any("gen.step.*: not compared" in ln for ln in res.lines)
    res = compare("guess", 2, [5, 7], "tokens")
    assert not res.ok and res.first_op == "gen.tokens"
    res = compare(None, 2, [5, 6], "single")
    assert not res.ok and res.first_op == "gen.step.embed"


def test_gates_compare_what_a_run_computed_not_its_seconds_or_bytes(tmp_path):
    """A resumed process allocates otherwise: runs that differ in time/* and memory/* (CUDA peaks) pass;
    twin: a metric of what the run computed differs and fails, named."""
    from rlalign.gates import compare_runs

    _gate_run(tmp_path / "a", None, 2, [5, 6], **{"time/step_s": 1.0, "memory/trainer_peak_gib": 30.5,
                                                   "loss/policy": 0.25})
    _gate_run(tmp_path / "b", None, 2, [5, 6], **{"time/step_s": 1.5, "memory/trainer_peak_gib": 31.0,
                                                   "loss/policy": 0.25})
    assert compare_runs(tmp_path / "a", tmp_path / "b").ok
    _gate_run(tmp_path / "c", None, 2, [5, 6], **{"time/step_s": 1.0, "memory/trainer_peak_gib": 30.5,
                                                   "loss/policy": 0.5})
    res = compare_runs(tmp_path / "a", tmp_path / "c")
    assert not res.ok and "differs first in 'loss/policy'" in res.lines[0], res.lines
