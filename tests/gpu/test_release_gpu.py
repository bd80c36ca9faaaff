"""GPU: a releasable native engine (a colocated generator) gives its weights' and KV cache's memory
back to the device and maps it again at the same addresses: after release + resume + the weights
written again, a generate replays the kept decode graphs (nothing captured) with the same tokens and
bits as without the release. Twins: weights written with other values after the resume sample other
tokens (the graphs read the remapped memory); a generate before the weights are written is refused."""

import pytest
import torch
from engine_model import PARAMS, engine_model, engine_prompts, same_rollouts

from rlalign import kernels
from rlalign.rollout.native.arena import DeviceArena
from rlalign.rollout.native.engine import NativeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


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
    prompts, ids = engine_prompts(37), list(range(37))
    model = engine_model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    other = engine_model(seed=1).state_dict()
    with kernels.use(mode="deterministic", backend="triton"):
        plain = NativeEngine(engine_model()).generate(
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
    assert same_rollouts(first, plain) and same_rollouts(again, plain)
    assert not same_rollouts(changed, plain) and same_rollouts(kept, changed)


def test_a_state_not_kept_gives_its_arena_back_after_each_call():
    """keep_state=false with a releasable engine: each call's KV arena is closed when it returns (twin:
    a kept state still holds its arena)."""
    from rlalign.rollout.types import EngineConfig

    prompts, ids = engine_prompts(9), list(range(9))
    model = engine_model()
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
