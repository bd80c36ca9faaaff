"""rlalign: RL post-training where the trainer and the generator agree on every token's logprob.

The design card keeps `kernels/` and `actors/` as top-level folders of the repository; their
import names are `rlalign.kernels` and `rlalign.actors` (setuptools' package-dir maps them when
installed). From a source checkout that is not installed (the GPU machine puts the checkout on
PYTHONPATH), a finder here maps exactly those two names to the two folders; nothing else of the
repository (tests/, experiments/) becomes part of the package.
"""

import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

__version__ = "0.1.0"  # the distribution's version (pyproject.toml reads it)

_ROOT = _Path(__file__).resolve().parent.parent
_FOLDERS = {f"rlalign.{n}": _ROOT / n for n in ("kernels", "actors")}


class _CheckoutFolders:
    """A meta path finder for rlalign.kernels and rlalign.actors in a source checkout."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        folder = _FOLDERS.get(name)
        if folder is None:
            return None
        return _util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])


if not (_Path(__file__).parent / "kernels").is_dir() and all((f / "__init__.py").is_file() for f in _FOLDERS.values()):
    if not any(isinstance(f, _CheckoutFolders) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _CheckoutFolders())
