"""rlalign kernels: the one op set that the generator and the trainer both call.

Two modes behind one switch:
  deterministic  batch-invariant: an output row's bits depend only on that row's inputs (not on
                 batch size, position, padding, prefill vs decode); MoE combine in fp32 in
                 top-k slot order. Backends: torch (CPU/GPU reference), triton (GPU).
  default        the fast vendor path a user would otherwise run (cuBLAS, torch._grouped_mm, SDPA /
                 varlen flash, a split-KV paged decode kernel, torch sampling ops; kernels/torch_default.py
                 lists them): not invariant, the yardstick of the determinism tax.

    kernels.set_mode("deterministic", backend="torch")
    with kernels.use(mode="default"): ...
"""

from __future__ import annotations

import contextlib
import math
import struct
from types import ModuleType
from typing import NamedTuple

import torch

from rlalign.kernels import sampling
from rlalign.kernels import torch_default as _default
from rlalign.kernels import torch_deterministic as _det
from rlalign.kernels.sampling import temper

MODES = ("deterministic", "default")
BACKENDS = ("torch", "triton", "auto")
_state = {"mode": "deterministic", "backend": "torch"}


def set_mode(mode: str | None = None, backend: str | None = None) -> None:
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"kernels.mode={mode!r}: expected one of {MODES}")
        _state["mode"] = mode
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"kernels.backend={backend!r}: expected one of {BACKENDS}")
        _state["backend"] = backend


def configure(mode: str, backend: str, device: str) -> None:
    """A process's op set (kernels.mode, kernels.backend) for `device`; in deterministic mode on CUDA,
    torch's own ops deterministic too (the embedding / index_add backward without atomics), without
    torch's NaN fill of every torch.empty (~4,300 fill launches in a training step on the H200): the
    kernels write every element they return, and the monitor compares bits anyway."""
    set_mode(mode, backend)
    if mode == "deterministic" and device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False


def current() -> dict:
    return dict(_state)


@contextlib.contextmanager
def use(mode: str | None = None, backend: str | None = None):
    saved = dict(_state)
    set_mode(mode, backend)
    try:
        yield
    finally:
        _state.update(saved)


def _impl(x: torch.Tensor) -> ModuleType:
    if _state["mode"] == "default":
        return _default
    backend = _state["backend"]
    if backend == "triton" or (backend == "auto" and x.is_cuda):
        from rlalign.kernels import triton as triton_backend

        return triton_backend.for_tensor(x)
    return _det


def capturable(x: torch.Tensor) -> bool:
    """Whether the ops on x's device run without host syncs (a CUDA graph can capture them): the
    Triton op set on CUDA, and the default op set where its vendor kernels are there (torch._grouped_mm
    with group offsets on the device, the split-KV decode kernel). The torch backend reads MoE group
    sizes on the host."""
    if not x.is_cuda:
        return False
    if _state["mode"] == "default":
        return _default.capturable(x)
    return _state["backend"] in ("triton", "auto")


# --- the op API -----------------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., K] x [N, K] -> [..., N]. Deterministic: fixed K order, bits of a row independent of M."""
    return _impl(x).linear(x, w, bias)


def linears(x: torch.Tensor, ws: list[torch.Tensor], biases: list | None = None) -> list[torch.Tensor]:
    """[linear(x, w_i, b_i) for each i], bit for bit (every column reduces K exactly as `linear`
    does); the Triton backend computes them in one launch where it can (q, k, v of a decode step)."""
    biases = list(biases) if biases is not None else [None] * len(ws)
    if len(biases) != len(ws):
        raise ValueError(f"kernels.linears: {len(ws)} weights but {len(biases)} biases")
    impl = _impl(x)
    fused = getattr(impl, "linears", None)
    if fused is not None:
        return fused(x, list(ws), biases)
    return [impl.linear(x, w, b) for w, b in zip(ws, biases)]


