"""GPU: the native engine with the Triton kernels — CUDA-graph decode steps (padded buckets) give
the same tokens and bits as eager steps, every schedule gives the same bits, and the logprobs
equal the trainer's rescoring."""

import pytest
import torch

from rlalign import kernels
from rlalign.generation import EngineConfig, SamplingParams, generate
from rlalign.model import ModelArgs, build_model
from rlalign.training.scoring import score

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = dict(vocab_size=4096, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
            intermediate_size=1024, moe_intermediate_size=256, num_experts=16, top_k=4, norm_topk_prob=True,
            max_position_embeddings=1024, eos_token_id=1)
PARAMS = SamplingParams(max_new_tokens=40, eos_token_id=1, seed=3, temperature=0.9, top_p=0.95)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 4096, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return build_model(ModelArgs(**ARGS), "bfloat16", seed=0, device="cuda")


@pytest.fixture(scope="module")
def eager(model):
    with kernels.use(mode="deterministic", backend="triton"):
        return generate(model, _prompts(37), list(range(37)), PARAMS, engine=EngineConfig(cuda_graphs=False))


@pytest.mark.parametrize("engine", [EngineConfig(), EngineConfig(max_num_seqs=5, max_num_batched_tokens=64),
                                    EngineConfig(max_num_seqs=16, page_size=32, num_pages=40)],
                         ids=["graphs", "graphs-chunked", "graphs-page-limited"])
def test_graphs_and_schedules_change_no_bit(model, eager, engine):
    with kernels.use(mode="deterministic", backend="triton"):
        got = generate(model, _prompts(37), list(range(37)), PARAMS, engine=engine)
    for r, ref in zip(got, eager):
        assert r.tokens == ref.tokens
        assert torch.equal(r.logprobs.view(torch.int32), ref.logprobs.view(torch.int32)), f"sample {r.sample_id}"


def test_engine_logprobs_equal_the_trainers(model, eager):
    with kernels.use(mode="deterministic", backend="triton"):
        lps = score(model, [r.prompt for r in eager], [r.tokens for r in eager], micro_batch_size=8,
                    **PARAMS.logprob_kwargs())
    bad = sum(int((r.logprobs.cuda() != lp.float()).sum()) for r, lp in zip(eager, lps))
    assert sum(len(r.tokens) for r in eager) > 500 and bad == 0


def test_negative_twin_default_kernels_disagree_with_the_trainer(model):
    with kernels.use(mode="default"):
        outs = generate(model, _prompts(37), list(range(37)), PARAMS, engine=EngineConfig(cuda_graphs=False))
        lps = score(model, [r.prompt for r in outs], [r.tokens for r in outs], micro_batch_size=8,
                    **PARAMS.logprob_kwargs())
    assert sum(int((r.logprobs.cuda() != lp.float()).sum()) for r, lp in zip(outs, lps)) > 0
