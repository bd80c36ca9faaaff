"""kernels.mode=default: the fast vendor path a user would otherwise run, NOT batch-invariant. It is the
twin the deterministic mode is measured against (the determinism tax), so it must be the fastest honest
version of each op, in the model dtype, the way vLLM / Hugging Face / torchtitan run them:

  linear          F.linear (cuBLAS / oneDNN)
  grouped_linear  torch._grouped_mm (CUTLASS grouped GEMM, group offsets on the device: no host sync)
  attention       prefill and training: SDPA, causal, GQA by enable_gqa (torch's backend choice, or
                  SDPA_BACKENDS: cuDNN on the H200); ragged batches padded when that adds at most 25 % (cuDNN
                  takes no ragged batch), else varlen flash attention; engine decode: a split-KV
                  paged kernel (kernels/triton/splitkv.py, flash-decoding); engine prompt chunks: the keys
                  gathered from the pages, then the prefill path
  rmsnorm         F.rms_norm (fused on CUDA)
  MoE             gather of the token rows into expert slots, its backward a gather and a sum per token (no
                  atomic index_add_); combine a batched GEMV of the top-k weights (torchtitan's bmm), its
                  backward writing each slot row's gradient once (dispatch's rows are a permutation)
  elementwise     rope, q/k rmsnorm + rope, swiglu / swiglu_halves, residual add + rmsnorm and the MoE combine
                  through torch.compile(dynamic=True) on CUDA (`Compiled`, as torchtitan compiles each block:
                  one generated kernel per chain and direction); eager torch ops on CPU
  sampling        torch ops: top-k / top-p by sort + cumsum (vLLM's torch sampler), the draw as an
                  exponential race over softmax (probs / Exp(1) noise, argmax) from torch's RNG
  AdamW           torch._fused_adamw_ (rlalign/training/optimizer.py)
The native engine captures its decode steps in CUDA graphs in this mode too (`capturable`; where it cannot,
`graphs_missing` says why); its warm-up step before each capture compiles the chains, and inside a capture
only code compiled before runs.

Where a vendor kernel is missing (a CPU, no Triton, an old GPU, a dtype it does not take, a compile that
fails) the op runs the next fastest path and says so in one logged line per (op, reason), never silently."""

from __future__ import annotations

import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("rlalign.kernels")
SDPA_BACKENDS: list | None = None  # None: torch's own choice; else a priority list of SDPBackend
LOGGED_FALLBACKS: set[tuple[str, str]] = set()
BROKEN_PATHS: dict[str, str] = {}  # vendor paths that raised once: (reason) -> not tried again


def fallback(op: str, why: str, instead: str) -> None:
    """One logged line per (op, reason): a vendor kernel is missing and `instead` runs. In a process group
    rank 0 says it (a warning) for its peers, which run on the same kind of machine (a debug line each)."""
    if (op, why) not in LOGGED_FALLBACKS:
        LOGGED_FALLBACKS.add((op, why))
        dist = torch.distributed
        peer = dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
        log.log(logging.DEBUG if peer else logging.WARNING, "kernels.mode=default: %s: %s; running %s instead",
                op, why, instead)


def capturable(x) -> bool:
    """Whether this op set runs on x's device without host syncs: the grouped GEMM takes its group offsets
    on the device and the split-KV decode kernel is there (model dtype x: the lm head's weight)."""
    return graphs_missing(x) is None


def graphs_missing(x) -> str | None:
    """Why the engine cannot capture this op set's steps in CUDA graphs on x's device (None: it can)."""
    if not x.is_cuda:
        return "CUDA graphs need CUDA"
    why = _grouped_mm_missing(x, x)
    if why is not None:
        return why
    try:
        from rlalign.kernels.triton import splitkv  # noqa: F401
    except ImportError:
        return "the split-KV decode kernel needs Triton"
    return None


def linear(x, w, bias=None):
    return F.linear(x, w, bias)


def embedding(weight, tokens):
    return F.embedding(tokens, weight)


