"""The house shows its design: import names under rlalign, no import circle among the modules."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the design card's top-level folders and their import names
PACKAGES = {"rlalign": ROOT / "rlalign", "rlalign.kernels": ROOT / "kernels", "rlalign.actors": ROOT / "actors"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of ours imported at module level (imports inside functions run later: no circle)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.parse(path.read_text()).body:
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_circle_among_our_modules():
    mods = _modules()
    graph = {name: _top_level_imports(path, name, set(mods)) for name, path in mods.items()}
    # a package importing its own submodules is how packages work, not a circle
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    assert find_cycle(graph) is None, find_cycle(graph)
    # negative twin: the circle that parallel/launch <-> training/trainer once had is found
    twin = {**graph, "rlalign.parallel.launch": graph["rlalign.parallel.launch"] | {"rlalign.training.trainer"}}
    assert find_cycle(twin) is not None


def test_no_top_level_kernels_or_actors_import_names():
    pattern = re.compile(r"^\s*(import (kernels|actors)\b|from (kernels|actors)\b)", re.M)
    offenders = [str(f.relative_to(ROOT)) for d in ("rlalign", "kernels", "actors", "tests", "experiments")
                 for f in (ROOT / d).rglob("*.py") if pattern.search(f.read_text())]
    assert offenders == []
    assert pattern.search("from kernels import sampling\n")  # negative twin: the old form is caught
