"""Triton backend of the deterministic op set (GPU; CPU tensors under TRITON_INTERPRET=1).

The contract is the torch reference's: the bits of an output row depend only on that row's
inputs. One module per kernel family, each kernel beside its wrapper and its pinned config:
  gemm         matmul, linear, grouped_linear: persistent tiles, no split-K, K reduced in order; grouped_swiglu
               (the SwiGLU in the grouped GEMM's epilogue)
  norm         rmsnorm, add_rmsnorm (+ the ordered column sum of its weight-gradient partials)
  logprob      log_softmax_gather, tempered_logprobs (the logits read in place), logprob_rows (the
               trainer's: its backward writes the logits' gradient)
  attention    attention_prefill, attention_decode, attention_paged (decode == paged == prefill bitwise;
               split-K over fixed key chunks for few rows)
  elementwise  swiglu, swiglu_halves, rope, add_f32 (the gradient trees' fp32 adds), paged_write, qk_norm_rope
               (the attention's head norms, RoPE and KV-cache write in one launch)
  moe          moe_route, moe_combine, moe_slot_linear (the experts' first GEMM over token rows in place),
               moe_slot_swiglu (the same with grouped_swiglu's epilogue)
  sampling     gumbel_argmax (the Gumbel-max draw), gumbel_argmax_logprobs (the draw and its logprob in one launch)
  topp         filter_cut (the top-k/top-p cut key per row: top-k from key-bin counts, top-p from an estimated
               window its exact masses check; then a key search; the draw and the logprob apply it as they
               read the logits)
  optim        adamw_ (the optimizer's update of one tensor in one pass), sum_of_squares (the grad norm's)
  embed        embedding (backward in position order, no atomics)
  fingerprint  fingerprint_sums: the tensor fingerprint's sums over a table of tensors, one launch
  common       input checks, the SM count, the launch-plan cache, INTERPRET

Under the interpreter, tl.dot on bf16 operands returns garbage (triton 3.6/3.9), so operands are
upcast to fp32 there, and smaller tiles are used; interpreted bits are not comparable to GPU bits.
How the pinned configs were measured: experiments/README.md.
"""

from __future__ import annotations

import sys

import torch

from . import attention, common, elementwise, embed, gemm, logprob, moe, norm, optim, sampling, topp
from .attention import ATTN_BWD, ATTN_FWD, attention_decode, attention_paged, attention_prefill
from .common import INTERPRET, SUPPORTED
from .elementwise import add_f32, paged_write, qk_norm_rope, rope, swiglu, swiglu_halves
from .embed import embedding
from .gemm import MATMUL_CONFIGS, grouped_linear, grouped_swiglu, linear, linears, matmul
from .logprob import log_softmax_gather, logprob_rows, tempered_logprobs
from .moe import moe_combine, moe_combine_rows, moe_route, moe_slot_linear, moe_slot_swiglu
from .norm import add_rmsnorm, rmsnorm
from .optim import adamw_, sum_of_squares
from .sampling import gumbel_argmax, gumbel_argmax_logprobs
from .topp import filter_cut

__all__ = [
    "ATTN_BWD", "ATTN_FWD", "INTERPRET", "MATMUL_CONFIGS", "SUPPORTED", "adamw_", "add_f32", "add_rmsnorm",
    "attention",
    "attention_decode", "attention_paged", "attention_prefill", "cached_state", "common", "elementwise", "embed",
    "embedding", "filter_cut", "for_tensor", "gemm", "grouped_linear", "grouped_swiglu",
    "gumbel_argmax", "gumbel_argmax_logprobs", "linear", "linears",
    "log_softmax_gather", "logprob", "logprob_rows", "matmul", "moe", "moe_combine", "moe_combine_rows", "moe_route",
    "moe_slot_linear", "moe_slot_swiglu",
    "norm", "optim", "paged_write", "qk_norm_rope", "rmsnorm", "rope", "sampling", "sum_of_squares", "swiglu",
    "swiglu_halves", "tempered_logprobs", "topp",
]


def cached_state() -> list:
    """What the wrappers keep in module-level caches: work tables, launch plans and their tables, the
    split-K fold's counters. A CUDA graph reads those tensors by address: whoever keeps graphs keeps a
    reference to each, so an LRU eviction or a regrown buffer cannot free memory a graph still reads."""
    return [*common.cached_entries(), *attention.ticket_buffers()]


def for_tensor(x: torch.Tensor):
    """This package (the op API), if it can run on x's device; otherwise a clear error."""
    if x.is_cuda or INTERPRET:
        return sys.modules[__name__]
    raise RuntimeError(
        "kernels.backend=triton needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); "
        "use kernels.backend=torch or auto on this device"
    )