# --- grouped GEMM ----------------------------------------------------------------------------------------
def _grouped_mm_missing(x, w) -> str | None:
    """Why torch._grouped_mm cannot run these operands (None: it can)."""
    if "grouped_mm" in BROKEN_PATHS:
        return BROKEN_PATHS["grouped_mm"]
    if not x.is_cuda:
        return "torch._grouped_mm needs CUDA"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "torch._grouped_mm needs sm90 or newer"
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"torch._grouped_mm takes bfloat16 (got {x.dtype} x {w.dtype})"
    if (x.shape[-1] * 2) % 16 or (w.shape[1] * 2) % 16:
        return "torch._grouped_mm needs 16-byte aligned rows"
    return None


def grouped_linear(x, w, counts: list[int] | torch.Tensor):
    """[R, K] x [E, N, K] -> [R, N], rows grouped by expert. Rows past sum(counts): padding (undefined)."""
    why = _grouped_mm_missing(x, w)
    if why is None:
        c = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts)
        offs = c.to(x.device, non_blocking=True).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    fallback("grouped_linear", why, "a loop of F.linear per expert")
    return grouped_linear_loop(x, w, counts)


def grouped_linear_loop(x, w, counts):
    if isinstance(counts, torch.Tensor):  # split sizes on the host (a sync on a GPU)
        counts = counts.tolist()
    counts = [*counts, x.shape[0] - sum(counts)]  # rows past the groups: padding, zeros out
    outs = [F.linear(xe, w[e]) if e < w.shape[0] else xe.new_zeros(xe.shape[0], w.shape[1])
            for e, xe in enumerate(torch.split(x, counts)) if xe.shape[0]]
    return torch.cat(outs, 0) if outs else F.linear(x[:0], w[0])  # stays in the autograd graph


# --- torch.compile of the elementwise chains (CUDA) ------------------------------------------------------
class Compiled:
    """fn through torch.compile(fn, dynamic=True) on CUDA tensors, as torchtitan compiles each block: an
    elementwise chain runs as one generated kernel each way instead of a launch (and a tensor) per op. CPU
    tensors run `eager` (default fn). Inside a CUDA graph capture only code compiled before runs (stance
    eager_on_recompile: nothing is traced, compiled or autotuned in a capture; the engine's warm-up step
    before each capture compiles it). A compile that raises is logged once and `eager` runs from then on."""

    def __init__(self, name: str, fn, eager=None):
        self.name, self.fn, self.eager, self.compiled = name, fn, eager or fn, None

    def __call__(self, *args):
        key = f"compile {self.name}"
        if not args[0].is_cuda:
            fallback("elementwise chains", "torch.compile of them runs on CUDA only", "eager torch ops")
            return self.eager(*args)
        if key in BROKEN_PATHS:
            return self.eager(*args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=True)
            if torch.cuda.is_current_stream_capturing():
                with torch.compiler.set_stance("eager_on_recompile"):
                    return self.compiled(*args)
            return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (any compiler failure: the eager ops are the same function)
            BROKEN_PATHS[key] = f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            fallback(self.name, BROKEN_PATHS[key], "eager torch ops")
            return self.eager(*args)


# --- elementwise and norms -------------------------------------------------------------------------------
def rmsnorm(x, w, eps: float):
    if x.dtype == w.dtype:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def _add_rmsnorm(h, a, w, eps: float):
    s = h + a
    return s, rmsnorm(s, w, eps)


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rot * sin


def _norm_rope(x, w, eps: float, cos, sin):
    return _rope(rmsnorm(x, w, eps), cos, sin)


def _swiglu(gate, up):
    return F.silu(gate) * up


