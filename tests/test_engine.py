"""The native engine's schedule changes no token and no bit: continuous batching with few slots,
prompt chunks sharing steps with decode rows, tiny pages, a cache too small for every request at
once (requests wait for pages), all sample what the all-at-once schedule samples, and every
logprob equals the trainer's rescoring of the finished sequence."""

import pytest
import torch
from conftest import same_bits, tiny_model

from rlalign import kernels
from rlalign.generation import EngineConfig, SamplingParams, generate
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
    lps = score(model, [r.prompt for r in reference], [r.tokens for r in reference],
                micro_batch_size=4, **PARAMS.logprob_kwargs())
    assert sum(len(r.tokens) for r in reference) > 60
    assert any(r.finish_reason == "eos" for r in reference) or all(len(r.tokens) == 14 for r in reference)
    for r, lp in zip(reference, lps):
        assert same_bits(r.logprobs, lp.float()), f"sample {r.sample_id}"


def test_schedule_negative_twin_default_kernels_depend_on_the_schedule(model):
    prompts, ids = _prompts(11, seed=1, lo=8, hi=30), list(range(11))
    p = SamplingParams(max_new_tokens=10, seed=2)
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