def embedding(weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows weight[tokens]. Its backward sums each token's gradient rows in position order (the
    Triton backend without atomics; torch's index backward on CPU)."""
    return _impl(weight).embedding(weight, tokens)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """Rows sorted by group, group e times w[e]: [R, K] x [E, N, K] -> [R, N]. counts [E]: a host
    list or an integer tensor; on x's device the Triton backend never reads it on the host (no sync),
    the torch backends do (.tolist()). Same bits either way. A tensor may sum to less than R: the rows
    past its sum are padding, their outputs undefined (the fixed-capacity all-to-all's empty slots)."""
    return _impl(x).grouped_linear(x, w, counts)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl(x).rmsnorm(x, w, eps)


def add_rmsnorm(h: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rmsnorm(s, w, eps)) with s = h + a, the residual add: the bits of the add and the norm apart,
    forward and backward; the Triton backend in one pass (one launch each way, no separate add); default
    mode: the two ops as one compiled chain on CUDA."""
    fused = getattr(_impl(h), "add_rmsnorm", None)
    if fused is not None:
        return fused(h, a, w, eps)
    s = h + a
    return s, rmsnorm(s, w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by rows cos/sin [N, D] of `rope_table` (rotate-half convention)."""
    return _impl(x).rope(x, cos, sin)


def rope_table(max_positions: int, head_dim: int, theta: float, device=None):
    """(cos, sin) fp32 [max_positions, head_dim], computed once in fp64: a pure function of the
    arguments, indexed by position on both sides. On the meta device (a model's shapes only) empty
    meta tensors: there are no values to compute, and meta's reference ops import torch._dynamo (~1.4 s)."""
    if torch.empty(0, device=device).is_meta:
        return (torch.empty(max_positions, head_dim, dtype=torch.float32, device=device),) * 2
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _impl(gate).swiglu(gate, up)


def swiglu_halves(h: torch.Tensor) -> torch.Tensor:
    """swiglu(*h.chunk(2, -1)) of h [R, 2I] (gate | up), the same bits; the Triton backend reads the
    halves in place and writes h's gradient directly (no copies of the halves, no concatenation)."""
    impl = _impl(h)
    fused = getattr(impl, "swiglu_halves", None)
    if fused is not None:
        return fused(h)
    gate, up = h.chunk(2, dim=-1)
    return impl.swiglu(gate, up)


def attention_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float | None = None
) -> torch.Tensor:
    """Causal attention over packed sequences: q [N, H, D], k/v [N, Hk, D], cu_seqlens [B+1]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _impl(q).attention_prefill(q, k, v, list(cu_seqlens), scale)


def attention_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """q [B, H, D] against caches [B, C, Hk, D] over positions < lengths[b]. Deterministic mode:
    bitwise equal to the prefill row at position lengths[b] - 1."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _impl(q).attention_decode(q, k_cache, v_cache, lengths, scale)


