"""rlalign's Qwen3-MoE as an out-of-tree vLLM model: an rlalign `Transformer` run through
`Transformer.step` over vLLM's KV pages (rlalign/rollout/vllm/attention.py), so every row's
bits are the trainer's whatever vLLM batched, chunked or took from its prefix cache.

Selected with hf_overrides={"architectures": [ARCH], ...}; the overrides also carry the kernel
mode (`rlalign_kernels`) because vLLM's workers are separate processes. Under tensor-parallel
workers (generator.ep_size = N) attention is replicated and each worker owns 1/N of every MoE
layer's experts: rlalign's expert parallelism (rlalign.parallel.ep) over vLLM's worker group.

vLLM samples only the last row of each request's chunk. `forward` computes logits for exactly
those rows (the attention metadata names them) and returns, as its "hidden states", each row's
index into those logits (-1 elsewhere); `compute_logits` gathers by that index, so the LM head
never runs on rows nobody samples and vLLM's row selection is checked, not assumed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tp_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention

from rlalign import kernels
from rlalign.model import ModelArgs, Transformer
from rlalign.monitor.taps import attach_taps, set_rows
from rlalign.parallel.ep import apply_ep
from rlalign.rollout.vllm import sampler
from rlalign.rollout.vllm.attention import RlalignAttentionBackend, VllmPages
from rlalign.rollout.vllm.registry import ARCH
from rlalign.rollout.vllm.weights import load_named

__all__ = ["ARCH", "RlalignQwen3MoeForCausalLM", "load_named"]


class RlalignQwen3MoeForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        mode, backend = getattr(hf, "rlalign_kernels", ("deterministic", "torch"))
        kernels.set_mode(mode, backend)
        cfg = {k: v for k, v in hf.to_dict().items() if not k.startswith("rlalign_")}
        cfg["architectures"] = ["Qwen3MoeForCausalLM"]
        self.args = ModelArgs.from_hf_config(cfg, where=f"vLLM model config ({vllm_config.model_config.model})")
        self.rl = Transformer(self.args)
        # the monitor's taps, as in the native generator: per-token row fingerprints keyed by
        # (sample id, position) when switched on (rows), injected faults (rlalign.faults: RLALIGN_FAULT,
        # which vLLM's processes inherit from the generator actor)
        self.recorder = attach_taps(self.rl, "generator")
        tp = get_tp_group()
        self.ep_rank, self.ep_size = tp.rank_in_group, tp.world_size
        self.ep_group = tp.device_group if self.ep_size > 1 else None
        if self.ep_group is not None:
            apply_ep(self.rl, self.ep_group)
        a = self.args
        self.attn = nn.ModuleList(
            Attention(a.num_heads, a.head_dim, a.head_dim ** -0.5, a.num_kv_heads,
                      cache_config=vllm_config.cache_config, prefix=f"{prefix}attn.{i}",
                      attn_backend=RlalignAttentionBackend)
            for i in range(a.num_layers))
        self._logits: torch.Tensor | None = None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return kernels.embedding(self.rl.model.embed_tokens.weight, input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds=None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise ValueError("rlalign's vLLM model takes token ids only (no embeddings, no pipeline stages)")
        n_rows = input_ids.shape[0]
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta.get(self.attn[0].layer_name)
        index = torch.full((n_rows, 1), -1, dtype=torch.long, device=input_ids.device)
        if meta is None:  # vLLM's dummy/profiling run: no pages to read
            self._logits = None
            return index
        n = meta.num_actual_tokens
        if self.recorder.rows:
            ids = torch.tensor(sampler.sample_ids(meta.query_start_loc.numel() - 1), dtype=torch.long)
            set_rows(self.rl, "gen.", list(zip(ids[meta.seq_idx.cpu()].tolist(), positions[:n].tolist())))
        cache = VllmPages([layer.kv_cache for layer in self.attn], self.args.head_dim)
        self._logits = self.rl.step(input_ids[:n], positions[:n], meta.seq_idx, cache, meta.block_table,
                                    meta.slot_mapping, logit_rows=meta.logit_rows)
        index[meta.logit_rows, 0] = torch.arange(meta.logit_rows.numel(), device=index.device)
        return index

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rows = hidden_states[:, 0]
        if self._logits is None:
            return torch.zeros(rows.numel(), self.args.vocab_size, dtype=self.rl.dtype, device=rows.device)
        if rows.numel() and int(rows.min()) < 0:
            raise RuntimeError("vLLM asked for logits of a row that is not the last of its request's chunk")
        return self._logits.index_select(0, rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF-named tensors (experts one by one or fused) or rlalign's names; under EP only this
        worker's experts are kept. Returns the names of the parameters loaded (vLLM checks them)."""
        return load_named(self.rl, weights, self.ep_rank, self.ep_size, prefix="rl.")