def _swiglu_halves(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


add_rmsnorm = Compiled("add_rmsnorm", _add_rmsnorm)  # (h + a, rmsnorm of it): the residual add and the norm
rope = Compiled("rope", _rope)  # x [N, H, D] by cos/sin [N, D] (rotate-half), in x's dtype
norm_rope = Compiled("norm_rope", _norm_rope)  # rope(rmsnorm(x, w, eps), cos, sin): the q / k head norms
swiglu = Compiled("swiglu", _swiglu)
swiglu_halves = Compiled("swiglu_halves", _swiglu_halves)  # swiglu(*h.chunk(2, -1)) of h [R, 2I]


# --- attention -------------------------------------------------------------------------------------------
def _sdpa_causal(q, k, v, scale: float):
    """Causal SDPA of [B, T, H(k), D] views (no mask: flash and cuDNN take it)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if SDPA_BACKENDS is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


PAD_LIMIT = 1.25  # ragged batches padded at most this much run cuDNN's SDPA (1.6-1.8x torch's varlen flash, H200)


def _cudnn_sdpa(q) -> bool:
    """Whether SDPA has its cuDNN backend for q here (sm90+, bf16 / fp16)."""
    return (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and q.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(q.device) >= (9, 0))


def _varlen(q, k, v, cu_seqlens: list[int], max_len: int, scale: float):
    """Flash attention over the packed sequences (torch.nn.attention.varlen), or None where it is missing."""
    why = BROKEN_PATHS.get("varlen")
    if why is None and not q.is_cuda:
        why = "varlen flash attention needs CUDA"
    if why is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            why = f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if why is not None:
        fallback("attention_prefill", why, "SDPA over sequences padded to the longest")
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {"scale": scale, **({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})}
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    cu = torch.tensor(cu_seqlens, dtype=torch.int32).to(q.device, non_blocking=True)
    try:
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    except RuntimeError as e:  # e.g. a head count or dtype it does not take: not tried again
        BROKEN_PATHS["varlen"] = f"varlen flash attention failed ({str(e).splitlines()[0][:160]})"
        return _varlen(q, k, v, cu_seqlens, max_len, scale)


def attention_prefill(q, k, v, cu_seqlens: list[int], scale: float):
    """Causal attention over packed sequences q [N, H, D], k/v [N, Hk, D]."""
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(cu_seqlens) - 1)]
    if not lens or q.shape[0] == 0:
        return q.clone()
    B, T, N = len(lens), max(lens), q.shape[0]
    if all(n == T for n in lens):  # one length: [B, T] views, no padding
        return _sdpa_causal(*(t.view(B, T, *t.shape[1:]) for t in (q, k, v)), scale).reshape(q.shape)
    if not (q.is_cuda and _cudnn_sdpa(q) and B * T <= PAD_LIMIT * N):  # cuDNN takes no ragged batch here
        o = _varlen(q, k, v, cu_seqlens, T, scale)
        if o is not None:
            return o
    idx = torch.cat([torch.arange(n) + b * T for b, n in enumerate(lens)]).to(q.device)  # row -> padded slot
    padded = [t.new_zeros(B * T, *t.shape[1:]).index_copy(0, idx, t).view(B, T, *t.shape[1:]) for t in (q, k, v)]
    return _sdpa_causal(*padded, scale).reshape(B * T, *q.shape[1:]).index_select(0, idx)[:N]


def attention_decode(q, k_cache, v_cache, lengths, scale: float):
    C = k_cache.shape[1]
    mask = (torch.arange(C, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q[:, :, None], k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[2])
    return o[:, :, 0]


def _fresh_tail(runs, n_rows: int) -> tuple[int, list]:
    """(first row, runs) of the trailing prompt chunks that start at position 0: their keys are their own
    rows, so they run as prefill."""
    tail, fresh = n_rows, []
    for row0, n, pos0, seq in sorted(runs or (), reverse=True):
        if pos0 != 0 or row0 + n != tail:
            break
        tail = row0
        fresh.insert(0, (n, seq))
    return tail, fresh


def _prefill_from_pages(q, k_pages, v_pages, block_table, fresh: list, scale: float):
    """Prompt chunks of fresh sequences (n rows each: positions 0..n-1): keys gathered from the pages."""
    ps = k_pages.shape[1]
    seq = torch.cat([torch.full((n,), s) for n, s in fresh]).to(q.device, non_blocking=True)
    pos = torch.cat([torch.arange(n) for n, _ in fresh]).to(q.device, non_blocking=True)
    page = block_table[seq, pos // ps].long()
    k, v = k_pages[page, pos % ps], v_pages[page, pos % ps]
    cu = [0]
    for n, _ in fresh:
        cu.append(cu[-1] + n)
    return attention_prefill(q, k.to(q.dtype), v.to(q.dtype), cu, scale)


def _decode_rows(q, k_pages, v_pages, block_table, seq_idx, positions, scale: float, out):
    why = None if q.is_cuda else "the split-KV decode kernel needs CUDA"
    if why is None:
        try:
            from rlalign.kernels.triton import splitkv
        except ImportError:
            why = "the split-KV decode kernel needs Triton"
    if why is None and k_pages.stride(-1) == 1 and k_pages.stride() == v_pages.stride():
        splitkv.paged_decode(q, k_pages, v_pages, block_table, seq_idx, positions, scale, out=out)
        return
    fallback("attention_paged", why or "the split-KV kernel takes k and v pages of one layout",
             "SDPA over keys gathered from the pages")
    from rlalign.kernels.torch_deterministic import gather_pages

    n_keys = int(positions.max()) + 1
    valid = (torch.arange(n_keys, device=q.device)[None, :] <= positions[:, None])[:, :, None, None]
    k, v = (torch.where(valid, gather_pages(p, block_table, seq_idx, n_keys), 0) for p in (k_pages, v_pages))
    out.copy_(attention_decode(q, k, v, positions + 1, scale))  # (slots past a row's keys: zeros, not garbage)


def attention_paged(q, k_pages, v_pages, block_table, seq_idx, positions, scale: float, runs=None):
    """Decode rows (and prompt chunks after a cached prefix) through the split-KV kernel; trailing fresh
    prompt chunks (runs starting at position 0) as prefill over their keys gathered from the pages."""
    N = q.shape[0]
    if N == 0:
        return q.clone()
    out = torch.empty_like(q)
    tail, fresh = _fresh_tail(runs, N)
    if tail < N:
        out[tail:] = _prefill_from_pages(q[tail:], k_pages, v_pages, block_table, fresh, scale)
    if tail > 0:
        _decode_rows(q[:tail], k_pages, v_pages, block_table, seq_idx[:tail], positions[:tail], scale, out[:tail])
    return out


# --- MoE, logprobs, sampling -----------------------------------------------------------------------------
def moe_route(logits, top_k: int, renormalize: bool):
    probs = torch.softmax(logits.float(), -1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


def moe_combine(y, weights):
    """y [T, k, D], weights [T, k] -> [T, D]: one batched GEMV in y's dtype (cuBLAS), torchtitan's combine."""
    return torch.bmm(weights.to(y.dtype)[:, None], y)[:, 0]


def _combine_rows_bmm(y, w, rows):
    """sum_j w[t, j] * y[rows[t * k + j]] -> [T, D]: the rows gathered, one batched GEMV (cuBLAS)."""
    T, k = w.shape
    return torch.bmm(w.to(y.dtype)[:, None], y.index_select(0, rows).view(T, k, y.shape[-1]))[:, 0]


def _combine_rows_sum(y, w, rows):
    """The same, written for one generated kernel: the gathered rows weighted in fp32, summed, one rounding."""
    T, k = w.shape
    return (y.index_select(0, rows).view(T, k, y.shape[-1]).float() * w.float()[..., None]).sum(1).to(y.dtype)


def _combine_rows_grads_bmm(g, y, w, rows):
    """(dy, dw) of the combine: dy[rows[t * k + j]] = w[t, j] g[t] (rows distinct: each written once, a copy,
    no atomics; rows no slot reads stay zero), dw[t, j] = <g[t], y[rows[t * k + j]]>."""
    T, k = w.shape
    g = g.to(y.dtype)
    dw = torch.bmm(y.index_select(0, rows).view(T, k, y.shape[-1]), g[:, :, None])[..., 0]
    dys = torch.bmm(w.to(y.dtype)[..., None], g[:, None])  # [T, k, D]
    return y.new_zeros(y.shape).index_copy_(0, rows, dys.view(T * k, y.shape[-1])), dw.to(w.dtype)


def _combine_rows_grads_sum(g, y, w, rows):
    T, k = w.shape
    gf = g.float()[:, None]  # [T, 1, D]
    dw = (y.index_select(0, rows).view(T, k, y.shape[-1]).float() * gf).sum(-1)
    dys = (gf * w.float()[..., None]).to(y.dtype).view(T * k, y.shape[-1])
    return y.new_zeros(y.shape).index_copy(0, rows, dys), dw.to(w.dtype)


def _slot_rows_grad(g, dest, k: int):
    """Each token's k slot gradients g[dest[t * k + j]] summed (a gather and a sum: no atomics)."""
    return g.index_select(0, dest).view(-1, k, g.shape[-1]).sum(1)


_combine_rows = Compiled("moe_combine", _combine_rows_sum, eager=_combine_rows_bmm)
_combine_rows_grads = Compiled("moe_combine backward", _combine_rows_grads_sum, eager=_combine_rows_grads_bmm)
_slot_rows_grads = Compiled("moe_slot_rows backward", _slot_rows_grad)


def slot_rows_grad(g, dest, k: int):
    """The backward of kernels.moe_slot_rows in this mode: each token's k slot gradients summed in one pass
    (no atomic index_add_, no unit-weight combine)."""
    return _slot_rows_grads(g.contiguous(), dest, k)


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, rows):
        ctx.save_for_backward(y, w, rows)
        return _combine_rows(y, w, rows)

    @staticmethod
    def backward(ctx, g):
        dy, dw = _combine_rows_grads(g.contiguous(), *ctx.saved_tensors)
        return dy, dw, None


