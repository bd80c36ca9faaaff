"""The names rlalign's vLLM pieces are registered and selected under, and their registration
(run in the driver and, through rollout/vllm/worker.py, in every process that builds the model).
Names only: nothing here imports rlalign's vLLM modules."""

from __future__ import annotations

ARCH = "RlalignQwen3MoeForCausalLM"
BACKEND = "RLALIGN_PAGED"
SAMPLER = "rlalign.rollout.vllm.sampler:RlalignSampler"
WORKER_EXTENSION = "rlalign.rollout.vllm.worker.WorkerExtension"
KEY = "rlalign"  # SamplingParams.extra_args key of rlalign's per-request sampling


def register() -> None:
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "rlalign.rollout.vllm.model:RlalignQwen3MoeForCausalLM")
    if BACKEND not in AttentionBackendEnum.__members__:
        register_backend(BACKEND, "rlalign.rollout.vllm.attention.RlalignAttentionBackend")
