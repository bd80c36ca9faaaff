"""Every Triton kernel reads only globals the GPU compiler accepts: modules, other jit functions, builtins and
tl.constexpr values. The interpreter (the CPU tests) reads any Python global, so a kernel reading a plain int
passes every CPU test and fails to compile on the GPU (NameError: "Cannot access global variable"); this
finds it without a GPU."""

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import triton
import triton.language as tl

import rlalign.kernels.triton as triton_kernels

PLAIN_GLOBAL = 7  # the negative twin's global: a plain int, which the GPU compiler refuses


def _free_names(fn) -> dict[str, int]:
    """Names a function's body loads but never binds (its arguments, assignments, loop targets), with a line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    bound = {a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)}
    loads = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                bound.add(node.id)
            else:
                loads.setdefault(node.id, node.lineno)
    return {n: line for n, line in loads.items() if n not in bound}


def _is_jit(value) -> bool:
    """A @triton.jit function: a JITFunction, or under TRITON_INTERPRET the interpreter's wrapper of one."""
    return type(value).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(value, "fn")


def _refused(value) -> bool:
    if isinstance(value, (types.ModuleType, tl.constexpr)) or _is_jit(value):
        return False
    return not getattr(value, "__triton_builtin__", False)


def refused_globals(jit_fn) -> list[str]:
    fn = jit_fn.fn
    out = []
    for name, line in _free_names(fn).items():
        if name in fn.__globals__:
            if _refused(fn.__globals__[name]):
                out.append(f"{fn.__module__}.{fn.__name__} (line {line} of its body) reads the global {name} = "
                           f"{fn.__globals__[name]!r}: make it a tl.constexpr or pass it as an argument")
        elif not hasattr(builtins, name):
            out.append(f"{fn.__module__}.{fn.__name__} reads {name}, which is not defined")
    return out


def _kernels():
    for info in pkgutil.iter_modules(triton_kernels.__path__):
        module = importlib.import_module(f"{triton_kernels.__name__}.{info.name}")
        for value in vars(module).values():
            if _is_jit(value) and value.fn.__module__ == module.__name__:
                yield value


def test_every_triton_kernel_reads_only_globals_the_gpu_compiler_accepts():
    kernels = list(_kernels())
    assert len(kernels) > 40  # every module's kernels were found
    assert not (offences := [o for k in kernels for o in refused_globals(k)]), "\n".join(offences)


@triton.jit
def _reads_a_plain_global(x_ptr):
    tl.store(x_ptr, PLAIN_GLOBAL)


@triton.jit
def _reads_a_constexpr(x_ptr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), tl.full((N,), _TWIN_CONST, tl.int32))


_TWIN_CONST = tl.constexpr(3)


def test_a_kernel_reading_a_plain_global_is_found():
    assert refused_globals(_reads_a_constexpr) == []
    found = refused_globals(_reads_a_plain_global)
    assert len(found) == 1 and "PLAIN_GLOBAL" in found[0]
