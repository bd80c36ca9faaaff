"""The trainer on episodes (rlalign.sequences.Sample.turns): observation tokens carry no loss, no
metric and no gradient in every built-in loss and a user's; a single-turn sample trains on the same
bits as before. Each property has a negative twin (the same change without the mask moves the gradient)."""

from __future__ import annotations

import pytest
import torch
from conftest import same_bits
from omegaconf import OmegaConf

from rlalign import kernels
from rlalign.config import load_config
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Sample
from rlalign.training.losses import LOSSES, LossBatch, policy_batch, policy_selection
from rlalign.training.trainer import Trainer

PROMPTS = [[3, 4, 5], [5, 4]]
TURNS = [[0, 0, -1, -1, -1, 1, 1, -1, 2], [0, 0, 0, 0]]  # sample 0: an episode of 3 turns; sample 1: all policy
TOP_K = SamplingParams(top_k=4)  # an observation token outside the top 4 has logprob -inf


@pytest.fixture(scope="module")
def trainer():
    cfg = load_config(["trainer.micro_batch_size=2", "algorithm.kl_coef=0.1", "model.num_layers=1"])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    return Trainer(cfg)


def _alg(name: str, *over: str):
    return OmegaConf.create(OmegaConf.to_container(load_config([f"algorithm={name}", *over]).algorithm))


