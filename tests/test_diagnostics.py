"""RL diagnostics on crafted inputs: KL(old || current) and clip sides from the PPO loss, the GRPO
dead-signal rate and its warning, agree's exit status, the run summary's reward gain."""

import json

import torch

from rlalign.config import load_config
from rlalign.training.losses import LossBatch, grpo_advantages, gspo_loss, ppo_clip_loss

ALG = load_config([]).algorithm


def _stats(logprobs, old, adv, loss=ppo_clip_loss, lengths=None):
    lp, o = torch.tensor(logprobs), torch.tensor(old)
    batch = LossBatch(lp, o, o, torch.tensor(adv), lengths or [1] * len(lp), minibatch_tokens=len(lp),
                      minibatch_sequences=len(lengths or lp))
    st = loss(batch, ALG)[1]
    return {k.removesuffix("_sum").removeprefix("kl/old_new_"): v for k, v in st.items()}


def test_kl_old_new_is_zero_when_the_policy_did_not_change_and_positive_when_it_did():
    old = [-1.0, -2.0, -0.5, -3.0]
    st = _stats(old, old, [1.0, -1.0, 1.0, -1.0])
    assert st["k1"].item() == 0.0 and st["k3"].item() == 0.0
    assert st["clip_high_frac"].item() == 0.0 and st["clip_low_frac"].item() == 0.0
    # twin: the current policy moved (ratios e^0.5, e^-0.5, e^0.1, e^-0.7)
    new = [-0.5, -2.5, -0.4, -3.7]
    st = _stats(new, old, [1.0, -1.0, 1.0, -1.0])
    lr = torch.tensor(new) - torch.tensor(old)
    assert torch.isclose(st["k1"], -lr.sum())
    assert torch.isclose(st["k3"], (lr.exp() - 1 - lr).sum()) and st["k3"] > 0
    # A > 0 and ratio e^0.5 > 1.2: clipped high; A < 0 and ratios e^-0.5, e^-0.7 < 0.8: clipped low
    assert st["clip_high_frac"].item() == 1.0 and st["clip_low_frac"].item() == 2.0


def test_the_clip_sides_count_only_where_the_clip_removes_the_gradient():
    # ratio > 1 + eps with A < 0 and ratio < 1 - eps with A > 0 are not clipped by PPO
    st = _stats([0.0, -2.0], [-1.0, -1.0], [-1.0, 1.0])
    assert st["clip_high_frac"].item() == 0.0 and st["clip_low_frac"].item() == 0.0


def test_gspo_logs_the_same_kl_per_token_and_counts_a_clipped_sequence_by_its_tokens():
    old, new = [-1.0, -1.0, -2.0], [-0.5, -0.5, -2.0]  # sequence 0 (2 tokens) moved up by e^0.5
    st = _stats(new, old, [1.0, 1.0, 1.0], gspo_loss, [2, 1])
    lr = torch.tensor(new) - torch.tensor(old)
    assert torch.isclose(st["k1"], -lr.sum()) and torch.isclose(st["k3"], (lr.exp() - 1 - lr).sum())
    assert st["clip_high_frac"].item() == 2.0 and st["clip_low_frac"].item() == 0.0
    st = _stats(old, old, [1.0, 1.0, 1.0], gspo_loss, [2, 1])  # twin: nothing moved
    assert st["k1"].item() == st["k3"].item() == st["clip_high_frac"].item() == 0.0


