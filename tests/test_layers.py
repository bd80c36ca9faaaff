"""The layers of ARCHITECTURE.md hold: no import in rlalign/, actors/ or kernels/ runs from a lower
layer to a higher one, none runs between the groups of one layer (rollout and training stand beside
each other), and no modules import each other in a circle (module-level and function-level imports
alike, everywhere); `generator.backend` is read in one function, and only kernels/ and actors/ join
the package. Each check has a negative twin: the same check fed modules that break it. (Private
names across modules, function and file sizes: tests/test_code_shape.py.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"rlalign": ROOT / "rlalign", "rlalign.kernels": ROOT / "kernels", "rlalign.actors": ROOT / "actors"}


def _layer_groups() -> list[list[list[str]]]:
    """The layer list of ARCHITECTURE.md's "Layers" section, lowest first: one indented line per
    layer, `N  name, name | name, ...` (module names under rlalign), whose `|` splits the layer into
    groups that stand beside each other."""
    section = (ROOT / "ARCHITECTURE.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    lines = re.finditer(r"^ {4}(\d+) {2,}(.+)$", section, re.M)
    return [[[f"rlalign.{n.strip()}" for n in g.split(",")] for g in m[2].split("|")] for m in lines]


def _layers() -> list[list[str]]:
    return [[n for group in layer for n in group] for layer in _layer_groups()]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _imports(tree: ast.AST, name: str, is_pkg: bool) -> list[tuple[int, str, list[str]]]:
    """Every import in the module, at any depth: (line, imported module, the names taken from it)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                anchor = parts[: len(parts) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.append((node.lineno, base, [a.name for a in node.names]))
    return out


def _resolve(target: str, known: set[str]) -> str | None:
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def layer_of(module: str, layers: list[list[str]]) -> int:
    if module == "rlalign":  # the package's __init__: it imports nothing of ours
        return 0
    best, where = -1, None
    for i, names in enumerate(layers):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, where = len(n), i
    if where is None:
        raise AssertionError(f"{module}: in no layer of ARCHITECTURE.md's layer list; add it there")
    return where


def edges(sources: dict[str, tuple[str, bool]]) -> list[tuple[str, int, str]]:
    """(module, line, module of ours it imports) for every import, at any depth, in module order."""
    known, out = set(sources), []
    for name, (text, is_pkg) in sorted(sources.items()):
        for line, base, taken in _imports(ast.parse(text), name, is_pkg):
            for target in sorted({_resolve(f"{base}.{t}", known) or _resolve(base, known) for t in taken or [""]}
                                 - {None, name}):
                out.append((name, line, target))
    return out


def upward_imports(sources: dict[str, tuple[str, bool]], layers: list[list[str]]) -> list[str]:
    """'module:line imports target (layer i -> j)' for every import of ours that runs upward."""
    bad = []
    for name, line, target in edges(sources):
        here, there = layer_of(name, layers), layer_of(target, layers)
        if there > here:
            bad.append(f"{name}:{line} imports {target} (layer {here} -> {there})")
    return bad


def _in(module: str, names: list[str]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def sideways_imports(sources: dict[str, tuple[str, bool]], groups: list[list[list[str]]]) -> list[str]:
    """'module:line imports target (layer i: group a -> b)' for every import between two groups of one
    layer (`rollout | training`: beside each other, neither imports the other)."""
    layers, bad = [[n for g in layer for n in g] for layer in groups], []
    for name, line, target in edges(sources):
        here = layer_of(name, layers)
        if name == "rlalign" or layer_of(target, layers) != here or len(groups[here]) == 1:
            continue
        mine, theirs = ([i for i, g in enumerate(groups[here]) if _in(m, g)] for m in (name, target))
        if mine and theirs and mine != theirs:
            bad.append(f"{name}:{line} imports {target} (layer {here}: group {mine[0]} -> {theirs[0]})")
    return bad


def import_cycle(sources: dict[str, tuple[str, bool]]) -> list[str] | None:
    """The first circle of modules importing each other ([a, b, ..., a]), counting the imports inside
    functions too (a lazy import hides a circle from the interpreter, not from the design), or None."""
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, _, target in edges(sources):
        graph[name].add(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        path.pop()
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def backend_readers(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """'module.function' of each function that reads the generator.backend config key: `.backend`,
    `["backend"]` or `.get("backend")` of `<x>.generator` / `<x>["generator"]` or of a local bound to
    one, or the string "generator.backend" in code."""
    out = set()
    for name, (text, _) in sources.items():
        tree = ast.parse(text)
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for fn in funcs:
            local = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) for t, v in _bindings(n)
                     if _is_generator(v)}
            gen = lambda node, local=local: _is_generator(node) or (isinstance(node, ast.Name) and node.id in local)  # noqa: E731
            for n in ast.walk(fn):
                if (_reads_backend(n, gen) or isinstance(n, ast.Call) and any(
                        isinstance(a, ast.Constant) and a.value == "generator.backend" for a in n.args)):
                    out.add(f"{name}.{fn.name}")
    return sorted(out)


def _bindings(node: ast.Assign) -> list[tuple[ast.AST, ast.AST]]:
    """(name, value) pairs of an assignment, tuples unpacked (`a, g = x, cfg.generator`)."""
    pairs = []
    for t in node.targets:
        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
            pairs += [(a, b) for a, b in zip(t.elts, node.value.elts) if isinstance(a, ast.Name)]
        elif isinstance(t, ast.Name):
            pairs.append((t, node.value))
    return pairs


def _reads_backend(n: ast.AST, gen) -> bool:
    if isinstance(n, ast.Attribute) and n.attr == "backend":
        return gen(n.value)
    if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "backend":
        return gen(n.value)
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and gen(n.func.value)
            and bool(n.args) and isinstance(n.args[0], ast.Constant) and n.args[0].value == "backend")


def _is_generator(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "generator") or (
        isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "generator")


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple[str, bool]]:
    return {n: (f.read_text(), f.name == "__init__.py") for n, f in _modules().items()}


