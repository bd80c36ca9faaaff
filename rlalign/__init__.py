"""rlalign: RL post-training where the trainer and the generator agree on every token's logprob.

The design card keeps `kernels/` and `actors/` as top-level folders of the repository; their
import names are `rlalign.kernels` and `rlalign.actors` (setuptools' package-dir maps them when
installed). From a source checkout that is not installed (the GPU machine puts the checkout on
PYTHONPATH), the same two folders are added to this package's search path here.
"""

from pathlib import Path as _Path

_root = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "kernels").is_dir() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 (a package's __path__)
