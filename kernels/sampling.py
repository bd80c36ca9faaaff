"""Token sampling whose randomness is a pure function of (seed, sample id, position).

Gumbel-max: token = argmax(z + g), g = -log(-log(u)), u from a splitmix64 hash of
(seed, sample_id, position, vocab index). No RNG stream is shared between rows, so a sequence
samples the same tokens in any batch, in any order, and in a resumed run.

The same `filter_logits` is applied by the generator before sampling and by the trainer before
scoring, so both sides' logprobs refer to the one distribution that was sampled from:
    log p(token) = log_softmax(filter(logits / temperature))[token]
top_k keeps values >= the k-th largest (ties kept); top_p keeps the shortest prefix of the
descending distribution whose mass reaches top_p (ties at its end kept), with masses as integers so
that every sum is exact. Each cut is a key of the values' order: top-p's found by a threshold search
(no sort), top-k's the k-th largest value (torch.topk here); the Triton kernel
(rlalign.kernels.triton.sampling) finds both cuts by the same search, the same keys on every device.
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


MASS_SCALE = 2.0 ** 32  # a token's top-p mass: floor(exp(z - max) * 2**32), an integer
MAX_VOCAB = 1 << 21  # a row's masses then sum below 2**53
SEARCH_WAYS = 256  # thresholds tried per pass of the torch search: the interval shrinks to ceil(width / 257)
SEARCH_PASSES = 4  # ceil-dividing the 2**32 + 1 keys by 257 four times leaves 1: the search is exact


def order_keys(z: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered like the fp32 values z (-0 and +0 one key; NaN above +inf, or below
    -inf when its sign bit is set)."""
    bits = (z + 0.0).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def top_p_mass(z: torch.Tensor, zmax: torch.Tensor) -> torch.Tensor:
    """int64 masses floor(fixed_order.exp(z - zmax) * 2**32) for z [N, V] fp32, zmax [N, 1] (0 where
    that is below 2**-32, or NaN). Integers up to 2**32, so any sum over a vocabulary below MAX_VOCAB is
    exact in any order, as int64 or as fp64."""
    e = fo.exp(z - zmax) * MASS_SCALE
    return torch.where(e >= 1.0, torch.floor(e), torch.zeros_like(e)).long()


def threshold_search(keys: torch.Tensor, weights: torch.Tensor, bound: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor) -> torch.Tensor:
    """Per row, the least key c in (lo, hi] whose weight above it, sum(weights[keys > c]), is below
    bound (compared as fp64; exact: the sums are integers < 2**53). keys [N, V] int32, weights [N, V]
    int64, bound [N] fp64, lo and hi [N] int64 with the sum at lo >= bound and at hi < bound. A fixed
    SEARCH_PASSES passes of SEARCH_WAYS thresholds each, no sort and no host sync; the answer is a
    function of the row's values alone (rlalign.kernels.triton.sampling finds the same one)."""
    ways, n = torch.arange(1, SEARCH_WAYS + 1, device=keys.device), SEARCH_WAYS + 1
    keys = keys.long()
    for _ in range(SEARCH_PASSES):
        width = (hi - lo)[:, None]  # >= 1
        cand = lo[:, None] + (width * ways) // n  # [N, W] ascending
        # how many thresholds lie below each key: cand[j] < key <=> width * j < n * (key - lo)
        below = (keys - lo[:, None]).mul_(n).sub_(1).floor_divide_(width).clamp_(0, SEARCH_WAYS)  # [N, V]
        hist = torch.zeros(len(keys), n, dtype=torch.long, device=keys.device)
        hist.scatter_add_(1, below, weights)  # integer sums: exact in any order
        cum = hist.cumsum(-1)
        above = cum[:, -1:] - cum[:, :-1]  # [N, W]: the weight of keys > cand[:, j]
        ok = above.double() < bound[:, None]  # false ... false true ... true
        hi = torch.where(ok, cand, hi[:, None]).amin(-1)
        lo = torch.where(ok, lo[:, None], cand).amax(-1)
    return hi


