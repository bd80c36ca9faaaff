"""Static SASS of the product's Triton kernels for sm_90, without a GPU: the launches the product code makes are
captured (run on CPU tensors of the real shapes, nothing executed), specialised as triton's JIT specialises them at
run time, compiled for sm_90 and disassembled (cuobjdump). The tools sass_topp.py, sass_attention.py and
sass_gemm.py use it.

The JIT's specialisation matters: an integer argument divisible by 16 and a 16-byte-aligned pointer carry
`tt.divisibility = 16`, and an integer equal to 1 becomes a constant. Without them the compiler cannot prove a load
aligned: it emits narrow loads, no async copies, and more address registers (kernels that fit at run time spill).
A kernel compiled from hand-written argument types shows a kernel that never runs.

Run with the Triton the GPU machine has (3.6: `python -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
torch==2.13.0`, then a .pth file in its site-packages naming .venv's site-packages for the rest).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# instruction families counted per loop
FAMILIES = {"fp32": ("FMUL", "FADD", "FFMA"), "vote": ("VOTE",), "barrier": ("BAR",), "load": ("LDG",),
            "atomic": ("ATOM", "RED"), "convert": ("F2I", "I2F", "FRND", "F2F"), "select": ("SEL", "FSEL"),
            "spill_store": ("STL",), "spill_load": ("LDL",), "wgmma": ("HGMMA",), "async_copy": ("LDGSTS", "UTMALDG")}
OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
H100_SMS = 132


class CapturedLaunch:
    """One captured launch: the kernel, its arguments by name (tensors, scalars, constexprs) and its options."""

    def __init__(self, fn: JITFunction, args: tuple, kwargs: dict):
        self.fn = fn
        self.options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
        named = dict(zip(fn.arg_names, args))
        named.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
        for p in fn.params:
            if p.name not in named and p.has_default:
                named[p.name] = p.default
        missing = [n for n in fn.arg_names if n not in named]
        if missing:
            raise TypeError(f"{fn.__name__}: launch without {missing}")
        self.args = named

    @property
    def name(self) -> str:
        return self.fn.__name__

    def source(self, args: dict | None = None) -> ASTSource:
        """The launch (with `args` in place of its own) as triton's JIT would compile it: each non-constexpr
        argument specialised on its value."""
        args = self.args if args is None else args
        sig, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(self.fn.params):
            v = args[p.name]
            if p.is_constexpr:
                sig[p.name], constexprs[(i,)] = "constexpr", v
                continue
            ty, spec = native_specialize_impl(
                BaseBackend, v, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment)[:2]
            sig[p.name] = ty
            if ty == "constexpr":
                constexprs[(i,)] = spec
            elif isinstance(spec, str) and spec:
                attrs[(i,)] = BaseBackend.parse_attr(spec)
        return ASTSource(fn=self.fn, signature=sig, constexprs=constexprs, attrs=attrs)

    def compile(self, **override):
        """The launch compiled for sm_90; `override` replaces constexprs or options (a candidate config)."""
        options = {**self.options, **{k: v for k, v in override.items() if k in OPTIONS}}
        args = {**self.args, **{k: v for k, v in override.items() if k not in OPTIONS}}
        return triton.compile(self.source(args), target=GPUTarget("cuda", 90, 32), options=options)


@contextmanager
def captured(sms: int = H100_SMS):
    """Collects the Triton launches made inside the block, without running them (outputs stay uninitialised).
    Launch plans (kernels/triton/common.Launch) go through the JIT path; the SM count the schedules read is `sms`."""
    from rlalign.kernels.triton import attention, common, gemm

    out: list[CapturedLaunch] = []

    def run(self, *args, grid, warmup, **kwargs):
        out.append(CapturedLaunch(self, args, kwargs))

    def plan_call(self, *tensors):
        self.fn[self.grid](*tensors, *self.scalars, **self.meta)

    patches = [mock.patch.object(JITFunction, "run", run), mock.patch.object(common.Launch, "__call__", plan_call)]
    patches += [mock.patch.object(m, "num_sms", lambda device: sms) for m in (common, attention, gemm)
                if hasattr(m, "num_sms")]
    for p in patches:
        p.start()
    try:
        yield out
    finally:
        for p in reversed(patches):
            p.stop()


def sass_stats(kernel) -> dict:
    """Registers, stack, shared memory, instruction families and each loop's (a backward branch closes one)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    usage = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    ins = [(int(m.group(1), 16), m.group(3)) for line in sass.splitlines()
           if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9.]+)", line))]
    text = {a: line for line in sass.splitlines() if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line))
            for a in [int(m.group(1), 16)]}
    loops = []
    for a, op in ins:
        m = re.search(r"BRA (?:!?U?P\w+, )?0x([0-9a-f]+)", text[a]) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) <= a:
            start = int(m.group(1), 16)
            ops = Counter(op.split(".")[0] for b, op in ins if start <= b <= a)
            loops.append({"start": hex(start), "instructions": sum(ops.values()),
                          **{fam: sum(ops[o] for o in ops if o.startswith(p)) for fam, p in FAMILIES.items()}})
    whole = Counter(op.split(".")[0] for _, op in ins)
    return {**usage, "instructions": len(ins), **{fam: sum(whole[o] for o in whole if o.startswith(p))
                                                  for fam, p in FAMILIES.items()}, "loops": loops}


def spec_of(launch: CapturedLaunch) -> dict:
    """The specialisation a launch compiles with: argument -> 'D' (divisible by 16), 'const' or ''."""
    src = launch.source()
    idx = {i: n for i, n in enumerate(launch.fn.arg_names)}
    return {idx[i[0]]: ("D" if a else "") for i, a in src.attrs.items()} | {
        idx[i[0]]: "const" for i in src.constants if not launch.fn.params[i[0]].is_constexpr}


def cpu_tensor(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    """An uninitialised CPU tensor (a captured launch reads only its shape, strides, dtype and alignment)."""
    return torch.empty(*shape, dtype=dtype)
