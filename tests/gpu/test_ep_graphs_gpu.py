"""GPU (one is enough): the expert-parallel MoE forward through the fixed-capacity all-to-all makes no
host sync, and the native engine's EP decode steps replay CUDA graphs, over a real NCCL group of one
rank (every all-to-all goes to itself: the collectives, sizes and graphs of EP > 1, which needs two
GPUs). Under Lockstep (graphs + lookahead) the engine samples exactly what the single-GPU engine
samples. Twin: the host-sized EP path does sync."""

import pytest
import torch

from rlalign.parallel import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = dict(vocab_size=4096, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
            intermediate_size=1024, moe_intermediate_size=256, num_experts=16, top_k=4, norm_topk_prob=True,
            max_position_embeddings=1024, eos_token_id=1)


def _syncs(fn) -> str:
    """'' when fn() makes no host sync, else the error torch's sync debug mode raised."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return ""
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _rank(rank, world, group):
    from rlalign import kernels
    from rlalign.model import ModelArgs, build_model
    from rlalign.parallel.ep import ExpertParallel, moe_layers, set_step_rows
    from rlalign.parallel.launch import Lockstep
    from rlalign.rollout.native.engine import NativeEngine
    from rlalign.rollout.types import EngineConfig, SamplingParams

    params = SamplingParams(max_new_tokens=32, eos_token_id=1, seed=3, temperature=0.9, top_p=0.95)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 4096, (int(torch.randint(1, 100, (1,), generator=g)),), generator=g).tolist()
               for _ in range(21)]
    ids = list(range(len(prompts)))
    model = build_model(ModelArgs(**ARGS), "bfloat16", seed=0, device="cuda")
    out = {}
    with kernels.use(mode="deterministic", backend="triton"), torch.no_grad():
        ref = NativeEngine(model).generate(prompts, ids, params)  # one GPU, no EP: graphs + lookahead
        for moe in moe_layers(model):
            moe.experts = ExpertParallel(moe.experts, group, moe.top_k)
        moe = moe_layers(model)[0]
        x = torch.randn(48, ARGS["hidden_size"], device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        host = moe(x.bfloat16())
        out["host_path_sync"] = _syncs(lambda: moe(x.bfloat16()))
        set_step_rows(model, 64)
        fixed = moe(x.bfloat16())  # (compiles outside the checked region)
        out["fixed_path_sync"] = _syncs(lambda: moe(x.bfloat16()))
        out["fixed_equals_host"] = torch.equal(fixed.view(torch.int16), host.view(torch.int16))
        set_step_rows(model, None)
        engine = NativeEngine(model, EngineConfig(), Lockstep(group))
        got = engine.generate(prompts, ids, params)
        out["stats"], out["captures"] = dict(engine.stats), engine.state.graphs.captures
    out["same_as_one_gpu"] = all(a.tokens == b.tokens and torch.equal(a.logprobs.view(torch.int32),
                                                                      b.logprobs.view(torch.int32))
                                 for a, b in zip(got, ref, strict=True))
    out["tokens"] = sum(len(r.tokens) for r in got)
    return out


def test_ep_decode_through_the_fixed_capacity_is_sync_free_and_replays_graphs_bitwise():
    out = launch.run_workers(1, _rank, (), device="cuda", timeout_s=300)[0]
    print("ep graphs:", out)
    assert out["host_path_sync"], "twin: the host-sized EP path should sync"
    assert out["fixed_path_sync"] == "", out["fixed_path_sync"]
    assert out["fixed_equals_host"]
    assert out["captures"] > 0 and out["stats"]["fixed_capacity_steps"] > 0 and out["stats"]["lookahead_steps"] > 0, out
    assert out["same_as_one_gpu"] and out["tokens"] > 300, out
