"""Qwen3-MoE-style decoder built only from `kernels` ops; no parallelism in here.

Tokens travel packed: a forward takes tokens [N] of B sequences delimited by cu_seqlens [B+1]
(the trainer's micro-batches), an engine step takes rows of any sequences (prompt chunks and
decode tokens) with their positions and a paged KV cache (the generator's, native or vLLM).
Parameter names follow Hugging Face's Qwen3MoeForCausalLM, except that each MoE layer stores its
experts fused: gate_up_proj [E, 2I, d], down_proj [E, d, I].
`taps`, when set, is called as x = taps(name, x) at every op boundary (embed, layers.{i}.attn_norm,
.attn, .mlp_norm, .router, .mlp, layers.{i}, norm, logits); rows are the call's tokens in order.
It returns the tensor to continue with (the monitor records fingerprints, fault injection may
perturb); the same names fire in the trainer's forward and in the generator's steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from rlalign import kernels
from rlalign.model.args import ModelArgs

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# a padding row's logit at column 0 (Transformer._head's keep; the others are 0): exact in every dtype above, and far
# enough above 0 at any temperature that the row's top-p cut keeps that one value (its other values' masses are 0)
PAD_LOGIT = 8192.0


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rmsnorm(x, self.weight, self.eps)


class PagedKVCache:
    """Keys/values in pages [L, P, page_size, Hk, D]: the layout block tables address (the native
    engine's and vLLM's). A token's slot is page * page_size + offset (vLLM's slot mapping)."""

    def __init__(self, args: ModelArgs, num_pages: int, page_size: int, dtype, device=None, alloc=None):
        """alloc(shape, dtype): where the pages live (default: torch's allocator); zeroed either way."""
        shape = (args.num_layers, num_pages, page_size, args.num_kv_heads, args.head_dim)
        if alloc is None:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.k, self.v = alloc(shape, dtype).zero_(), alloc(shape, dtype).zero_()
        self.num_pages, self.page_size = num_pages, page_size

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H, Hk, D, d = args.num_heads, args.num_kv_heads, args.head_dim, args.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hk, D
        self.q_proj = Linear(d, H * D, args.attention_bias)
        self.k_proj = Linear(d, Hk * D, args.attention_bias)
        self.v_proj = Linear(d, Hk * D, args.attention_bias)
        self.o_proj = Linear(H * D, d, args.attention_bias)
        self.q_norm = RMSNorm(D, args.rms_norm_eps)
        self.k_norm = RMSNorm(D, args.rms_norm_eps)

    def _qkv(self, x, cos, sin, pages=None):
        """q, k, v [n, heads, D]: projected, q and k normed per head and rotated; pages = (k_pages, v_pages,
        slots): k and v written into the KV cache instead (k returned None), kernels.qk_norm_rope."""
        n = x.shape[0]
        q, k, v = kernels.linears(x, [p.weight for p in (self.q_proj, self.k_proj, self.v_proj)],
                                  [p.bias for p in (self.q_proj, self.k_proj, self.v_proj)])
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = kernels.qk_norm_rope(q.view(n, self.num_heads, self.head_dim),
                                    k.view(n, self.num_kv_heads, self.head_dim), self.q_norm.weight,
                                    self.k_norm.weight, self.q_norm.eps, cos, sin,  # one eps: rms_norm_eps
                                    None if pages is None else (*pages, v))
        return q, k, v

    def forward(self, x, cos, sin, cu_seqlens):
        q, k, v = self._qkv(x, cos, sin)
        o = kernels.attention_prefill(q, k, v, cu_seqlens)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim))

    def paged(self, x, cos, sin, cache, layer: int, block_table, seq_idx, positions, slot_mapping, runs=None):
        k_pages, v_pages = cache.pages(layer)
        q, _, _ = self._qkv(x, cos, sin, (k_pages, v_pages, slot_mapping))
        o = kernels.attention_paged(q, k_pages, v_pages, block_table, seq_idx, positions, runs=runs)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(d, inter), Linear(d, inter), Linear(inter, d)

    def forward(self, x):
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class Experts(nn.Module):
    """Expert weights [E_local, ...]; forward takes rows sorted by expert and their counts.
    rlalign.parallel wraps this module's forward for expert parallelism."""

    def __init__(self, num_experts: int, d: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, d))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d, inter))

    def forward(self, x_sorted: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        return expert_mlp(x_sorted, counts, self.gate_up_proj, self.down_proj)

    def forward_tokens(self, x: torch.Tensor, order: torch.Tensor, dest: torch.Tensor, k: int,
                       counts: list[int] | torch.Tensor) -> torch.Tensor:
        """forward(moe_slot_rows(x, order, dest, k), counts), the same bits: the first GEMM reads the
        token rows of x [T, d] in place (rlalign.parallel's experts send the copied rows instead)."""
        a = kernels.moe_slot_swiglu(x, order, dest, k, self.gate_up_proj, counts)  # silu(gate) * up [R, I]
        return kernels.grouped_linear(a, self.down_proj, counts)


def expert_mlp(x_sorted: torch.Tensor, counts: list[int] | torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over rows sorted by expert: [R, d] -> [R, d]; each row's bits are its own.
    counts [E]: a host list or a tensor on the rows' device (kept there: no host sync)."""
    return kernels.grouped_linear(kernels.grouped_swiglu(x_sorted, gate_up, counts), down, counts)


class Router(nn.Module):
    def __init__(self, num_experts: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = args.num_experts, args.top_k, args.norm_topk_prob
        self.gate = Router(args.num_experts, args.hidden_size)
        self.experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size)

    def forward(self, x: torch.Tensor, tap=None) -> torch.Tensor:
        k = self.top_k
        logits = kernels.linear(x, self.gate.weight)
        if tap is not None:
            logits = tap("router", logits)
        weights, ids = kernels.moe_route(logits, k, self.norm_topk_prob)
        order, dest, counts = kernels.moe_dispatch(ids.reshape(-1), self.num_experts)
        y_sorted = self.experts.forward_tokens(x, order, dest, k, counts)  # row j: token order[j] // k
        return kernels.moe_combine(y_sorted, weights, rows=dest)  # slot j of token t: y_sorted[dest[t*k + j]]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MoE(args) if args.is_moe_layer(i) else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Embedding(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d))


class Body(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # fp32 tables kept out of the module's buffers so .to(dtype) never rounds them
        self._rope_table = kernels.rope_table(args.max_position_embeddings, args.head_dim, args.rope_theta)
        self.taps: Callable[[str, torch.Tensor], torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def init_weights(self, seed: int, std: float = 0.02) -> Transformer:
        """Deterministic random init: normal(0, std) matrices, ones for norms, drawn from a generator
        on the parameters' device (a pure function of seed, shapes and device type)."""
        dev = next(self.parameters()).device
        g = torch.Generator(device=dev).manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32, device=dev) * std)
        return self

    def _tap(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x if self.taps is None else self.taps(name, x)

    def _quiet(self) -> bool:
        """No tap records or changes anything: an add and the norm after it may run as one op."""
        return self.taps is None or bool(getattr(self.taps, "inert", False))

    def _add_norm(self, h, r, norm: RMSNorm, h_name: str | None, x_name: str):
        """(h + r tapped as h_name, norm of it tapped as x_name); r None: h as it is. One fused op when the
        taps are quiet (kernels.add_rmsnorm: the same bits)."""
        if r is not None and self._quiet():
            return kernels.add_rmsnorm(h, r, norm.weight, norm.eps)
        if r is not None:
            h = h + r if h_name is None else self._tap(h_name, h + r)
        return h, self._tap(x_name, norm(h))

    def _block(self, i: int, layer: DecoderLayer, h: torch.Tensor, r: torch.Tensor | None, attend):
        """One decoder layer around `attend(x)` (packed prefill or paged attention), tapped per op. r: the
        previous layer's MLP output, added to the residual h here (with the input norm); returns (h, this
        layer's MLP output) for the next layer or the head to add."""
        h, x = self._add_norm(h, r, layer.input_layernorm, f"layers.{i - 1}", f"layers.{i}.attn_norm")
        a = self._tap(f"layers.{i}.attn", attend(x))
        h, x = self._add_norm(h, a, layer.post_attention_layernorm, None, f"layers.{i}.mlp_norm")
        if isinstance(layer.mlp, MoE):
            m = layer.mlp(x, tap=lambda name, t: self._tap(f"layers.{i}.{name}", t))
        else:
            m = layer.mlp(x)
        return h, self._tap(f"layers.{i}.mlp", m)

    def _layers(self, h: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor | None]:
        r = None
        for i, layer in enumerate(self.model.layers):
            h, r = self._block(i, layer, h, r, functools.partial(attend, i, layer))
        return h, r

    def _head(self, h: torch.Tensor, r: torch.Tensor | None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the final norm of h + r; rows where `keep` [N] bool is False get PAD_LOGIT at column 0
        and exactly zero elsewhere (their normed rows zeroed before the lm head: a product of zeros; a pass
        over [N, d] and one column instead of [N, vocab]; the other rows' bits are untouched). One value far
        above the rest is every sampler's cheapest row: an all-tied row is the top-p cut's costliest (the
        window holds the whole row, and the cut takes its retries and exact bins)."""
        _, x = self._add_norm(h, r, self.model.norm, f"layers.{len(self.model.layers) - 1}", "norm")
        if keep is None:
            return self._tap("logits", self.lm_head(x))
        logits = self.lm_head(torch.where(keep[:, None], x, 0.0))
        logits[:, 0] = torch.where(keep, logits[:, 0], PAD_LOGIT)
        return self._tap("logits", logits)

    def _check_positions(self, last: int) -> None:
        if last >= self.args.max_position_embeddings:
            raise ValueError(
                f"position {last} exceeds the model's context "
                f"(max_position_embeddings={self.args.max_position_embeddings})"
            )

    def rope_table_to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope table (cos, sin) on `device`, moved there once (a step reads it there; a CUDA graph
        captures its address)."""
        cos, sin = self._rope_table
        if cos.device != device:
            self._rope_table = cos, sin = cos.to(device), sin.to(device)
        return cos, sin

    def _rope(self, positions: torch.Tensor):
        """cos/sin rows [N, D] for positions (lengths are checked by the callers, on the host)."""
        cos, sin = self.rope_table_to(positions.device)
        return cos[positions], sin[positions]

    def forward(self, tokens: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """Packed causal forward (the trainer's): tokens [N] -> logits [N, V]."""
        cu_seqlens = [int(c) for c in cu_seqlens]
        lens = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        positions = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.long)
        self._check_positions(max(lens, default=0) - 1)  # on the host: no device read
        if tokens.is_cuda:  # from pinned memory: an asynchronous copy (a pageable one waits for the stream)
            positions = positions.pin_memory().to(tokens.device, non_blocking=True)
        cos, sin = self._rope(positions.to(tokens.device))
        h = self._tap("embed", kernels.embedding(self.model.embed_tokens.weight, tokens))
        h, r = self._layers(h, lambda i, layer, x: layer.self_attn(x, cos, sin, cu_seqlens))
        return self._head(h, r)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, seq_idx: torch.Tensor, cache,
             block_table: torch.Tensor, slot_mapping: torch.Tensor,
             logit_rows: torch.Tensor | None = None, runs: list[tuple[int, int, int, int]] | None = None,
             keep: torch.Tensor | None = None) -> torch.Tensor:
        """One engine step over a paged cache: rows [N] of any mix of prefill chunks and decode
        tokens (tokens, absolute positions, sequence index into block_table, cache slot to write).
        `cache` has write(layer, slot_mapping, k, v) and pages(layer) (PagedKVCache, or an engine's
        view of its own pages). Returns logits of `logit_rows` (default: every row). Each row's
        bits equal the trainer's forward row at that position (batch invariance). runs: the prompt
        chunks among the last rows, as the host knows them (kernels.attention_paged's schedule hint).
        keep [N] bool (with every row's logits): rows whose logits are PAD_LOGIT at column 0 and zero elsewhere (a
        decode graph's padding rows: any value they computed, even a non-finite one, never reaches the sampler)."""
        cos, sin = self._rope(positions)  # engines check lengths at admission: no host sync
        h = self._tap("embed", kernels.embedding(self.model.embed_tokens.weight, tokens))
        h, r = self._layers(h, lambda i, layer, x: layer.self_attn.paged(
            x, cos, sin, cache, i, block_table, seq_idx, positions, slot_mapping, runs))
        if logit_rows is not None:
            if r is not None and not self._quiet():  # the last layer's tap sees every row
                h, r = self._tap(f"layers.{len(self.model.layers) - 1}", h + r), None
            h = h.index_select(0, logit_rows)
            r = None if r is None else r.index_select(0, logit_rows)
        return self._head(h, r, keep)


def build_model(args: ModelArgs, dtype: str | torch.dtype = "bfloat16", seed: int | None = 0,
                device=None) -> Transformer:
    """A model with deterministic random weights (seed) or uninitialised ones (seed=None), built
    directly on `device` (large models never pass through CPU memory)."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device(device or "cpu"):
        model = Transformer(args)
    if seed is not None:
        model.init_weights(seed)
    return model.to(dtype=dt)
