"""The code's shape: in product code (SHAPED) no function over 80 lines and no file over 600 lines outside
Triton kernel bodies (@triton.jit functions); in PUBLIC_ONLY no module reaching into another module's
_private names (imported, or as an attribute of an imported module of ours)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPED = ("kernels", "rlalign", "actors")
PUBLIC_ONLY = ("kernels", "experiments", "rlalign", "actors")
# tools whose subject is the kernels' compiled form (registers, spills, SASS): they name the private JIT functions
KERNEL_INSPECTORS = {Path("experiments/kernels") / f"sass_{n}.py" for n in ("topp", "attention", "gemm")}
MAX_FUNCTION, MAX_FILE = 80, 600


def _is_kernel(node) -> bool:
    return any(getattr(d.func if isinstance(d, ast.Call) else d, "attr", None) == "jit" for d in node.decorator_list)


def shape_offences(path: Path, text: str) -> list[str]:
    """Functions over MAX_FUNCTION lines and a file over MAX_FILE lines, Triton kernel bodies not counted."""
    out, kernel_lines = [], 0
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1 + len(node.decorator_list)
            if _is_kernel(node):
                kernel_lines += n
            elif n > MAX_FUNCTION:
                out.append(f"{path}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION})")
    lines = len(text.splitlines()) - kernel_lines
    if lines > MAX_FILE:
        out.append(f"{path}: {lines} lines outside Triton kernels (at most {MAX_FILE})")
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_offences(path: Path, text: str) -> list[str]:
    """`from x import _y`, and `m._y` where m was bound by an import of one of our modules (rlalign, a
    relative import, or a sibling script of experiments/)."""
    tree = ast.parse(text)
    siblings = {p.stem for p in (ROOT / path).parent.glob("*.py")}
    if path.parts[0] == "experiments":  # a group folder's scripts import experiments/record.py too
        siblings |= {p.stem for p in (ROOT / "experiments").glob("*.py")}
    ours, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mine = node.level > 0 or (node.module or "").split(".")[0] in {"rlalign", *siblings}
            for a in node.names:
                if _private(a.name):
                    out.append(f"{path}:{node.lineno} imports {a.name} from {node.module or '.'}")
                elif mine:
                    ours.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in {"rlalign", *siblings}:
                    ours.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ours:
                out.append(f"{path}:{node.lineno} uses {ast.unparse(node)}")
    return out


def _offences(folders, check, skip=frozenset()) -> list[str]:
    files = [f.relative_to(ROOT) for d in folders for f in sorted((ROOT / d).rglob("*.py"))]
    files = [f for f in files if f not in skip]
    return [o for f in files for o in check(f, (ROOT / f).read_text())]


def test_no_long_functions_or_files_in_product_code():
    assert not (offences := _offences(SHAPED, shape_offences)), "\n".join(offences)


def test_no_module_uses_another_modules_private_names():
    assert not (offences := _offences(PUBLIC_ONLY, private_offences, KERNEL_INSPECTORS)), "\n".join(offences)


def test_negative_twins_are_found(tmp_path):
    long_fn = "def f():\n" + "    x = 1\n" * 80
    kernel = "import triton\n@triton.jit\ndef k():\n" + "    x = 1\n" * 700
    assert shape_offences(Path("a.py"), long_fn) and not shape_offences(Path("k.py"), kernel)
    assert shape_offences(Path("b.py"), "x = 1\n" * 601)
    (tmp_path / "helper.py").write_text("")
    bad = tmp_path / "bad.py"
    assert private_offences(bad, "from rlalign.kernels.triton.common import _check\n")
    assert private_offences(bad, "from .common import _cached\n")
    assert private_offences(bad, "from rlalign.kernels.triton import common\ncommon._CACHE.clear()\n")
    assert private_offences(bad, "import helper\nhelper._x = 1\n")
    assert private_offences(Path("experiments/rl/x.py"), "import record\nrecord._git('x')\n")
    assert private_offences(bad, "import rlalign.training.trainer as tr\ntr.Trainer._collect_leaves = None\n")
    assert not private_offences(bad, "import torch\ntorch._grouped_mm\nfrom rlalign import kernels\nkernels.use\n")
