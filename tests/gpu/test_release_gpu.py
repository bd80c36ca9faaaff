"""GPU: a releasable native engine (a colocated generator) gives its weights' and KV cache's memory
back to the device and maps it again at the same addresses: after release + resume + the weights
written again, a generate replays the kept decode graphs (nothing captured) with the same tokens and
bits as without the release. Twins: weights written with other values after the resume sample other
tokens (the graphs read the remapped memory); a generate before the weights are written is refused."""

import pytest
import torch

from rlalign import kernels
from rlalign.model import ModelArgs, build_model
from rlalign.rollout.native.arena import DeviceArena
from rlalign.rollout.native.engine import NativeEngine
from rlalign.rollout.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = dict(vocab_size=4096, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
            intermediate_size=1024, moe_intermediate_size=256, num_experts=16, top_k=4, norm_topk_prob=True,
            max_position_embeddings=1024, eos_token_id=1)
PARAMS = SamplingParams(max_new_tokens=40, eos_token_id=1, seed=3, temperature=0.9, top_p=0.95)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 4096, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _same(a, b) -> bool:
    return all(x.tokens == y.tokens and torch.equal(x.logprobs.view(torch.int32), y.logprobs.view(torch.int32))
               for x, y in zip(a, b, strict=True))


def _write(model, state) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])


def test_arena_gives_memory_back_and_keeps_addresses():
    arena = DeviceArena(3 << 30, torch.device("cuda"))
    t = arena.tensor((1024, 1024), torch.float32)
    ptr = t.data_ptr()
    t.fill_(2.0)
    free0, _ = torch.cuda.mem_get_info()
    arena.release()
    free1, _ = torch.cuda.mem_get_info()
    assert free1 - free0 >= arena.nbytes  # twin: resident, the device had that much less
    arena.resume()
    assert t.data_ptr() == ptr and torch.cuda.mem_get_info()[0] <= free0 + (64 << 20)
    t.fill_(3.0)
    assert float(t.sum()) == 3.0 * 1024 * 1024
    with pytest.raises(RuntimeError, match="do not fit"):
        arena.tensor((arena.nbytes,), torch.uint8)
    arena.close()


def test_release_and_resume_change_no_bit_and_keep_the_graphs():
    prompts, ids = _prompts(37), list(range(37))
    model = build_model(ModelArgs(**ARGS), "bfloat16", seed=0, device="cuda")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    other = build_model(ModelArgs(**ARGS), "bfloat16", seed=1, device="cuda").state_dict()
    with kernels.use(mode="deterministic", backend="triton"):
        plain = NativeEngine(build_model(ModelArgs(**ARGS), "bfloat16", seed=0, device="cuda")).generate(
            prompts, ids, PARAMS)
        engine = NativeEngine(model, releasable=True)
        first = engine.generate(prompts, ids, PARAMS)
        g, n = engine.state.graphs, engine.state.graphs.captures
        ptrs = [p.data_ptr() for p in model.parameters()] + [engine.state.cache.k.data_ptr()]
        free0, _ = torch.cuda.mem_get_info()
        engine.release_memory()
        assert torch.cuda.mem_get_info()[0] - free0 >= engine.weights.nbytes + engine.state.arena.nbytes
        engine.resume_memory()
        with pytest.raises(RuntimeError, match="weights were released"):
            engine.generate(prompts, ids, PARAMS)  # twin: the weights are not written yet
        _write(model, saved)
        engine.load_weights()
        again = engine.generate(prompts, ids, PARAMS)
        assert engine.state.graphs is g and g.captures == n  # the graphs replayed, nothing captured
        assert [p.data_ptr() for p in model.parameters()] + [engine.state.cache.k.data_ptr()] == ptrs
        engine.release_memory()
        engine.resume_memory()
        _write(model, other)  # twin: other weights after the resume are what the graphs read
        engine.load_weights()
        changed = engine.generate(prompts, ids, PARAMS)
        engine.release_memory(weights=False)  # the KV cache only: the weights stay usable
        kept = engine.generate(prompts, ids, PARAMS)
        engine.close()
    assert _same(first, plain) and _same(again, plain)
    assert not _same(changed, plain) and _same(kept, changed)


def test_a_state_not_kept_gives_its_arena_back_after_each_call():
    """keep_state=false with a releasable engine: each call's KV arena is closed when it returns (twin:
    a kept state still holds its arena)."""
    from rlalign.rollout.types import EngineConfig

    prompts, ids = _prompts(9), list(range(9))
    model = build_model(ModelArgs(**ARGS), "bfloat16", seed=0, device="cuda")
    with kernels.use(mode="deterministic", backend="triton"):
        engine = NativeEngine(model, EngineConfig(keep_state=False), releasable=True)
        engine.generate(prompts, ids, PARAMS)
        torch.cuda.empty_cache()
        free0, _ = torch.cuda.mem_get_info()
        for _ in range(3):
            engine.generate(prompts, ids, PARAMS)
        torch.cuda.empty_cache()
        assert engine.state is None and torch.cuda.mem_get_info()[0] >= free0 - (16 << 20)
        kept = NativeEngine(model, EngineConfig(), releasable=False)
        kept.generate(prompts, ids, PARAMS)
        assert kept.state is not None and kept.state.arena is None
