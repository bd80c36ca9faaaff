"""The sampler's top-k / top-p filter on one GPU: the Triton cut (kernels/triton/topp.py filter_cut, its
filtered values sampling.apply_cut's) against the torch formulation of the same search (bits
checked equal) and against the sort-based filter it replaced, beside the rest of a sampling step
(the Gumbel-max draw and the logprob gather) for scale.

    python experiments/kernels/bench_filter.py [--cases N] [--out DIR]

Logits: bf16 normal(0, scale) rows (scale 1: a flat distribution, top-p keeps most of the
vocabulary; scale 4: a peaked one), tempered in fp32. Writes results/bench_filter_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
from record import RESULTS, write  # noqa: E402

from rlalign.kernels import fixed_order as fo  # noqa: E402
from rlalign.kernels import sampling  # noqa: E402
from rlalign.kernels.triton import (
    logprob,  # noqa: E402
    topp,  # noqa: E402
)
from rlalign.kernels.triton import sampling as tsampling  # noqa: E402


def sort_filter(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The filter before the threshold search: topk for top-k, a full sort and a Hillis-Steele scan for top-p."""
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, -1).values[..., -1:]
        z = torch.where(z >= kth, z, torch.full_like(z, float("-inf")))
    if top_p < 1.0:
        zs = torch.sort(z, -1, descending=True).values
        p = fo.exp(zs - zs[..., :1])
        p = p / fo.tree_sum(p, -1)[..., None]
        x, n, off = p, p.shape[-1], 1
        while off < n:
            x = torch.cat([x[..., :off], x[..., off:] + x[..., :-off]], -1)
            off *= 2
        keep = x - p < top_p
        last = torch.where(keep, zs, torch.full_like(zs, float("inf"))).amin(-1, keepdim=True)
        z = torch.where(z >= last, z, torch.full_like(z, float("-inf")))
    return z


def case(g, B: int, V: int, scale: float, temp: float, k: int, p: float) -> dict:
    z = (torch.randn(B, V, generator=g, device="cuda") * scale).bfloat16().float() / temp
    z[0] = 1.25  # ties: every value kept
    ref = sampling.filter_logits(z, k, p)
    out = sampling.apply_cut(z, topp.filter_cut(z, k, p))
    same = bool(torch.equal(out.view(torch.int32), ref.view(torch.int32)))
    kept = torch.isfinite(out).sum(-1).float()
    ids = torch.arange(B, device="cuda")
    tok = tsampling.gumbel_argmax(out, 3, ids, ids)
    t = {"triton_cut_ms": triton.testing.do_bench(lambda: topp.filter_cut(z, k, p)),
         "sort_filter_ms": triton.testing.do_bench(lambda: sort_filter(z, k, p)),
         "gumbel_argmax_ms": triton.testing.do_bench(lambda: tsampling.gumbel_argmax(out, 3, ids, ids)),
         "logprob_ms": triton.testing.do_bench(lambda: logprob.log_softmax_gather(out, tok))}
    if B * V <= 256 * 32000:
        t["torch_search_ms"] = triton.testing.do_bench(lambda: sampling.filter_logits(z, k, p))
    row = {"rows": B, "vocab": V, "logit_scale": scale, "temperature": temp, "top_k": k, "top_p": p,
           "bits_equal_torch": same, "kept_mean": float(kept.mean()), "kept_max": float(kept.max()), **t}
    print(f"{B:5d} x {V:6d} s{scale:.0f} T{temp} k{k:2d} p{p:.2f} equal={same} kept~{row['kept_mean']:9.1f}  "
          + "  ".join(f"{n} {v:7.3f}" for n, v in t.items()), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--cases", type=int, default=5, help="the first N cases")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [(2048, 32000, 1.0, 0.8, 0, 0.95), (256, 151936, 1.0, 0.7, 20, 0.9), (256, 32000, 1.0, 0.8, 0, 0.95),
             (2048, 32000, 4.0, 0.8, 0, 0.95), (2048, 32000, 1.0, 0.7, 20, 1.0)][: a.cases]
    rows = [case(g, *c) for c in cases]
    gpu = torch.cuda.get_device_name().split()[-1]
    same = all(r["bits_equal_torch"] for r in rows)
    shows = "; ".join(f"{r['rows']}x{r['vocab']} top-k {r['top_k']} top-p {r['top_p']}: {r['triton_filter_ms']:.2f} ms "
                      f"(sort {r['sort_filter_ms']:.2f})" for r in rows)
    res = {"cases": rows, "all_bits_equal": same,
           "what_it_shows": f"The Triton top-k/top-p filter (threshold search) vs the sort-based filter it replaced; "
                            f"bits equal to the torch search in every case: {same}. {shows}"}
    print("wrote", write(f"bench_filter_{gpu}", res, a.out))


if __name__ == "__main__":
    main()