def test_the_layer_list_names_every_module(sources):
    layers = _layers()
    assert len(layers) >= 6 and layers[0] == ["rlalign.kernels"]
    for name in sources:
        layer_of(name, layers)


def test_no_import_runs_up_the_layers(sources):
    assert upward_imports(sources, _layers()) == []


def test_rollout_and_training_stand_beside_each_other(sources):
    groups = _layer_groups()
    assert any(len(layer) > 1 for layer in groups)  # the list has groups at all: the check can fail
    assert sideways_imports(sources, groups) == []


def test_negative_twin_an_import_between_rollout_and_training_is_named(sources):
    groups = _layer_groups()
    planted = dict(sources)
    text, is_pkg = sources["rlalign.training.trainer"]
    planted["rlalign.training.trainer"] = (text + "\n\ndef f():\n    from rlalign.rollout.types import check_prompts\n",
                                           is_pkg)
    assert [b.split(" (")[0] for b in sideways_imports(planted, groups)] == [
        f"rlalign.training.trainer:{len(text.splitlines()) + 4} imports rlalign.rollout.types"]


def test_no_import_circle_counting_imports_inside_functions(sources):
    assert import_cycle(sources) is None


def test_negative_twin_two_modules_importing_each_other_are_a_circle(sources):
    pair = {"rlalign.a": ("from rlalign import b\n", False),
            "rlalign.b": ("def f():\n    from rlalign.a import g\n", False)}
    assert import_cycle(pair) == ["rlalign.a", "rlalign.b", "rlalign.a"]
    assert import_cycle({"rlalign.a": pair["rlalign.a"]}) is None  # one way only: no circle
    planted = dict(sources)  # the circle state <-> trainer once had, through a lazy import
    text, is_pkg = sources["rlalign.training.state"]
    planted["rlalign.training.state"] = (text + "\n\ndef f():\n    from rlalign.training.trainer import Trainer\n",
                                         is_pkg)
    cycle = import_cycle(planted)
    assert cycle is not None and {"rlalign.training.state", "rlalign.training.trainer"} <= set(cycle)


def test_negative_twin_an_upward_import_is_named(sources):
    layers = _layers()
    planted = dict(sources)
    planted["rlalign.config"] = (sources["rlalign.config"][0] + "\n\ndef f():\n    from rlalign.rl import train\n",
                                 False)
    assert [b.split(":")[0] for b in upward_imports(planted, layers)] == ["rlalign.config"]
    planted["rlalign.config"] = (sources["rlalign.config"][0] + "\nfrom rlalign.rollout import types\n", False)
    assert any("imports rlalign.rollout.types" in b for b in upward_imports(planted, layers))


def test_generator_backend_is_read_in_one_function(sources):
    assert backend_readers(sources) == ["rlalign.generator_world.generator_world"]


@pytest.mark.parametrize("body", [
    "    g = cfg.generator\n    return 1 if g.backend == 'vllm' else g.ep_size\n",
    "    return 1 if cfg['generator'].get('backend') == 'vllm' else 2\n",  # a saved config's dict
    "    n, g = 2, cfg['generator']\n    return 1 if g['backend'] == 'vllm' else n\n",
])
def test_negative_twin_a_second_backend_reader_is_found(sources, body):
    planted = dict(sources, **{"rlalign.extra": (f"def ranks(cfg):\n{body}", False)})
    assert backend_readers(planted) == ["rlalign.extra.ranks", "rlalign.generator_world.generator_world"]


def test_only_kernels_and_actors_join_the_package():
    import importlib.util

    assert importlib.util.find_spec("rlalign.kernels") is not None  # twin: the two folders do
    assert importlib.util.find_spec("rlalign.actors") is not None
    assert importlib.util.find_spec("rlalign.tests") is None and importlib.util.find_spec("rlalign.experiments") is None