def attention_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
    runs: list[tuple[int, int, int, int]] | None = None,
) -> torch.Tensor:
    """Attention of query rows of any sequences against a paged KV cache (one layer).

    q [N, H, D]; k_pages/v_pages [P, page_size, Hk, D]; block_table [S, max_pages] int (the pages of
    sequence s in order: key position j lives in page block_table[s, j // page_size] at offset
    j % page_size); seq_idx [N] (each row's sequence); positions [N] (each row's absolute position:
    it attends keys 0..positions[n] of its sequence, its own key already written). Rows may be fresh
    prefill chunks, chunks after a cached prefix, or decode rows, in any mix. Deterministic mode:
    each row bitwise equal to attention_prefill's row at that position. runs: what the caller knows
    on the host about the last rows, (row0, n, pos0, seq) per prompt chunk (rows row0.. are positions
    pos0.. of sequence seq, consecutive, up to row N-1): a schedule hint (the Triton backend runs them
    as prefill tiles), never a change of bits; backends may ignore it."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _impl(q).attention_paged(q, k_pages, v_pages, block_table, seq_idx, positions, scale, runs)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, pages: tuple | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention's inputs after its projections: (rope(rmsnorm(q, q_w, eps), cos, sin), the same of k) for
    q [N, H, D], k [N, Hk, D]. pages = (k_pages, v_pages, slots, v), an engine step: the rotated k and v are
    written into the KV cache (paged_write) and the k returned is None. The same bits as the ops apart; the
    Triton backend without a gradient in one launch (the per-head norms, the two rotations and the cache
    write are five apart)."""
    fused = getattr(_impl(q), "qk_norm_rope", None) if _state["mode"] == "deterministic" else None
    if fused is not None and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, q_w, k_w))) \
            and (pages is None or (pages[0].is_contiguous() and pages[1].is_contiguous()
                                   and pages[0].dtype == pages[1].dtype == q.dtype == pages[3].dtype)):
        return fused(q, k, q_w, k_w, eps, cos, sin, pages)
    if _state["mode"] == "default":  # each norm and its rotation as one compiled chain on CUDA
        q, k = _default.norm_rope(q, q_w, eps, cos, sin), _default.norm_rope(k, k_w, eps, cos, sin)
    else:
        q, k = rope(rmsnorm(q, q_w, eps), cos, sin), rope(rmsnorm(k, k_w, eps), cos, sin)
    if pages is None:
        return q, k
    k_pages, v_pages, slots, v = pages
    paged_write(k_pages, v_pages, slots, k.detach(), v.detach())
    return q, None


def paged_write(k_pages: torch.Tensor, v_pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """The KV-cache write of an engine step (the native engine's and vLLM's): rows k, v [N, Hk, D]
    into slots [N] of k_pages / v_pages [P, page_size, Hk, D] (slot = page * page_size + offset; the
    views may be strided, as vLLM's are). A copy (no bit changes); the Triton backend writes contiguous
    pages in one launch."""
    k, v = k.to(k_pages.dtype), v.to(v_pages.dtype)
    fused = getattr(_impl(k), "paged_write", None)
    if fused is not None and k_pages.is_contiguous() and v_pages.is_contiguous():
        fused(k_pages, v_pages, slots, k, v)
        return
    slots = slots.long()
    page, off = slots // k_pages.shape[1], slots % k_pages.shape[1]
    k_pages[page, off] = k
    v_pages[page, off] = v


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Router logits [T, E] -> (weights [T, k] fp32, experts [T, k]); ties to the lowest id."""
    return _impl(logits).moe_route(logits, top_k, renormalize)


def moe_dispatch(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) rows `flat` [N] (expert ids, token-major) grouped by expert: `order` [N]
    lists them expert by expert, in (token, slot) order within an expert (what a stable sort by
    expert gives), `dest` is its inverse (where each row went) and `counts` [E] the group sizes.
    A counting sort with no host sync (a decode step can be captured in a CUDA graph; EP reads
    the counts on the host for its splits) and no comparison sort: a row's place is its expert's
    start plus the number of earlier rows with the same expert (an integer prefix sum, exact).
    Integers, the same in every mode and backend; where the ops are `capturable` (CUDA), up to MAX_ROWS
    rows (a decode step's) take one launch (kernels/triton/dispatch.py) instead of ~12."""
    if capturable(flat):
        from rlalign.kernels.triton import dispatch as fused

        if flat.numel() <= fused.MAX_ROWS:
            return fused.moe_dispatch(flat, num_experts)
    return _det.moe_dispatch(flat, num_experts)


class _SlotRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, dest, k, grad):
        ctx.save_for_backward(dest)
        ctx.k, ctx.grad = k, grad
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, g):
        (dest,) = ctx.saved_tensors
        return ctx.grad(g, dest, ctx.k), None, None, None, None


