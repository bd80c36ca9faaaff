"""Token sampling whose randomness is a pure function of (seed, sample id, position).

Gumbel-max: token = argmax(z + g), g = -log(-log(u)), u from a splitmix64 hash of
(seed, sample_id, position, vocab index). No RNG stream is shared between rows, so a sequence
samples the same tokens in any batch, in any order, and in a resumed run.

The same `filter_logits` is applied by the generator before sampling and by the trainer before
scoring, so both sides' logprobs refer to the one distribution that was sampled from:
    log p(token) = log_softmax(filter(logits / temperature))[token]
top_k keeps values >= the k-th largest (ties kept); top_p keeps the smallest prefix of the
descending distribution whose mass reaches top_p (values >= the last kept one).
"""

from __future__ import annotations

import torch

from rlalign.kernels import fixed_order as fo

_M64 = (1 << 64) - 1


def _s64(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN, _MIX1, _MIX2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # logical shift on int64


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    return x ^ _srl(x, 31)


UNIFORM_BITS = 23  # k + 0.5 for k < 2**23 needs 24 significant bits: exact in fp32


def uniform(seed: int, sample_ids: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u = (k + 0.5) / 2**23 for k the top 23 bits of the hash, fp32, shape [B, vocab]; a pure
    function of the four integers. Every value is exact and strictly inside (0, 1): the largest
    is 1 - 2**-24 (so -log(-log u) <= 16.64, finite), the smallest 2**-24; the 2**23 values are
    equally likely and symmetric about 1/2."""
    dev = sample_ids.device
    h = mix64(torch.full_like(sample_ids, _s64(seed & _M64)))
    h = mix64(h ^ sample_ids.long())
    h = mix64(h ^ positions.long())
    h = mix64(h[:, None] ^ torch.arange(vocab, device=dev, dtype=torch.long)[None])
    return (_srl(h, 64 - UNIFORM_BITS).float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def gumbel(seed: int, sample_ids: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    return -fo.log(-fo.log(uniform(seed, sample_ids, positions, vocab)))


def _cumsum_fixed(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum over the last dim by a Hillis-Steele scan (fixed order per index)."""
    n, off = x.shape[-1], 1
    while off < n:
        x = torch.cat([x[..., :off], x[..., off:] + x[..., :-off]], -1)
        off *= 2
    return x


def filter_logits(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """z [N, V] fp32 tempered logits -> the same with -inf outside the kept set."""
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, -1).values[..., -1:]  # the k-th largest value (exact, any algorithm)
        z = torch.where(z >= kth, z, torch.full_like(z, float("-inf")))
    if top_p < 1.0:
        zs = torch.sort(z, -1, descending=True).values
        p = fo.exp(zs - zs[..., :1])
        p = p / fo.tree_sum(p, -1)[..., None]
        before = _cumsum_fixed(p) - p  # mass strictly before each sorted entry
        keep = before < top_p
        last = torch.where(keep, zs, torch.full_like(zs, float("inf"))).amin(-1, keepdim=True)
        z = torch.where(z >= last, z, torch.full_like(z, float("-inf")))
    return z


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim with ties resolved to the lowest index. A row with no value
    equal to its max (NaN) or whose max is -inf (nothing kept) has no token: that is an error,
    checked on the device (no host sync on CUDA), never an out-of-vocabulary id."""
    m = x.amax(-1, keepdim=True)
    idx = torch.arange(x.shape[-1], device=x.device)
    out = torch.where(x == m, idx, x.shape[-1]).amin(-1)
    torch._assert_async(((out < x.shape[-1]) & (m[..., 0] > float("-inf"))).all(),
                        "sample: a row has no finite maximum (NaN or all -inf logits); no token can be drawn")
    return out
