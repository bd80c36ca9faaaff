"""The native engine's GPU tests (test_engine_gpu, test_release_gpu) share one model: a bf16 MoE
(16 experts, top-4, head_dim 128) on CUDA, its sampling parameters and prompts of 1-199 tokens."""

import torch

from rlalign.model import ModelArgs, build_model
from rlalign.sampling_params import SamplingParams

ARGS = dict(vocab_size=4096, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
            intermediate_size=1024, moe_intermediate_size=256, num_experts=16, top_k=4, norm_topk_prob=True,
            max_position_embeddings=1024, eos_token_id=1)
PARAMS = SamplingParams(max_new_tokens=40, eos_token_id=1, seed=3, temperature=0.9, top_p=0.95)


def engine_model(seed: int = 0):
    return build_model(ModelArgs(**ARGS), "bfloat16", seed=seed, device="cuda")


def engine_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 4096, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def same_rollouts(a, b) -> bool:
    """The same tokens and the same logprob bits, rollout by rollout."""
    return all(x.tokens == y.tokens and torch.equal(x.logprobs.view(torch.int32), y.logprobs.view(torch.int32))
               for x, y in zip(a, b, strict=True))