def temper(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32(logits) * scale [B, V] (scale = rlalign.kernels.inverse_temperature(t); the product only when
    scale != 1): the temperature step, one definition for every backend and device: an exact upcast and
    one IEEE fp32 product. (torch's CUDA division of a tensor by a Python scalar t is this product; its
    CPU kernel divides.) The Triton consumers compute it in registers from the logits in place."""
    z = logits.float()
    return z if scale == 1.0 else z * scale


KEEP_ALL = -(1 << 31)  # a cut below every int32 key: nothing filtered
NAN_CUT = 0x7FC00000  # the canonical quiet NaN's key, above +inf's: the cut at a NaN value, only the NaNs kept


def value_cut(v: torch.Tensor) -> torch.Tensor:
    """The cut int64 at each value of v (fp32): its order key; NAN_CUT for a NaN of any sign and payload (torch.topk
    and amax rank a NaN above every value, order_keys puts a negative one below -inf, and a NaN's sign and payload
    need not survive a device's arithmetic: one key keeps the cut the same on every device)."""
    return torch.where(v == v, order_keys(v).long(), NAN_CUT)


def filter_cut(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The cut [N] int64 of `filter_logits`: the kept set of row r is {v : order_keys(z)[r, v] >= cut[r]}
    plus its NaNs; KEEP_ALL for a row no filter applies to. z [N, V] fp32 tempered logits. top_k: the
    least key with fewer than k values above it (the k-th largest value's, which torch.topk finds
    exactly; NaN ranked above every value: value_cut's NAN_CUT, only the NaNs kept, when the k-th is
    NaN). top_p, after top_k: with integer masses q = top_p_mass(z, max z) (0 for tokens top_k
    dropped) and Q their sum, the least key c whose mass above it, sum(q[keys > c]), is < top_p * Q
    (fp64): a `threshold_search` over the values' order keys."""
    N, V = z.shape
    if top_p < 1.0 and V >= MAX_VOCAB:
        raise ValueError(f"filter_logits: top_p over a vocabulary of {V} (at most {MAX_VOCAB - 1}: the masses' "
                         "sums must stay exact in fp64)")
    keys = order_keys(z)
    cut = torch.full((N,), KEEP_ALL, dtype=torch.long, device=z.device)
    if top_k and top_k < V:  # the least key with fewer than k values above it: the k-th largest value's
        cut = value_cut(torch.topk(z, top_k, -1).values[:, -1])
    if top_p < 1.0:
        zmax = z.amax(-1, keepdim=True)
        mass = torch.where(keys >= cut[:, None], top_p_mass(z, zmax), 0)
        hi = value_cut(zmax[:, 0])
        lo = torch.minimum(torch.where(mass > 0, keys, torch.iinfo(torch.int32).max).amin(-1).long(), hi) - 1
        bound = mass.sum(-1).double() * top_p
        cut = threshold_search(keys, mass, bound, lo, hi)
    return cut


def filter_logits(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """z [N, V] fp32 tempered logits -> the same with -inf outside the kept set (NaN stays NaN, so the
    sampler still refuses the row). top_k: keep values >= the k-th largest (ties kept). top_p, after
    top_k: with integer masses q = top_p_mass(z, max z) (0 for tokens top_k dropped) and Q their sum,
    keep z_v when the mass of the values strictly above z_v is < top_p * Q (fp64): the shortest
    descending prefix reaching top_p, ties at its end kept. Both cuts are `filter_cut`'s: the kept set
    is {keys >= c}, whatever the steps that found c."""
    if not ((top_k and top_k < z.shape[-1]) or top_p < 1.0):
        return z
    return apply_cut(z, filter_cut(z.detach(), top_k, top_p))


def apply_cut(z: torch.Tensor, cut: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
    """z [N, V] fp32 where order_keys(z) >= cut (int64 [N], a row's filter cut) or z is NaN, -inf elsewhere:
    the kept set {keys >= cut} of `filter_logits` (keys: order_keys(z), if at hand). A `where` of z itself: a
    gradient flows to the kept values."""
    keys = order_keys(z.detach()) if keys is None else keys
    return torch.where((keys >= cut[:, None]) | (z != z), z, torch.full_like(z, float("-inf")))


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
