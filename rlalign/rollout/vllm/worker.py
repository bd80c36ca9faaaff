"""What vLLM loads in each process that builds the model: the worker extension (methods called by
name through collective_rpc), and with it the registration of rlalign's model and attention
backend. vLLM imports this module (worker_extension_cls) before it builds the model, so the
registration needs no installed entry point (the GPU machine runs a checkout from PYTHONPATH)."""

from __future__ import annotations

import safetensors.torch

from rlalign.fingerprint import state_fingerprints
from rlalign.parallel.ep import full_state_dict
from rlalign.rollout.vllm.registry import register

register()


class WorkerExtension:
    """Methods vLLM mixes into each of its workers (worker_extension_cls), called by name through
    collective_rpc. Weights travel as one safetensors blob (bytes: no pickled tensors, which vLLM's
    worker broadcast cannot carry)."""

    def rlalign_load_weights(self, blob: bytes) -> int:
        state = safetensors.torch.load(blob)
        self.model_runner.model.load_weights(state.items())
        return len(state)

    def rlalign_fingerprints(self) -> dict[str, str] | None:
        """Every worker takes part (experts gathered over the EP group); the first returns the
        fingerprints of the full state it now computes with (rlalign names)."""
        model = self.model_runner.model
        full = full_state_dict(model.rl, model.ep_group)
        return state_fingerprints({k: v.cpu() for k, v in full.items()}) if model.ep_rank == 0 else None

    def rlalign_record_rows(self, on: bool) -> None:
        self.model_runner.model.recorder.rows = on

    def rlalign_pop_rows(self) -> list:
        """The recorded row fingerprints as [sample id, position, {tap: fingerprint}] (msgpack-able)."""
        return [[sid, pos, fps] for (sid, pos), fps in self.model_runner.model.recorder.pop_table().items()]
