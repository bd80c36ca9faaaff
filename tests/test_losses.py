"""The policy losses by name (algorithm.name), a user's loss (algorithm.loss), their metrics as the
step logs them, and the refusal of a loss that does not exist."""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch
from omegaconf import OmegaConf

from rlalign.config import ConfigError, LossName, load_config
from rlalign.training.losses import (
    LOSSES,
    LossBatch,
    dr_grpo_loss,
    grpo_loss,
    gspo_loss,
    logged_stats,
    merge_stat,
    resolve_loss,
    sequence_means,
)


def _alg(*over: str):
    return OmegaConf.create(OmegaConf.to_container(load_config(list(over)).algorithm))


def _batch(lengths=(2, 3), adv=(1.0, -0.5), shift=0.0, **kw) -> LossBatch:
    """Trainer logprobs = generator logprobs + shift per token (the ratio's log), one advantage per sample."""
    gen = -torch.arange(1, sum(lengths) + 1, dtype=torch.float32) / 4
    shifts = torch.as_tensor(shift, dtype=torch.float32).expand(gen.shape)
    logp = (gen + shifts).requires_grad_(True)
    advantages = torch.cat([torch.full((n,), a) for n, a in zip(lengths, adv)])
    sizes = dict(minibatch_tokens=sum(lengths), minibatch_sequences=len(lengths), max_new_tokens=8)
    return LossBatch(logp, gen, gen.clone(), advantages, list(lengths), **{**sizes, **kw})


def test_the_built_in_names_are_the_schemas():
    assert tuple(LOSSES) == get_args(LossName)
    for name in LOSSES:
        assert resolve_loss(_alg(f"algorithm.name={name}")) is LOSSES[name]
    assert resolve_loss(_alg()) is grpo_loss  # the default


def test_algorithm_name_chooses_the_loss():
    """The same batch through each name: different losses (a twin of the test above, where each name
    resolves to its function), and the group files select them."""
    b = _batch(shift=torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4]))
    values = {name: float(LOSSES[name](b, _alg(f"algorithm={name}"))[0].detach()) for name in LOSSES}
    assert len(set(values.values())) == 3  # grpo == ppo-clip without a KL term: the rest all differ
    assert values["grpo"] == values["ppo-clip"]
    assert _alg("algorithm=dr_grpo").norm_adv_by_std is False and _alg("algorithm=gspo").clip_high == 0.0004


