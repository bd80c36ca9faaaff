"""A vLLM attention backend whose pages hold rlalign's layout and whose math is
`kernels.attention_paged` (each row bitwise equal to the trainer's prefill row).

vLLM allocates one tensor per layer, logically [num_blocks, Hk, block_size, 2 * D] (its
`[B, H, N, C]` view, strided by whatever KV cache layout vLLM resolved). A token's content row
holds its key in [:D] and its value in [D:]; `pages()` views the tensor as rlalign's
[P, page_size, Hk, D] keys and values without copying, and `write()` stores through vLLM's slot
mapping (slot = page * page_size + offset). vLLM schedules (block tables, slot mapping, query
start locations); this module only turns its metadata into the rows' sequence index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from rlalign.rollout.vllm.registry import BACKEND


def page_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-layer cache [P, Hk, page_size, 2D] -> (keys, values) views [P, page_size, Hk, D]."""
    if kv_cache.shape[-1] != 2 * head_dim:
        raise ValueError(f"vLLM KV cache rows have {kv_cache.shape[-1]} elements, expected 2 * head_dim = "
                         f"{2 * head_dim} (key then value)")
    pages = kv_cache.transpose(1, 2)
    return pages[..., :head_dim], pages[..., head_dim:]


class VllmPages:
    """The `cache` of Transformer.step over vLLM's per-layer KV tensors (pages(layer), like
    rlalign.model.PagedKVCache; the step writes them with kernels.qk_norm_rope)."""

    def __init__(self, kv_caches: list[torch.Tensor], head_dim: int):
        self.views = [page_views(t, head_dim) for t in kv_caches]

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views[layer]


@dataclass
class RlalignAttentionMetadata:
    num_actual_tokens: int
    seq_idx: torch.Tensor  # [N] each row's request index into block_table
    positions: torch.Tensor  # [N] each row's absolute position (its context length + offset in the chunk)
    block_table: torch.Tensor  # [num_reqs, max_pages] int32
    slot_mapping: torch.Tensor  # [N]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    logit_rows: torch.Tensor  # [num_reqs] the last row of each request's chunk (the rows vLLM samples)


class RlalignAttentionMetadataBuilder(AttentionMetadataBuilder[RlalignAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RlalignAttentionMetadata:
        m = common_attn_metadata
        n, qsl = m.num_actual_tokens, m.query_start_loc[: m.num_reqs + 1].long()
        q_lens = qsl[1:] - qsl[:-1]
        seq_idx = torch.repeat_interleave(torch.arange(m.num_reqs, device=qsl.device), q_lens)[:n]
        context = m.seq_lens[: m.num_reqs].long() - q_lens  # keys before each request's chunk
        positions = context[seq_idx] + torch.arange(n, device=qsl.device) - qsl[seq_idx]
        return RlalignAttentionMetadata(num_actual_tokens=n, seq_idx=seq_idx, positions=positions,
                                        block_table=m.block_table_tensor, slot_mapping=m.slot_mapping[:n],
                                        query_start_loc=qsl, logit_rows=qsl[1:] - 1)


class RlalignAttentionImpl(AttentionImpl):
    """What vLLM builds for each Attention layer: the layers only make vLLM allocate the per-layer
    KV tensors. The model never calls them: RlalignQwen3MoeForCausalLM runs Transformer.step over
    VllmPages, which writes with kernels.qk_norm_rope (paged_write's copy) and attends with kernels.attention_paged."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **extra) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise ValueError("the rlalign attention backend has no ALiBi, sliding window or soft cap")
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads
        self.kv_sharing_target_layer_name = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        raise RuntimeError("rlalign's vLLM model attends through Transformer.step over VllmPages, not through "
                           "vLLM's Attention layers")


class RlalignAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND

    @staticmethod
    def get_impl_cls() -> type[RlalignAttentionImpl]:
        return RlalignAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RlalignAttentionMetadataBuilder]:
        return RlalignAttentionMetadataBuilder