def moe_combine_rows(y, weights, rows):
    """moe_combine(y[rows].view(T, k, D), weights): y [R, D] the experts' outputs in dispatch order, rows
    [T * k] distinct (dispatch's `dest`, a permutation). Backward: y's gradient rows written in place of
    the gather's atomic index_add_."""
    if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
        return _CombineRows.apply(y, weights, rows)
    return _combine_rows(y, weights, rows)


def log_softmax_gather(z, tokens):
    return torch.log_softmax(z, -1).gather(-1, tokens[:, None])[:, 0]


def _tempered(logits, scale: float):
    z = logits.float()
    return z if scale == 1.0 else z * scale


def filter_logits(logits, top_k: int, top_p: float, scale: float):
    """fp32 tempered logits with -inf outside top-k / top-p: one sort, a cumulative sum of the sorted
    probabilities, scattered back (vLLM's torch sampler). Ties at the cut fall either way."""
    z_sort, idx = _tempered(logits, scale).sort(-1)  # ascending
    V = z_sort.shape[-1]
    if top_k and top_k < V:
        z_sort.masked_fill_(z_sort < z_sort[:, V - top_k : V - top_k + 1], float("-inf"))
    if top_p < 1.0:
        drop = z_sort.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        z_sort.masked_fill_(drop, float("-inf"))
    return z_sort.scatter(-1, idx, z_sort)


def gumbel_argmax_logprobs(logits, seed: int, sample_ids, positions, scale: float):
    """(tokens, their logprobs): an exponential race, argmax(p / E) with E ~ Exp(1) from torch's RNG (a
    Gumbel-max draw; the seed, sample ids and positions are not used: torch's generator state is)."""
    logp = torch.log_softmax(_tempered(logits, scale), -1)
    tok = (logp - torch.empty_like(logp).exponential_().log_()).argmax(-1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def gumbel_argmax(logits, seed: int, sample_ids, positions, scale: float):
    return gumbel_argmax_logprobs(logits, seed, sample_ids, positions, scale)[0]
