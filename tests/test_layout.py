"""The house shows its design: import names under rlalign. (No import circle: tests/test_layers.py.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_top_level_kernels_or_actors_import_names():
    pattern = re.compile(r"^\s*(import (kernels|actors)\b|from (kernels|actors)\b)", re.M)
    offenders = [str(f.relative_to(ROOT)) for d in ("rlalign", "kernels", "actors", "tests", "experiments")
                 for f in (ROOT / d).rglob("*.py") if pattern.search(f.read_text())]
    assert offenders == []
    assert pattern.search("from kernels import sampling\n")  # negative twin: the old form is caught