def test_an_unknown_loss_is_refused_with_the_names():
    with pytest.raises(ConfigError, match=r"algorithm\.name='gspoo': no such loss \(did you mean 'gspo'\?\); "
                                          r"built in: grpo, ppo-clip, dr_grpo, gspo"):
        load_config(["algorithm.name=gspoo"])
    with pytest.raises(ValueError, match=r"no such loss \(did you mean 'grpo'\?\)"):
        resolve_loss(OmegaConf.create({"name": "grp", "loss": None}))
    with pytest.raises(ConfigError, match=r"algorithm\.name='ppo': no such loss \(did you mean 'ppo-clip'\?\)"):
        load_config(["algorithm.name=ppo"])  # a prefix, too far for difflib
    with pytest.raises(ConfigError, match=r"algorithm\.name='reinforce': no such loss; built in"):
        load_config(["algorithm.name=reinforce"])  # the twin: nothing close, no guess
    with pytest.raises(ConfigError, match=r"ppo-clip has no reference-KL term"):
        load_config(["algorithm=ppo-clip", "algorithm.kl_coef=0.1"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss='nocolon': expected 'pkg.module:function'"):
        load_config(["algorithm.loss=nocolon"])
    load_config(["algorithm.name=mine", "algorithm.loss=pkg.mod:fn"])  # with a loss, the name is its label


def test_grpo_is_the_clipped_surrogate_per_token_with_its_metrics():
    b = _batch(shift=torch.tensor([0.0, 0.5, 0.0, -0.5, 0.0]))
    alg = _alg()
    loss, m = grpo_loss(b, alg)
    r = torch.exp(b.logprobs.detach() - b.generator_logprobs)
    expect = torch.maximum(-b.advantages * r, -b.advantages * r.clamp(0.8, 1.2))
    assert torch.equal(loss.detach(), expect.sum())
    assert m["clip_frac_sum"] == 2.0  # token 1 (A > 0, r > 1.2) and token 3 (A < 0, r < 0.8)
    assert float(m["ratio_max"]) == float(r.max()) and float(m["ratio_min"]) == float(r.min())
    with_kl = _alg("algorithm.kl_coef=0.5")
    loss_kl, m_kl = grpo_loss(_batch(ref_logprobs=torch.zeros(5)), with_kl)
    assert "kl/ref_k3_sum" in m_kl and float(loss_kl.detach()) > float(grpo_loss(_batch(), alg)[0].detach())


def test_dr_grpo_divides_by_a_constant_not_by_the_tokens():
    """The trainer divides the sum by the minibatch's tokens; dr_grpo's objective comes out as the sum
    over sequences x max_new_tokens, so a token's gradient does not depend on how long the responses are."""
    alg = _alg("algorithm=dr_grpo")
    grads = []
    for lengths in ((2, 3), (2, 7)):
        b = _batch(lengths, adv=(1.0, -0.5))
        loss, _ = dr_grpo_loss(b, alg)
        (loss / b.minibatch_tokens).backward()  # what the trainer does
        grads.append(b.logprobs.grad[0].item())
    assert grads[0] == pytest.approx(-1.0 / (2 * 8), rel=1e-6) and grads[1] == pytest.approx(grads[0], rel=1e-6)
    b = _batch((2, 7))
    (grpo_loss(b, _alg())[0] / b.minibatch_tokens).backward()
    assert b.logprobs.grad[0].item() == pytest.approx(-1.0 / 9, rel=1e-6)  # the twin: grpo's token mean moves


def test_gspo_ratio_is_per_sequence_the_exp_of_the_mean_token_log_ratio():
    log_ratio = torch.tensor([0.1, -0.3, 0.25, 0.05, 0.2])
    b = _batch((2, 3), shift=log_ratio)
    alg = _alg("algorithm=gspo", "algorithm.clip_low=0.9", "algorithm.clip_high=9")  # no clipping here
    loss, m = gspo_loss(b, alg)
    seq = torch.exp(sequence_means(b.logprobs.detach() - b.generator_logprobs, [2, 3]))
    assert seq[0] == torch.exp((b.logprobs.detach() - b.generator_logprobs)[:2].mean())
    assert float(m["ratio_max"]) == float(seq.max()) and float(m["ratio_min"]) == float(seq.min())
    assert seq[0] != torch.exp(log_ratio[0]) and not torch.equal(seq[0].expand(2), torch.exp(log_ratio[:2]))
    (loss / b.minibatch_tokens).backward()  # the mean over sequences of -A s_i
    expect = [-1.0 * float(seq[0]) / 2 / 2] * 2 + [0.5 * float(seq[1]) / 3 / 2] * 3
    assert b.logprobs.grad.tolist() == pytest.approx(expect, rel=1e-5)
    moved = torch.tensor([0.2, 0.1, -0.1, -0.2, 0.0])  # both sequences' ratios move with their advantage
    _, m = gspo_loss(_batch((2, 3), shift=moved), _alg("algorithm=gspo"))  # the paper's clip range
    assert m["clip_frac_sum"] == 5.0  # both sequences clipped: counted in tokens
    _, m = gspo_loss(_batch((2, 3), shift=moved), alg)
    assert m["clip_frac_sum"] == 0.0


def test_a_user_loss_from_a_file_and_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(
        "from rlalign.training.losses import grpo_loss\n\n"
        "def scaled(batch, alg):\n"
        "    loss, metrics = grpo_loss(batch, alg)\n"
        "    return 2 * loss, {**metrics, 'mine/tokens_sum': float(len(batch.logprobs)), 'calls': 1.0}\n")
    b = _batch()
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in (f"{tmp_path / 'my_losses.py'}:scaled", "my_losses:scaled"):
        fn = resolve_loss(_alg(f"algorithm.loss={spec}"))
        loss, m = fn(b, _alg())
        assert torch.equal(loss, 2 * grpo_loss(b, _alg())[0]) and m["mine/tokens_sum"] == 5.0
    with pytest.raises(ValueError, match=r"has no function 'nope'"):
        resolve_loss(_alg(f"algorithm.loss={tmp_path / 'my_losses.py'}:nope"))
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_module'"):
        resolve_loss(_alg("algorithm.loss=no_such_module:fn"))


@pytest.mark.parametrize("body, message", [
    ("return 1.0", r"returned 1\.0 \(float\)"),
    ("return batch.logprobs.sum()", r"returned a tensor of shape \[\]"),  # the metrics dict forgotten
    ("return batch.logprobs, {}", r"returned a loss of a tensor of shape \[5\]"),
    ("return batch.logprobs.detach().sum(), {}", r"returned a loss without grad"),
    ("return batch.logprobs.sum(), {'note': 'x'}", r"returned the metric 'note': 'x' \(str\)"),
    ("return batch.logprobs.sum(), {'v': batch.logprobs}", r"returned the metric 'v': a tensor of shape \[5\]"),
])
def test_a_user_loss_returning_the_wrong_thing_is_named(tmp_path, body, message):
    (tmp_path / "bad_losses.py").write_text(f"def fn(batch, alg):\n    {body}\n")
    fn = resolve_loss(_alg(f"algorithm.loss={tmp_path / 'bad_losses.py'}:fn"))
    with pytest.raises(ValueError, match=r"algorithm\.loss='.*bad_losses\.py:fn' \(.*bad_losses\.py:1\) " + message):
        fn(_batch(), _alg())


@pytest.mark.parametrize("params", ["batch", "batch, alg, scale", "*, batch, alg"])
def test_a_user_loss_that_cannot_take_batch_and_alg_is_named_when_it_loads(tmp_path, params):
    """A loss whose signature cannot take (batch, alg) is refused where it loads (rl.py loads it before any
    actor), naming algorithm.loss, its file and line, and its signature. The twins: defaults, *args and
    **kwargs that take the two load."""
    (tmp_path / "sig_losses.py").write_text(f"def fn({params}):\n    return 0\n")
    with pytest.raises(ValueError, match=r"algorithm\.loss='.*sig_losses\.py:fn' \(.*sig_losses\.py:1\): a loss "
                                         rf"takes \(batch, alg\); this one takes \({re.escape(params)}\)"):
        resolve_loss(_alg(f"algorithm.loss={tmp_path / 'sig_losses.py'}:fn"))
    for i, ok in enumerate(("batch, alg, scale=2", "*args", "batch, alg, **kw")):
        (tmp_path / f"ok_losses{i}.py").write_text(f"def fn({ok}):\n    return 0\n")
        resolve_loss(_alg(f"algorithm.loss={tmp_path / f'ok_losses{i}.py'}:fn"))


def test_a_user_loss_returning_a_loss_and_metrics_passes_unchanged(tmp_path):
    """The negative twin: the check lets a well-formed return through as it is."""
    (tmp_path / "good_losses.py").write_text(
        "def fn(batch, alg):\n    return batch.logprobs.sum(), {'n': 1, 'flag': True, 's_sum': batch.logprobs.sum()}\n")
    b = _batch()
    loss, m = resolve_loss(_alg(f"algorithm.loss={tmp_path / 'good_losses.py'}:fn"))(b, _alg())
    assert torch.equal(loss, b.logprobs.sum()) and set(m) == {"n", "flag", "s_sum"}


def test_logged_metrics_are_whatever_the_loss_returned():
    stats = {"pg_loss_sum": 6.0, "ratio_max": 1.5, "tis/weight_min": 0.5, "grad_norm_last": 2.0, "calls": 4.0,
             "mine/tokens_sum": 12.0}
    assert logged_stats(stats, 3) == {"actor/pg_loss": 2.0, "actor/ratio_max": 1.5, "tis/weight_min": 0.5,
                                      "actor/grad_norm": 2.0, "actor/calls": 4.0, "mine/tokens": 4.0}


def test_merged_metrics_do_not_depend_on_how_micro_batches_split_over_ranks():
    """The driver merges records in (epoch, minibatch, micro-batch) order whichever rank sent them."""
    records = [((0, 0, g), {"x_sum": 0.1 * (g + 1), "x_max": float(g % 3), "x_min": -float(g), "n_last": float(g)})
               for g in range(7)]

    def merged(world):
        per_rank = [[rec for rec in records if rec[0][2] % world == r] for r in range(world)]
        out: dict = {}
        for _, st in sorted((rec for recs in per_rank for rec in recs), key=lambda rec: rec[0]):
            for k, v in st.items():
                out[k] = merge_stat(k, out.get(k), v)
        return out

    assert merged(1) == merged(2) == merged(4)
    assert merged(1)["x_max"] == 2.0 and merged(1)["x_min"] == -6.0 and merged(1)["n_last"] == 6.0
    assert merged(1)["x_sum"] == sum(0.1 * (g + 1) for g in range(7))  # micro-batch order, not rank order


@pytest.mark.parametrize("scale", [float("nan"), 1.0])
def test_a_non_finite_gradient_is_refused_before_the_update(scale):
    """A loss that is NaN (a user's loss, an overflow) stops the step naming the gradient norm and leaves
    the weights as they were, instead of NaN weights that break the next generate; the twin (a finite
    loss) updates them."""
    from rlalign import kernels
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = load_config(["trainer.micro_batch_size=2"])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, None)
    before = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    tr.forward_backward([Sample([3, 4, 5], [6, 7], torch.zeros(2), params=SamplingParams())],
                        lambda lps, idx: (-torch.cat(lps).sum() * scale, {}), 2)
    if scale != scale:
        with pytest.raises(FloatingPointError, match=r"the gradient norm is nan, so the weights were not updated"):
            tr.optimizer_step()
    else:
        tr.optimizer_step()
    after = tr.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) == (scale != scale)