@torch.no_grad()
def _episode(model, prompt: list[int], turns: list[int]) -> list[int]:
    """A response whose policy tokens are the model's argmax (inside the top 4) and whose observation
    tokens are its argmin (outside: logprob -inf under TOP_K)."""
    seq = list(prompt)
    for t in turns:
        logits = model(torch.tensor(seq), [0, len(seq)])[-1].float()
        seq.append(int(logits.argmax() if t >= 0 else logits.argmin()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def responses(trainer):
    return [_episode(trainer.model, p, t) for p, t in zip(PROMPTS, TURNS)]


_SCORES: dict = {}


def _samples(trainer, responses, params, turns, obs_gen: float = 0.0) -> list[Sample]:
    """The two samples with generator logprobs = the trainer's score + 0.1 at policy tokens and `obs_gen`
    at observation tokens (what a test perturbs)."""
    key = (params.top_k, tuple(map(tuple, responses)))
    if key not in _SCORES:
        _SCORES[key] = trainer.score([Sample(p, r, torch.zeros(len(r)), params=params)
                                      for p, r in zip(PROMPTS, responses)])
    out = []
    for i, (p, r, t) in enumerate(zip(PROMPTS, responses, TURNS)):
        lp = _SCORES[key][i]
        gen = torch.where(torch.tensor(t) >= 0, lp + 0.1, torch.tensor(obs_gen))
        out.append(Sample(p, r, gen, [1.0, -0.5][i], i, params=params, turns=t if turns else None))
    return out


def _grads(trainer, samples, alg, loss_fn=None, global_tokens=None):
    ref = dict(enumerate(trainer.score(samples, trainer.ref_model))) if alg.kl_coef > 0 else None
    loss_fn = loss_fn or trainer.ppo_loss(samples, alg, {}, ref, [[0, 1]])
    stats = trainer.forward_backward(samples, loss_fn, global_tokens, mbs=[[0, 1]])
    return {k: g.clone() for k, g in trainer.grads.items()}, stats[0]


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


ALGS = [("grpo", "algorithm.kl_coef=0.1"), ("gspo",), ("dr_grpo",),
        ("ppo-clip", "algorithm.tis.enabled=true", "algorithm.icepop.enabled=true")]


@pytest.mark.parametrize("alg", ALGS, ids=lambda a: a[0])
def test_an_observation_tokens_logprob_path_moves_no_gradient(trainer, responses, alg):
    """Observation tokens at -inf (top-k) and their generator logprob changed from 0 to -inf: the loss's
    metrics and every gradient keep their bits, all finite."""
    a = _alg(*alg)
    g0, s0 = _grads(trainer, _samples(trainer, responses, TOP_K, True, 0.0), a)
    obs = trainer.score([Sample(PROMPTS[0], responses[0], torch.zeros(9), params=TOP_K)])[0][torch.tensor(TURNS[0]) < 0]
    assert torch.isneginf(obs).all()  # the trainer's own logprob of each observation token is -inf
    g1, s1 = _grads(trainer, _samples(trainer, responses, TOP_K, True, -float("inf")), a)
    assert _same(g0, g1) and s0 == s1
    assert all(torch.isfinite(g).all() for g in g0.values()) and all(v == v for v in s0.values())
    assert any(g.abs().sum() > 0 for g in g0.values())


@pytest.mark.parametrize("alg", [("grpo",), ("gspo",)], ids=lambda a: a[0])
def test_without_the_mask_the_same_change_moves_the_gradient(trainer, responses, alg):
    """The negative twin: under the full distribution (finite everywhere) and without turns (None), the
    same change of the 'observation' tokens' generator logprob moves the gradient."""
    a, params = _alg(*alg), SamplingParams()
    plain = [_grads(trainer, _samples(trainer, responses, params, False, v), a) for v in (0.0, -3.0)]
    assert not _same(plain[0][0], plain[1][0])


def test_single_turn_trains_on_the_same_bits_with_turns_none_or_all_policy(trainer, responses):
    """turns=None (the single-turn path, unchanged) and turns all >= 0: bitwise the same gradients and
    metrics (entropy included); the twin: one token marked as an observation changes them."""
    a, params = _alg("grpo"), SamplingParams()
    base = _samples(trainer, responses, params, False)
    all_policy = [Sample(s.prompt, s.response, s.generator_logprobs, s.advantage, s.sample_id, params=params,
                         turns=[k % 2 for k in range(len(s.response))]) for s in base]
    g0, s0 = _grads(trainer, base, a)
    g1, s1 = _grads(trainer, all_policy, a)
    assert _same(g0, g1) and s0 == s1
    all_policy[1].turns = [0, 0, -1, 0]
    g2, s2 = _grads(trainer, all_policy, a)
    assert not _same(g0, g2) and s0["entropy_sum"] != s2["entropy_sum"]


def test_an_episodes_loss_is_the_loss_over_its_policy_tokens_by_hand(trainer, responses):
    """The trainer on the episode == a hand-made loss function that picks the policy tokens out of
    the scored logprobs and runs grpo over them, normalised by the policy tokens: the same bits."""
    a = _alg("grpo", "algorithm.kl_coef=0.1")
    samples = _samples(trainer, responses, TOP_K, True)
    ref = dict(enumerate(trainer.score(samples, trainer.ref_model)))
    keep = [torch.tensor(t) >= 0 for t in TURNS]
    n = sum(int(k.sum()) for k in keep)

    def by_hand(lps, idx):
        pick = lambda xs: torch.cat([x[k] for x, k in zip(xs, keep)])  # noqa: E731
        lp = pick(lps)
        batch = LossBatch(lp, pick([s.generator_logprobs for s in samples]), lp.detach(),
                          pick([torch.full((len(s.response),), s.advantage) for s in samples]),
                          [int(k.sum()) for k in keep], pick([ref[0], ref[1]]), n, 2, trainer.max_new_tokens)
        loss, st = LOSSES["grpo"](batch, a)
        return loss, st

    g0, s0 = _grads(trainer, samples, a)
    g1, s1 = _grads(trainer, samples, a, by_hand, n)
    assert _same(g0, g1) and s0 == s1


def test_policy_batch_selects_the_policy_tokens_with_their_turns():
    """policy_selection / policy_batch remove the observation tokens from every per-token tensor (no
    0 * -inf), count lengths over the rest and give their turns; gspo's sequence means are over them.
    Twin: the unselected batch's gspo differs; turns of the wrong length are refused."""
    lp = torch.tensor([-1.0, -float("inf"), -2.0, -0.5, -0.25], requires_grad=True)
    gen = torch.tensor([-1.1, 0.0, -2.1, -0.4, -0.3])
    batch = LossBatch(lp, gen, lp.detach(), torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0]), [3, 2],
                      minibatch_tokens=4, minibatch_sequences=2, max_new_tokens=8)
    index, turns, lengths = policy_selection([[0, -1, 1], None], [3, 2], lp.device)
    assert index.tolist() == [0, 2, 3, 4] and turns.tolist() == [0, 1, 0, 0] and lengths == [2, 2]
    pol = policy_batch(batch, index, turns, lengths)
    with pytest.raises(ValueError, match="turns has 2 entries for 3 response tokens"):
        policy_selection([[0, -1], None], [3, 2], lp.device)
    assert torch.equal(pol.generator_logprobs, torch.tensor([-1.1, -2.1, -0.4, -0.3]))
    a = _alg("gspo")
    loss, st = LOSSES["gspo"](pol, a)
    loss.backward()
    assert lp.grad[1] == 0 and torch.isfinite(lp.grad).all() and all(float(v) == float(v) for v in st.values())
    kept = torch.tensor([-1.0, -2.0, -0.5, -0.25])
    hand = LossBatch(kept, gen[[0, 2, 3, 4]], kept.clone(), torch.tensor([1.0, 1.0, -1.0, -1.0]), [2, 2],
                     minibatch_tokens=4, minibatch_sequences=2)
    assert same_bits(loss.detach(), LOSSES["gspo"](hand, a)[0])
    finite = LossBatch(batch.logprobs.detach().nan_to_num(neginf=-3.0), gen, batch.trainer_old_logprobs.nan_to_num(
        neginf=-3.0), batch.advantages, [3, 2], minibatch_tokens=4, minibatch_sequences=2)
    assert not same_bits(loss.detach(), LOSSES["gspo"](finite, a)[0])


SEEN: list[LossBatch] = []


def recording_loss(batch: LossBatch, alg):
    """A user's loss (algorithm.loss): records what it was given, returns the logprobs' negated sum."""
    SEEN.append(batch)
    return -batch.logprobs.sum(), {}


def test_a_user_loss_gets_the_policy_tokens_and_their_turns(trainer, responses):
    """algorithm.loss=<this module>:recording_loss on the episode: its batch holds the 5 + 4 policy tokens,
    turns [0, 0, 1, 1, 2, 0, 0, 0, 0], all logprobs finite (top-k); the twin without turns: all 13, turns None."""
    a = _alg("grpo", f"algorithm.loss={__name__}:recording_loss")
    SEEN.clear()
    _grads(trainer, _samples(trainer, responses, TOP_K, True), a)
    _grads(trainer, _samples(trainer, responses, TOP_K, False), a)
    ep, plain = SEEN[-2:]
    assert ep.lengths == [5, 4] and ep.minibatch_tokens == 9 and torch.isfinite(ep.logprobs).all()
    assert ep.turns.tolist() == [0, 0, 1, 1, 2, 0, 0, 0, 0]
    assert plain.lengths == [9, 4] and plain.turns is None and torch.isneginf(plain.logprobs).sum() == 4
