"""kernels.triton.common.Launch off the GPU: a stand-in JIT function and compiled kernel record what
each call passes, so the direct path is checked to hand the launcher exactly what triton's dispatcher
would (tensors, then scalars, then constexprs in signature order; launch options left out), and to
go back through the dispatcher whenever triton would specialise differently or a hook is set."""

import types

import pytest
import torch

from rlalign.kernels.triton import common


def _kernel(x_ptr, y_ptr, n, eps, BLOCK, SIGN):  # the signature shape of the repo's kernels
    pass


class _Compiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn-handle", "packed"
        self.src = types.SimpleNamespace(signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "eps": "fp32",
                                                    "BLOCK": "constexpr", "SIGN": "constexpr"})

    def run(self, *args):
        self.log.append(("direct", args))


class _Jit:
    fn = _kernel

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return _Compiled(self.log)
        return launch


@pytest.fixture
def fake_gpu(monkeypatch):
    rt = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(common, "_runtime", [lambda: 0, lambda dev: 1234, rt])
    return rt


def test_direct_launch_passes_what_the_dispatcher_would(fake_gpu):
    jit = _Jit()
    plan = common.Launch(jit, (7,), (5, 0.5), dict(BLOCK=64, SIGN=-1, num_warps=4))
    x, y = torch.zeros(8), torch.zeros(8)
    plan(x, y)
    plan(x, y)
    assert jit.log[0] == ("jit", (7, 1, 1), (x, y, 5, 0.5), dict(BLOCK=64, SIGN=-1, num_warps=4))
    kind, args = jit.log[1]
    assert kind == "direct" and args[:9] == (7, 1, 1, 1234, "fn-handle", "packed", None, None, None)
    assert args[9] is x and args[10] is y and args[11:] == (5, 0.5, 64, -1)  # num_warps is no argument


def test_other_alignment_or_a_hook_go_back_through_the_dispatcher(fake_gpu):
    jit = _Jit()
    plan = common.Launch(jit, (7,), (5, 0.5), dict(BLOCK=64, SIGN=-1))
    buf = torch.zeros(64)
    plan(buf[:8], buf[8:16])
    plan(buf[1:9], buf[8:16])  # 4-byte offset: triton specialises on 16-byte alignment
    fake_gpu.launch_enter_hook = print
    plan(buf[:8], buf[8:16])
    fake_gpu.launch_enter_hook = types.SimpleNamespace(calls=[print])  # a HookChain holding a hook
    plan(buf[:8], buf[8:16])
    assert [e[0] for e in jit.log] == ["jit", "jit", "jit", "jit"]
    fake_gpu.launch_enter_hook = types.SimpleNamespace(calls=[])  # an empty HookChain (triton >= 3.5)
    plan(buf[:8], buf[8:16])
    plan(buf[1:9], buf[8:16])
    assert [e[0] for e in jit.log[4:]] == ["direct", "direct"]


def test_negative_twin_constexprs_not_last_are_refused(fake_gpu):
    def bad(x_ptr, BLOCK, n):
        pass

    jit = _Jit()
    jit.fn = bad
    plan = common.Launch(jit, (1,), (3,), dict(BLOCK=8))
    with pytest.raises(TypeError, match="must take its constexprs last"):
        plan(torch.zeros(2))

