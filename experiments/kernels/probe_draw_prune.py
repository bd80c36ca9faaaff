"""The product's Gumbel-max draw (kernels/triton/sampling.py: the noise computed only where a value may reach the
row's best so far, may_reach) against the full draw (draw_full.py: every value's noise), in the same run: tokens
and logprobs bit for bit, device time (the torch profiler's CUDA events, mean of 20 calls) of the draw alone, the
draw with its logprob (the engine's call) and the draw through a top-p cut; the chunks that computed the exact
noise per row; the draw's lanes (DRAW_BLOCK) swept.

    python experiments/kernels/probe_draw_prune.py [--variant FILE] [--baseline FILE] [--rows 1024] [--out DIR]

--variant FILE: another sampling.py for the pruned draw (default the product's); --baseline FILE: another full draw
(default draw_full.py).

Logits (bf16): normal(0, 1) (flat), normal(0, 4), student-t(3), zipf, three spikes over a flat row, at T 1 and
T 0.8 (the cut: top-p 0.95 at T 0.8). Writes results/probe_draw_prune_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402
from bench_topp_cut import logits_of  # noqa: E402
from probe_topp_split import kernel_times, load_baseline  # noqa: E402

from rlalign.kernels import inverse_temperature  # noqa: E402
from rlalign.kernels.triton import sampling as product_sampling  # noqa: E402
from rlalign.kernels.triton import topp  # noqa: E402

CASES = (("normal", 1.0, 1.0), ("normal", 1.0, 0.8), ("normal", 4.0, 0.8), ("student_t", 1.0, 0.8),
         ("zipf", 1.0, 0.8), ("spikes", 1.0, 0.8))
BLOCKS = (512, 1024)  # DRAW_BLOCK
KEYS = tuple(f"block_{b}" for b in BLOCKS)
FULL = str(Path(__file__).resolve().parent / "draw_full.py")


def ms(fn) -> float:
    """Device ms of fn's kernels per call."""
    return round(sum(kernel_times(fn).values()), 4)


def probe(z, temp, base, pruned) -> dict:
    B, V = z.shape
    scale = inverse_temperature(temp)
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(0, 2**40, (B,), device="cuda", generator=g)
    pos = torch.randint(0, 4096, (B,), device="cuda", generator=g)
    seed = 1234
    cut = topp.filter_cut(z, 0, 0.95, scale) if temp != 1.0 else None
    ref_tok, ref_lp = base.gumbel_argmax_logprobs(z, seed, ids, pos, scale)
    res = {"baseline": {"draw_ms": ms(lambda: base.gumbel_argmax(z, seed, ids, pos, scale)),
                        "draw_logprob_ms": ms(lambda: base.gumbel_argmax_logprobs(z, seed, ids, pos, scale))}}
    if cut is not None:
        ref_cut = base.gumbel_argmax_logprobs(z, seed, ids, pos, scale, cut)
        res["baseline"]["draw_logprob_cut_ms"] = ms(lambda: base.gumbel_argmax_logprobs(z, seed, ids, pos, scale, cut))
    kept = pruned.DRAW_BLOCK
    try:
        for block in BLOCKS:
            pruned.DRAW_BLOCK = block
            exact = torch.zeros(B, dtype=torch.int32, device="cuda")
            tok = pruned.gumbel_argmax(z, seed, ids, pos, scale, exact=exact)
            tok2, lp = pruned.gumbel_argmax_logprobs(z, seed, ids, pos, scale)
            r = {"tokens_equal": bool(torch.equal(tok, ref_tok) and torch.equal(tok2, ref_tok)),
                 "logprobs_equal": bool(torch.equal(lp.view(torch.int32), ref_lp.view(torch.int32))),
                 "exact_chunks_mean": exact.float().mean().item(), "exact_chunks_max": int(exact.max()),
                 "chunks": -(-V // block),
                 "draw_ms": ms(lambda: pruned.gumbel_argmax(z, seed, ids, pos, scale)),
                 "draw_logprob_ms": ms(lambda: pruned.gumbel_argmax_logprobs(z, seed, ids, pos, scale))}
            if cut is not None:
                ct, cl = pruned.gumbel_argmax_logprobs(z, seed, ids, pos, scale, cut)
                r["cut_equal"] = bool(torch.equal(ct, ref_cut[0])
                                      and torch.equal(cl.view(torch.int32), ref_cut[1].view(torch.int32)))
                r["draw_logprob_cut_ms"] = ms(lambda: pruned.gumbel_argmax_logprobs(z, seed, ids, pos, scale, cut))
            res[f"block_{block}"] = r
    finally:
        pruned.DRAW_BLOCK = kept
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="", help="a sampling.py for the pruned draw (default: the product's)")
    ap.add_argument("--baseline", default=FULL, help="the full draw's file (default: draw_full.py)")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default=str(record.RESULTS))
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    base = load_baseline(a.baseline, "draw_full")
    pruned = load_baseline(a.variant, "draw_variant") if a.variant else product_sampling
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for kind, s, temp in CASES:
        torch.manual_seed(0)
        z = logits_of(g, kind, a.rows, a.vocab, s)
        r = {"kind": kind, "logit_scale": s, "temperature": temp, **probe(z, temp, base, pruned)}
        cases.append(r)
        row = "  ".join(f"{b}: draw {r[b]['draw_ms']:.3f} +lp {r[b]['draw_logprob_ms']:.3f}"
                        + (f" cut {r[b]['draw_logprob_cut_ms']:.3f}" if temp != 1.0 else "")
                        + f" exact {r[b]['exact_chunks_mean']:.1f}/{r[b]['chunks']}" for b in KEYS)
        bl = r["baseline"]
        print(f"{kind:9s} s {s} T {temp}: baseline draw {bl['draw_ms']:.3f} +lp {bl['draw_logprob_ms']:.3f}"
              + (f" cut {bl['draw_logprob_cut_ms']:.3f}" if temp != 1.0 else "") + f" | {row}", flush=True)
    equal = all(v.get(k, True) for c in cases for b in KEYS for v in [c[b]]
                for k in ("tokens_equal", "logprobs_equal", "cut_equal"))
    summary = {"all_bits_equal": equal, "rows": a.rows, "vocab": a.vocab, "variant_block": pruned.DRAW_BLOCK}
    for b in KEYS:
        summary[f"draw_logprob_speedup_{b}"] = {
            f"{c['kind']}_{c['logit_scale']}_T{c['temperature']}":
                round(c["baseline"]["draw_logprob_ms"] / c[b]["draw_logprob_ms"], 3) for c in cases}
    print("all bits equal:", equal, summary, flush=True)
    name = a.name or f"probe_draw_prune_{record.gpu_tag()}"
    print("wrote", record.write(name, {
        "what_it_shows": ("the pruned Gumbel-max draw (the product's unless variant_file) against the full draw "
                         "(baseline_file), same run, bits and device time"),
        "variant_file": a.variant, "baseline_file": a.baseline, "summary": summary, "cases": cases}, a.out))


if __name__ == "__main__":
    main()
