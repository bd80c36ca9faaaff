"""Shared by the Triton kernel modules: the interpreter switch, dtype/device checks, the SM count,
one LRU cache of work tables and launch plans, `Launch` (a plan's kernel called without triton's
per-call dispatch) and the interpreter's matrix product."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROW_BLOCK = 1024  # rmsnorm / logprob / combine chunk along the row
SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def host_free_dot(a, b):
    """a @ b in fp32 for the interpreter (the kernels' UPCAST branch), with bits that do not depend on
    the host. The interpreter's tl.dot is numpy's matmul, i.e. the host's BLAS, whose summation order
    follows the kernel it picks for the CPU (OpenBLAS: Haswell and Sandybridge kernels give other bits
    for one row as the matrix around it changes). Here every product is exact in fp64 (two 24-bit
    significands fit in 53), numpy's add sums them along K in an order fixed by the shape alone, and
    the sum is rounded to fp32 once. A tile's bits stay a function of its own row and column."""
    return tl.sum(a.to(tl.float64)[:, :, None] * b.to(tl.float64)[None, :, :], axis=1).to(tl.float32)


@triton.jit
def bf16_bits(x):
    """The bf16 bits (uint32 holding 16) of fp32 x rounded to nearest even, from x's bits: what a GPU's
    cvt.rn gives and torch's .to(bfloat16); the interpreter's own cast truncates. NaN: a quiet NaN."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r)


_MUL_RN = tl.constexpr(not INTERPRET)


@triton.jit
def upcast_scaled(x, scale, SCALED: tl.constexpr):
    """rlalign.kernels.temper's values in registers: fp32(x) (exact), times the fp32 scale when SCALED,
    rounded once (IEEE mul.rn on the GPU: no later add of a kernel compiled with FP fusion contracts it
    into an FMA; the interpreter rounds every op)."""
    x = x.to(tl.float32)
    if SCALED:
        if _MUL_RN:
            x = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, scale], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            x = x * scale
    return x


@triton.jit
def order_key(z):
    """rlalign.kernels.sampling.order_keys of fp32 z: int32 keys ordered like the values (-0 and +0 one key)."""
    bits = (z + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def apply_cut(z, cut):
    """The filtered value of fp32 z under its row's cut (int64; rlalign.kernels.sampling.apply_cut): z where
    its order key is >= cut or z is NaN, -inf elsewhere: what the top-k/top-p filter writes, and what its
    consumers compute in registers from the cut."""
    return tl.where((order_key(z).to(tl.int64) >= cut) | (z != z), z, float("-inf"))


def check_inputs(name: str, *ts: torch.Tensor) -> None:
    """Every tensor of op `name` in a supported dtype, all on one device; else a clear error."""
    device = ts[0].device
    for t in ts:
        if t.dtype not in SUPPORTED:
            raise TypeError(f"triton {name}: dtype {t.dtype} is not supported ({', '.join(map(str, SUPPORTED))})")
        if t.device != device:
            raise ValueError(f"triton {name}: tensors on different devices {sorted({str(u.device) for u in ts})}")


def num_sms(device) -> int:
    """Streaming multiprocessors of device (4 off the GPU: the interpreter's stand-in)."""
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_CACHE: OrderedDict = OrderedDict()  # work tables and GEMM launch plans, by content (LRU)


def cached(key: tuple, build):
    """build() once per key (LRU of 4096): a training step calls the same shapes layer after layer,
    so the host work per launch is one lookup and no host-to-device copy."""
    v = _CACHE.get(key)
    if v is None:
        v = _CACHE[key] = build()
        if len(_CACHE) > 4096:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return v


def cached_entries() -> list:
    """Everything the cache holds (work tables, launch plans and their tables): a CUDA graph reads those
    tensors by address, so a holder of graphs keeps a reference to each."""
    return list(_CACHE.values())


def host_table(rows: list, dtype, device) -> torch.Tensor:
    """rows as a tensor on device, copied from pinned memory: the copy stays asynchronous (one from
    pageable memory first waits for the stream to drain, a host sync per new table)."""
    t = torch.tensor(rows, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def work_table(key: tuple, build, device) -> torch.Tensor:
    """The device tensor of build() -> (list of int rows, dtype), cached by key."""
    def make():
        rows, dtype = build()
        return host_table(rows, dtype, device)
    return cached((key, device), make)


_runtime: list = []  # [current device, current raw stream, knobs.runtime], resolved on first use


def _runtime_fns():
    if not _runtime:
        from triton import knobs
        from triton.runtime import driver

        device = getattr(torch._C, "_cuda_getDevice", None) or driver.active.get_current_device
        stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or driver.active.get_current_stream
        _runtime.extend([device, stream, knobs.runtime])
    return _runtime


def _no_hook(hook) -> bool:
    """None, or an empty HookChain (triton >= 3.5): nothing to call, so none is passed."""
    return not getattr(hook, "calls", hook)


class Launch:
    """A launch plan: one kernel with its grid, scalar arguments and constexprs fixed by the shapes it
    was built for (the kernels take their tensors first, then scalars, then constexprs), so a call
    passes only the tensors. The first call per (device, 16-byte alignment of each tensor; with the
    dtypes, fixed by the plan's key, what triton specialises a tensor on) goes through triton's JIT
    (which compiles); later calls
    call that compiled kernel directly with the same arguments, skipping the dispatcher's binding,
    specialisation key and cache lookup. Same compiled kernel, same arguments: same bits. Launch hooks
    (profilers) or the interpreter take the JIT path every time. The plan's cache key must fix every
    tensor's dtype (a call keys only on the device and the alignments)."""

    __slots__ = ("fn", "grid", "scalars", "meta", "tail", "compiled")

    def __init__(self, fn, grid: tuple, scalars: tuple, meta: dict):
        self.fn, self.scalars, self.meta = fn, tuple(scalars), meta
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.tail = None  # scalars + constexpr values in signature order, built on the first fast call
        self.compiled = {}

    def _constexprs(self) -> tuple:
        code = getattr(self.fn, "fn", self.fn).__code__
        names = code.co_varnames[: code.co_argcount]
        consts = [n for n in names if n in self.meta]  # the rest of meta: launch options (num_warps...)
        if names[len(names) - len(consts):] != tuple(consts):
            raise TypeError(f"Launch: {code.co_name} must take its constexprs last ({names})")
        return tuple(self.meta[n] for n in consts)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if INTERPRET:
            self.fn[self.grid](*tensors, *self.scalars, **self.meta)
            return
        get_device, get_stream, rt = _runtime_fns()
        device = get_device()
        key = (device, *[t.data_ptr() & 15 == 0 for t in tensors])
        hit = self.compiled.get(key)
        if hit is None or not (_no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)):
            k = self.fn[self.grid](*tensors, *self.scalars, **self.meta)
            if self.tail is None:  # triton >= 3.4 passes constexprs to the launcher too (it skips them)
                with_consts = "constexpr" in getattr(getattr(k, "src", None), "signature", {}).values()
                self.tail = self.scalars + (self._constexprs() if with_consts else ())
            self.compiled[key] = (k.run, k.function, k.packed_metadata)
            return
        run, function, packed = hit
        g0, g1, g2 = self.grid
        run(g0, g1, g2, get_stream(device), function, packed, None, None, None, *tensors, *self.tail)