def _slot_rows_grad(g: torch.Tensor, dest: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's k slot gradients g[dest[t * k + j]] summed in fp32, slot 0 first: a unit-weight combine."""
    ones = torch.ones(dest.numel() // k, k, dtype=torch.float32, device=g.device)
    return moe_combine(g, ones, rows=dest)


def moe_slot_rows(x: torch.Tensor, order: torch.Tensor, dest: torch.Tensor, k: int) -> torch.Tensor:
    """The experts' input rows: row j is token order[j] // k's row of x [T, D] (order [T*k]: the (token,
    slot) rows grouped by expert, dest its inverse: moe_dispatch). Backward: each token's k slot
    gradients summed in fp32, slot 0 first, one rounding: moe_combine with unit weights over the rows
    g[dest[t * k + j]] (the Triton backend reads them in place: no gathered copy, no separate sum).
    The order is the combine's, defined here, not a library reduction's. Default mode: the gather's
    backward is torch_default.slot_rows_grad (a gather and a sum)."""
    if torch.is_grad_enabled() and x.requires_grad:
        grad = _default.slot_rows_grad if _state["mode"] == "default" else _slot_rows_grad
        return _SlotRows.apply(x, order, dest, int(k), grad)
    return x.index_select(0, torch.div(order, k, rounding_mode="floor"))


def moe_slot_linear(x: torch.Tensor, order: torch.Tensor, dest: torch.Tensor, k: int, w: torch.Tensor,
                    counts: list[int] | torch.Tensor) -> torch.Tensor:
    """grouped_linear(moe_slot_rows(x, order, dest, k), w, counts): the experts' first GEMM over the token
    rows, the same bits forward and backward; the Triton backend (counts on x's device) reads x's rows in
    place in the forward and the weight gradient instead of copying them into [T * k, D]."""
    fused = getattr(_impl(x), "moe_slot_linear", None) if _state["mode"] == "deterministic" else None
    if fused is not None and isinstance(counts, torch.Tensor) and counts.device == x.device:
        return fused(x, order, dest, int(k), w, counts)
    return grouped_linear(moe_slot_rows(x, order, dest, k), w, counts)


def moe_slot_swiglu(x: torch.Tensor, order: torch.Tensor, dest: torch.Tensor, k: int, w: torch.Tensor,
                    counts: list[int] | torch.Tensor) -> torch.Tensor:
    """swiglu_halves(moe_slot_linear(x, order, dest, k, w, counts)) (w [E, 2I, D]: gate | up) -> [T * k, I], the
    same bits; the Triton backend (counts on x's device, no gradient wanted) in one GEMM whose epilogue applies
    the SwiGLU: the [T * k, 2I] product is never written nor read back. With a gradient: the two ops (their
    backward needs the product)."""
    fused = getattr(_impl(x), "moe_slot_swiglu", None) if _state["mode"] == "deterministic" else None
    if fused is not None and isinstance(counts, torch.Tensor) and counts.device == x.device \
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return fused(x, order, dest, int(k), w, counts)
    return swiglu_halves(moe_slot_linear(x, order, dest, k, w, counts))


def grouped_swiglu(x: torch.Tensor, w: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """swiglu_halves(grouped_linear(x, w, counts)) (w [E, 2I, K]: gate | up) -> [R, I], the same bits; the
    Triton backend without a gradient in one GEMM whose epilogue applies the SwiGLU."""
    fused = getattr(_impl(x), "grouped_swiglu", None) if _state["mode"] == "deterministic" else None
    if fused is not None and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return fused(x, w, counts)
    return swiglu_halves(grouped_linear(x, w, counts))


def moe_combine(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, k, D] in top-k slot order -> [T, D]; deterministic: fp32, slot 0 first.
    rows [T*k] (optional): y is [R, D] (the experts' outputs in dispatch order) and slot j of token t
    is y[rows[t*k + j]]; the Triton backend reads them in place (no gathered copy), the same bits."""
    impl = _impl(y)
    if rows is None:
        return impl.moe_combine(y, weights)
    fused = getattr(impl, "moe_combine_rows", None)
    if fused is not None:
        return fused(y, weights, rows)
    return impl.moe_combine(y.index_select(0, rows).view(*weights.shape, y.shape[-1]), weights)


def add_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """a.float() + b.float(), or a.float() + (b.float() + c.float()): fp32 sums of tensors of any float
    dtypes (exact conversions, IEEE adds, the same bits everywhere); the Triton backend reads narrower
    inputs in place and the three-term form without writing b + c (one pass)."""
    fused = getattr(_impl(a), "add_f32", None) if _state["mode"] == "deterministic" else None
    if fused is not None:
        return fused(a, b, c)
    return a.float() + b.float() if c is None else a.float() + (b.float() + c.float())


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """fixed_order.tree_sum(x ** 2, -1) of fp32 x [n] or [rows, n]: the grad norm's sums, the same bits
    everywhere; the Triton backend builds the tree's first four levels in one pass over x, the torch
    one its first level chunk by chunk (neither holds x ** 2)."""
    fused = getattr(_impl(x), "sum_of_squares", None) if _state["mode"] == "deterministic" else None
    return fused(x) if fused is not None else _det.sum_of_squares(x)


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, scalars: torch.Tensor,
           out: torch.Tensor | None = None) -> None:
    """One AdamW update of the fp32 tensors p, m, v in place from gradient g (the definition:
    torch_deterministic.adamw_; scalars fp32 [8] on p's device), out (optional) receiving p rounded
    to its dtype. The same bits in every mode and backend; the Triton one is a single pass."""
    fused = getattr(_impl(p), "adamw_", None) if _state["mode"] == "deterministic" else None
    (fused or _det.adamw_)(p, g, m, v, scalars, out)


def inverse_temperature(temperature: float) -> float:
    """The temperature step's factor: 1 / fp32(temperature), rounded to fp32 (a Python float holding an
    fp32 value; the quotient in double rounds to fp32's correctly rounded quotient)."""
    t = struct.unpack("<f", struct.pack("<f", temperature))[0]
    return struct.unpack("<f", struct.pack("<f", 1.0 / t))[0]


class Tempered(NamedTuple):
    """The tempered, filtered logits a sampler draws from and scores under: temper(logits, scale) [B, V],
    filtered by cut (int64 [B], a top-k / top-p filter's: sampling.apply_cut) when there is one. The
    Triton backend's filter gives the cut, and its consumers apply it as they read the model's logits; the
    other backends' filters write their fp32 output (scale 1 and no cut then). Without a filter, logits
    are the model's, in their dtype, and no backend's consumer needs a copy of them."""

    logits: torch.Tensor
    scale: float = 1.0
    cut: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        """The fp32 values (a gradient flows through the cut's `where` to the kept logits)."""
        v = temper(self.logits, self.scale)
        return v if self.cut is None else sampling.apply_cut(v, self.cut)


def tempered(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tempered:
    """filter(temper(logits, inverse_temperature(temperature))) [B, V]: what `sample` draws from and
    `token_logprobs` scores under (computed once per step by a sampler that needs both: `sample_tempered`,
    `tempered_logprobs`)."""
    scale = 1.0 if temperature == 1.0 else inverse_temperature(temperature)
    if not (top_k and top_k < logits.shape[-1]) and top_p >= 1.0:
        return Tempered(logits, scale)
    impl = _impl(logits)
    cut = getattr(impl, "filter_cut", None)  # the Triton backend: the cut, the consumers apply it
    if cut is not None:
        return Tempered(logits, scale, cut(logits.detach(), top_k, top_p, scale))
    fused = getattr(impl, "filter_logits", None)  # default mode: its own filter
    if fused is not None:
        return Tempered(fused(logits, top_k, top_p, scale))
    return Tempered(sampling.filter_logits(temper(logits, scale), top_k, top_p))


def tempered_logprobs(z: Tempered, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(z.values())[tokens] [N] fp32 for z = tempered(logits, ...)."""
    impl = _impl(z.logits)
    fused = getattr(impl, "tempered_logprobs", None)  # the Triton backend: the logits read in place
    if fused is not None:
        return fused(z.logits, z.scale, tokens, z.cut)
    return impl.log_softmax_gather(z.values(), tokens)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """log p(tokens) [N] fp32 under log_softmax(filter(logits / temperature)): the one logprob
    function of both the generator and the trainer."""
    return tempered_logprobs(tempered(logits, temperature, top_k, top_p), tokens)


def token_logprobs_rows(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """token_logprobs(logits[rows], tokens, ...), the same bits: the trainer's scoring of the response
    rows (rows: distinct indices). The Triton backend writes the logits' gradient directly when the
    filter is the identity (temperature 1, no top-k / top-p)."""
    fused = getattr(_impl(logits), "logprob_rows", None)
    if fused is not None and temperature == 1.0 and not top_k and top_p >= 1.0:
        return fused(logits, rows, tokens)
    return token_logprobs(logits[rows], tokens, temperature, top_k, top_p)


def sample(
    logits: torch.Tensor,
    seed: int,
    sample_ids: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]; noise from (seed, sample id, position) only."""
    z = tempered(logits, 1.0 if greedy else temperature, top_k, top_p)
    return sample_tempered(z, seed, sample_ids, positions, greedy)


def _cut_kw(z: Tempered) -> dict:
    """The cut as a consumer's keyword (the Triton backend's draws take one; default mode's have none)."""
    return {} if z.cut is None else {"cut": z.cut}


def sample_tempered(z: Tempered, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                    greedy: bool = False) -> torch.Tensor:
    """`sample` from z = tempered(logits, ...) (temperature 1.0 when greedy)."""
    if greedy:  # the upcast keeps the order: the first maximum of the logits is the tempered values' (a cut
        # keeps it: top-k's and top-p's cuts are at most its key; a NaN row is an error either way)
        return sampling.first_argmax(z.logits if z.scale == 1.0 else z.values())
    fused = getattr(_impl(z.logits), "gumbel_argmax", None)  # the Triton backend: one kernel, the same tokens
    if fused is not None:
        return fused(z.logits, seed, sample_ids, positions, z.scale, **_cut_kw(z))
    v = z.values()
    return sampling.first_argmax(v + sampling.gumbel(seed, sample_ids, positions, v.shape[-1]))


def sample_tempered_logprobs(z: Tempered, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor,
                             greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, tempered_logprobs(z, tokens)) for tokens = sample_tempered(z, ...), the same bits: the
    sampler's step; the Triton backend draws and scores in one launch."""
    fused = None if greedy else getattr(_impl(z.logits), "gumbel_argmax_logprobs", None)
    if fused is not None:
        return fused(z.logits, seed, sample_ids, positions, z.scale, **_cut_kw(z))
    tok = sample_tempered(z, seed, sample_ids, positions, greedy)
    return tok, tempered_logprobs(z, tok)


def fingerprint_sums(parts) -> torch.Tensor:
    """(A, B) [N, 2] int32 of every result of `parts` (a sequence of kernels.fingerprint.Part; a
    rows part gives one result per dim-0 row), on the parts' device: the raw sums of the one
    fingerprint definition (kernels/fingerprint.py), the same bits on every device and in every
    kernels mode. CUDA: one Triton launch over all parts (per word size); CPU: numpy."""
    from rlalign.kernels import fingerprint as fp

    if not parts:
        return torch.zeros(0, 2, dtype=torch.int32)
    if parts[0].tensor.is_cuda:
        from rlalign.kernels.triton import fingerprint as triton_fp

        return triton_fp.fingerprint_sums(parts)
    return torch.from_numpy(fp.sums_cpu(parts).view("int32"))
