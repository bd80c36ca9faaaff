import pytest
import torch
from conftest import same_bits, tiny_model

from rlalign import kernels
from rlalign.config import TEMPERATURE_RANGE
from rlalign.kernels import sampling
from rlalign.rollout.native.engine import generate
from rlalign.sampling_params import SamplingParams


def test_noise_is_a_pure_function_of_seed_sample_position():
    ids = torch.tensor([5, 9, 2, 7])
    pos = torch.tensor([3, 3, 10, 0])
    u = sampling.uniform(11, ids, pos, 64)
    for i in range(4):  # alone, and in another batch order
        assert same_bits(sampling.uniform(11, ids[i : i + 1], pos[i : i + 1], 64)[0], u[i])
    assert same_bits(sampling.uniform(11, ids.flip(0), pos.flip(0), 64).flip(0), u)
    # negative twins: another seed / position / sample id changes the noise
    assert not same_bits(sampling.uniform(12, ids, pos, 64), u)
    assert not same_bits(sampling.uniform(11, ids, pos + 1, 64), u)
    assert not same_bits(sampling.uniform(11, ids + 1, pos, 64), u)
    assert bool((u > 0).all() and (u < 1).all())


def test_gumbel_max_samples_from_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    toks = kernels.sample(logits, 3, torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.015


def test_filters_keep_the_documented_sets():
    z = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    k2 = sampling.filter_logits(z, top_k=2)
    assert torch.isfinite(k2).tolist() == [[True, False, True, True, False]]  # ties at the k-th kept
    p = torch.softmax(z, -1)[0]  # [0.53, 0.07, 0.20, 0.20, 0.03]
    tp = sampling.filter_logits(z, top_p=0.6)
    assert torch.isfinite(tp).tolist() == [[True, False, True, True, False]]
    assert torch.isfinite(sampling.filter_logits(z, top_p=0.5)).tolist() == [[True, False, False, False, False]]
    assert p.sum() > 0.99
    lp = kernels.token_logprobs(z, torch.tensor([2]), top_k=2)
    assert abs(float(lp) - float(torch.log_softmax(k2, -1)[0, 2])) < 1e-6


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_sequence_samples_the_same_tokens_in_any_batch(dtype):
    m = tiny_model(dtype)
    prompts = _prompts(12)
    params = SamplingParams(max_new_tokens=20, eos_token_id=1, seed=4, top_p=0.9)
    full = generate(m, prompts, list(range(12)), params)
    sub = generate(m, [prompts[7], prompts[2]], [7, 2], params)
    for r in sub:
        ref = full[r.sample_id]
        assert r.tokens == ref.tokens and same_bits(r.logprobs, ref.logprobs)
    again = generate(m, prompts, list(range(12)), params)
    assert all(a.tokens == b.tokens and same_bits(a.logprobs, b.logprobs) for a, b in zip(full, again))


def test_stop_on_eos_and_max_new_tokens():
    m = tiny_model()
    params = SamplingParams(max_new_tokens=40, eos_token_id=1, seed=0)
    outs = generate(m, _prompts(30), list(range(30)), params)
    reasons = {r.finish_reason for r in outs}
    assert reasons == {"eos", "length"}
    for r in outs:
        assert len(r.tokens) == len(r.logprobs) <= 40
        if r.finish_reason == "eos":
            assert r.tokens[-1] == 1 and 1 not in r.tokens[:-1]
        else:
            assert len(r.tokens) == 40


def test_greedy_is_argmax():
    m = tiny_model()
    p = _prompts(3)
    outs = generate(m, p, [0, 1, 2], SamplingParams(max_new_tokens=5, greedy=True, temperature=0.0))
    with torch.no_grad():
        first = [int(m(torch.tensor(q), [0, len(q)])[-1].float().argmax()) for q in p]
    assert [o.tokens[0] for o in outs] == first


def test_the_temperature_range_is_where_tempered_logits_stay_finite():
    """At the least temperature the config takes (2**-111), logits of size 2**16 give the argmax a finite
    logprob (0), and at the greatest (2**126) 1 / temperature is fp32's least normal number. The twins: half the
    least temperature overflows those logits (NaN), twice the greatest makes 1 / temperature subnormal."""
    lo, hi = TEMPERATURE_RANGE
    z = torch.tensor([[2.0 ** 16, -(2.0 ** 16), 0.0, 1.0]])
    tok = torch.tensor([0])
    assert kernels.token_logprobs(z, tok, temperature=lo).tolist() == [0.0]
    assert kernels.inverse_temperature(hi) == torch.finfo(torch.float32).tiny
    assert torch.isnan(kernels.token_logprobs(z, tok, temperature=lo / 2)).all()
    assert 0 < kernels.inverse_temperature(hi * 2) < torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("prompts, ids, params, message", [
    ([[3], [4]], [0, 0.5], {}, r"sample id 0.5 \(float\): sample ids are signed 64-bit integers"),
    ([[3]], [2**63], {}, r"sample id 9223372036854775808 \(int\): sample ids are signed 64-bit integers"),
    ([[3.5, 4]], [0], {}, r"prompt of sample 0 has 3.5 \(float\), not an integer token id in \[0, 64\)"),
    ([[3]], [0], dict(eos_token_id=64), r"eos_token_id=64: must be a token id, an integer \[0, 64\), or None"),
    ([[3]], [0], dict(eos_token_id="1"), r"eos_token_id='1': must be a token id"),
    ([[3]], [0], dict(greedy="false"), r"greedy='false' \(str\) must be true or false"),
    ([[3]], [0], dict(max_new_tokens=True), r"max_new_tokens=True: must be >= 1, an integer"),
    ([[3]], [0], dict(max_new_tokens=4.0), r"max_new_tokens=4.0: must be >= 1, an integer"),
    ([[3]], [0], dict(top_k=2.5), r"top_k=2.5 \(float\) must be an integer"),
    ([[3]], [0], dict(temperature="1.0"), r"temperature='1.0' \(str\) must be a number"),
    ([[3]], [0], dict(seed=2**64), r"seed=18446744073709551616: must be a signed 64-bit integer"),
])
def test_a_request_of_the_wrong_types_is_named_before_it_runs(prompts, ids, params, message):
    """A request's values of another type or range are refused naming the field (they ran as something else:
    ids 0 and 0.5 drew the same noise, greedy='false' decoded greedily, an eos id outside the vocabulary never
    stopped, a seed of 2**64 drew as seed 0; or failed deep inside: OverflowError, torch.full, topk)."""
    with pytest.raises(ValueError, match=message):
        generate(tiny_model(), prompts, ids, SamplingParams(**{"max_new_tokens": 3, **params}))


def test_numpy_and_tensor_integers_are_the_ints_they_hold():
    """The twin: a numpy array prompt, numpy sample ids and seed, and a 0-d tensor max_new_tokens draw the tokens
    (and bits) of the same Python ints."""
    import numpy

    m = tiny_model()
    want = generate(m, [[3, 4, 5], [6]], [0, 1], SamplingParams(max_new_tokens=3, seed=5))
    got = generate(m, [numpy.array([3, 4, 5]), torch.tensor([6])], [numpy.int64(0), numpy.int32(1)],
                   SamplingParams(max_new_tokens=torch.tensor(3), seed=numpy.int64(5)))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert all(same_bits(a.logprobs, b.logprobs) for a, b in zip(got, want))


def test_generation_bad_input_is_named():
    m = tiny_model()
    ok = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt batch"):
        generate(m, [], [], ok)
    with pytest.raises(ValueError, match="prompt of sample 1 is empty"):
        generate(m, [[3], []], [0, 1], ok)
    with pytest.raises(ValueError, match="sample 0 has 255 tokens.*context of 256"):
        generate(m, [[3] * 255], [0], ok)
    with pytest.raises(ValueError, match="temperature=0.0: sampling needs a temperature > 0"):
        generate(m, [[3]], [0], SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="token id 99 outside"):
        generate(m, [[3, 99]], [0], ok)
    with pytest.raises(ValueError, match="unique"):
        generate(m, [[3], [4]], [0, 0], ok)


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7, top_k=20, top_p=0.9), dict(greedy=True, temperature=0.5)])
def test_sample_next_is_sample_then_token_logprobs(kw):
    """The engines' sampling step (tempered logits computed once) = the public kernels.sample and
    the trainer's kernels.token_logprobs, bit for bit; a twin scored at another temperature differs."""
    from rlalign.rollout.sampling import sample_next

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ids, pos = torch.arange(6) * 3 + 1, torch.arange(6) + 4
    params = SamplingParams(seed=5, max_new_tokens=4, **kw)
    tok, lp = sample_next(logits, params, ids, pos)
    lk = params.logprob_kwargs()
    assert same_bits(tok, kernels.sample(logits, 5, ids, pos, greedy=params.greedy, **lk))
    assert same_bits(lp, kernels.token_logprobs(logits, tok, **lk))
    assert not same_bits(lp, kernels.token_logprobs(logits, tok, **{**lk, "temperature": 1.3}))