def test_zero_std_group_fraction_is_one_when_every_group_is_alike_and_warns(capsys):
    from rlalign.step import signal_metrics, warn_dead_signal

    rewards = [1.0] * 8
    m = signal_metrics(rewards, grpo_advantages(rewards, 4), 4)
    assert m["reward/zero_std_group_frac"] == 1.0 and m["reward/std"] == 0.0
    assert m["advantage/mean"] == 0.0 and m["advantage/std"] == 0.0
    warn_dead_signal(rewards, 3, 4)
    err = capsys.readouterr().err
    assert "warning: step 3: all 8 rewards are 1" in err and err.count("\n") == 1
    # each group alike, the groups apart: the rewards differ, yet every advantage is 0
    rewards = [0.0] * 4 + [0.5] * 4
    m = signal_metrics(rewards, grpo_advantages(rewards, 4), 4)
    assert m["reward/zero_std_group_frac"] == 1.0 and m["reward/std"] > 0 and m["advantage/std"] == 0.0
    warn_dead_signal(rewards, 5, 4)
    err = capsys.readouterr().err
    assert "warning: step 5: the samples of each of the 2 prompts got equal rewards (0 to 0.5" in err
    assert err.count("\n") == 1
    # twin: one group varies, the other does not; no warning
    rewards = [0.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    m = signal_metrics(rewards, grpo_advantages(rewards, 4), 4)
    assert m["reward/zero_std_group_frac"] == 0.5 and m["reward/std"] > 0 and m["advantage/std"] > 0
    warn_dead_signal(rewards, 4, 4)
    assert capsys.readouterr().err == ""


def test_agree_exits_1_on_a_deterministic_mismatch_and_0_otherwise(monkeypatch, capsys):
    from rlalign import agree

    result = {"kernels": "deterministic", "mismatched_tokens": 608, "tokens": 3000}
    monkeypatch.setattr(agree, "run_agree", lambda cfg, phases=None: (result, []))
    monkeypatch.setattr(agree, "print_report", lambda r: None)
    assert agree.main(None) == 1
    result["mismatched_tokens"] = 0  # twin: no mismatch
    assert agree.main(None) == 0
    result.update(kernels="default", mismatched_tokens=608)  # the vendor path: a mismatch is the finding
    assert agree.main(None) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mismatched_tokens"] == 608


def test_reward_gain_of_a_short_run_compares_its_first_and_last_quarter(tmp_path):
    from rlalign.rl import summarize

    rows = [{"reward/mean": r, "consistency/mismatched_tokens": 0, "consistency/tokens": 1, "time/step_s": 1.0}
            for r in (0.0, 0.1, 0.2, 0.3, 0.4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = summarize(tmp_path, 5, 0, {})
    assert out["reward_gain_k"] == 1 and out["reward_gain"] == 0.4
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")  # twin: one step, no gain
    out = summarize(tmp_path, 1, 0, {})
    assert out["reward_gain_k"] == 1 and out["reward_gain"] == 0.0


def test_entropy_is_log_v_for_uniform_logits_and_lower_for_a_peaked_row():
    from rlalign.training.scoring import entropy_sum

    V = 50
    logits = torch.zeros(3, V)
    rows = torch.tensor([0, 2])
    log_v = torch.log(torch.tensor(float(V)))
    assert torch.isclose(entropy_sum(logits, rows, 1.0, chunk=1), 2 * log_v)
    logits[2, 7] = 20.0  # twin: one row all but certain
    h = entropy_sum(logits, rows, 1.0)
    assert log_v < h < 1.01 * log_v
    assert entropy_sum(logits, rows, 0.5) < h  # a lower temperature sharpens it


def test_reading_the_entropy_leaves_the_logprobs_bits_unchanged():
    from conftest import same_bits, tiny_model

    from rlalign.sampling_params import SamplingParams
    from rlalign.training.scoring import score_micro_batch

    model = tiny_model()
    prompts, responses = [[2, 3, 4], [5, 6]], [[7, 8], [9, 10, 11]]
    ent: list[torch.Tensor] = []
    with torch.no_grad():
        a = score_micro_batch(model, prompts, responses, SamplingParams())
        b = score_micro_batch(model, prompts, responses, SamplingParams(), entropy=ent)
    assert all(same_bits(x, y) for x, y in zip(a, b))
    assert len(ent) == 1 and 0 < ent[0].item() <= 5 * torch.log(torch.tensor(float(model.args.vocab_size)))


def test_wandb_histogram_counts_identical_tokens_apart_from_the_differing_ones():
    import pytest

    pytest.importorskip("wandb")
    from rlalign.logger import wandb_media

    hist = [997, 0, 2, 0, 0, 0, 0, 0, 1]  # identical, then (0, 1e-7], (1e-7, 1e-6], ..., > 0.1
    out = wandb_media({"consistency/abs_diff_hist": hist}, None)
    h = out["consistency/abs_diff_hist"]
    assert out["consistency/identical_tokens"] == 997
    assert list(h.histogram) == [0, 2, 0, 0, 0, 0, 0, 1] and list(h.bins) == list(range(-8, 1))
    # twin: a step with no differing token draws an empty histogram, every token counted identical
    out = wandb_media({"consistency/abs_diff_hist": [5, 0, 0, 0, 0, 0, 0, 0, 0]}, None)
    assert out["consistency/identical_tokens"] == 5 and sum(out["consistency/abs_diff_hist"].histogram) == 0


def test_worst_tokens_table_shows_the_text_when_a_tokenizer_gave_it():
    from rlalign.monitor.report import _worst_tokens

    w = {"sample_id": 3, "position": 5, "token": 40, "generator": -1.0, "trainer": -1.5, "abs_diff": 0.5}
    with_text = _worst_tokens([{"step": 0, "worst_tokens": [{**w, "text": "a|b\n"}]}])
    assert "| 0 | 3 | 5 | 40 | `a\\|b\\n` | -1 | -1.5 |" in with_text[-1]
    assert "| 0 | 3 | 5 | 40 |  | -1 |" in _worst_tokens([{"step": 0, "worst_tokens": [w]}])[-1]  # twin: no tokenizer