def test_the_temperature_step_is_the_product_by_the_fp32_inverse():
    """kernels.temper: fp32(logits) * fp32(1 / fp32(t)), one IEEE product (what torch's CUDA kernel computes
    for logits.float() / t, and what the Triton consumers compute in registers); the twin: torch's CPU
    kernel divides, which gives other bits for many fp32 values."""
    z = torch.randn(300, 300, generator=torch.Generator().manual_seed(0))  # fp32: products of 24-bit significands
    for t in (0.8, 0.7, 1.3):
        s = kernels.inverse_temperature(t)
        want = z.float() * torch.tensor(1.0, dtype=torch.float32).div(torch.tensor(t, dtype=torch.float32)).item()
        assert same_bits(kernels.temper(z, s), want)
        assert not same_bits(kernels.temper(z, s), z.float() / t)
    assert kernels.inverse_temperature(0.8) == 1.25 and kernels.temper(z, 1.0).dtype == torch.float32


def test_a_request_the_engine_cannot_sample_names_the_field():
    """Sampling given straight to the engine (no config) is checked against its model: top_k over the
    vocabulary and an infinite temperature are refused; the whole vocabulary is top_k's edge (twin)."""
    m = tiny_model()
    with pytest.raises(ValueError, match=r"top_k=65: more than the model's 64 token ids"):
        generate(m, [[3]], [0], SamplingParams(max_new_tokens=2, top_k=65))
    with pytest.raises(ValueError, match=r"temperature=inf: sampling needs a temperature > 0 and < inf"):
        generate(m, [[3]], [0], SamplingParams(max_new_tokens=2, temperature=float("inf")))
    with pytest.raises(ValueError, match=r"max_new_tokens=0: must be >= 1"):
        generate(m, [[3]], [0], SamplingParams(max_new_tokens=0))
    whole = generate(m, [[3]], [0], SamplingParams(max_new_tokens=2, top_k=64))
    plain = generate(m, [[3]], [0], SamplingParams(max_new_tokens=2))
    assert whole[0].tokens == plain[0].tokens and torch.equal(whole[0].logprobs, plain[0].logprobs)
