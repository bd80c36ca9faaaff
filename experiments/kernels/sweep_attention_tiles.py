"""The prefill attention's launch configs against the fastest SDPA backend (cuDNN on Hopper), causal, GQA 32/8,
D 128, bf16: tile heights, warps and stages of the forward (the bits checked against the pinned config's: a row's
sums may follow the warps), the forward at 8 warps with decode at 8 warps too (decode rows must equal prefill
rows), the backward's tiles, and key blocks of 128 instead of 64 (a change of the reduction order shared by
prefill, decode and paged rows: checked there as decode rows equal to prefill rows). --baseline FILE times an
older attention.py (e.g. `git show REV:kernels/triton/attention.py`) at its own pinned configs beside them, as the
row "baseline", its bits compared with the pinned config's.

    python experiments/kernels/sweep_attention_tiles.py [--variants a,b] [--baseline FILE] [--out DIR]

Writes results/sweep_attention_tiles_<gpu>.json.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py, bench_determinism_tax.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_determinism_tax import attend, sdpa_variants  # noqa: E402
from bench_vs_vendor import bits_equal, eager_ms  # noqa: E402
from record import gpu_tag, write  # noqa: E402

from rlalign.kernels.triton import attention as at  # noqa: E402

BF = torch.bfloat16
SHAPES = ((8, 1024), (2, 4096), (16, 512))
H, HK, D = 32, 8, 128
# name -> (forward overrides {prefill: ..., BLOCK_N: ...}, backward overrides {bwd: ..., bwd_dq: ...})
VARIANTS = {
    "pinned": ({}, {}),
    "fwd_m64_s2": ({"prefill": dict(BLOCK_M=64, num_stages=2, num_warps=4)}, {}),
    "fwd_m64_s4": ({"prefill": dict(BLOCK_M=64, num_stages=4, num_warps=4)}, {}),
    "fwd_m128_w8_s2": ({"prefill": dict(BLOCK_M=128, num_stages=2, num_warps=8)}, {}),
    "fwd_m128_w8_s3": ({"prefill": dict(BLOCK_M=128, num_stages=3, num_warps=8)}, {}),
    "bn128_m64_s2": ({"BLOCK_N": 128, "prefill": dict(BLOCK_M=64, num_stages=2, num_warps=4),
                      "decode_stages": 2}, {}),
    "bn128_m128_w8_s2": ({"BLOCK_N": 128, "prefill": dict(BLOCK_M=128, num_stages=2, num_warps=8),
                          "decode_stages": 2}, {}),
    "bwd_kv64x128_w8": ({}, {"bwd": dict(BLOCK_M=64, BLOCK_N=128, num_stages=2, num_warps=8)}),
    "bwd_kv32x128_w4": ({}, {"bwd": dict(BLOCK_M=32, BLOCK_N=128, num_stages=3, num_warps=4)}),
    "bwd_dq128x32_w8": ({}, {"bwd_dq": dict(BLOCK_M=128, BLOCK_N=32, num_stages=3, num_warps=8)}),
    "bwd_dq64x64_w4": ({}, {"bwd_dq": dict(BLOCK_M=64, BLOCK_N=64, num_stages=3, num_warps=4)}),
    # sass_attention_sm90.json (the launches as specialised at run time): the pinned forward and decode do not
    # spill (248 / 224 registers); at 8 warps they take 159 / 142. Decode at 8 warps too, as a row's bits may
    # follow the warps (its row sums cross warpgroups). The dK/dV kernel's (query block, head) pairs run in three
    # flat loops (diagonal masked, full unmasked, tail masked): no spill at the pinned 32 x 64, nor at 64 x 64 or
    # 32 x 128 on 8 warps. 64 x 32 at 8 warps and 32 x 32 at 4 take mma.sync (32-key tiles: under wgmma's 64 rows)
    "fwd_m64_w8": ({"prefill": dict(BLOCK_M=64, num_stages=3, num_warps=8), "decode_warps": 8}, {}),
    "fwd_m64_w8_prefill_only": ({"prefill": dict(BLOCK_M=64, num_stages=3, num_warps=8)}, {}),
    "bwd_kv64x32_w8": ({}, {"bwd": dict(BLOCK_M=64, BLOCK_N=32, num_stages=3, num_warps=8)}),
    "bwd_dq64x32_w8": ({}, {"bwd_dq": dict(BLOCK_M=64, BLOCK_N=32, num_stages=3, num_warps=8)}),
    "bwd_kv32x32_w4": ({}, {"bwd": dict(BLOCK_M=32, BLOCK_N=32, num_stages=3, num_warps=4)}),
    "bwd_kv_s2": ({}, {"bwd": dict(BLOCK_M=32, BLOCK_N=64, num_stages=2, num_warps=4)}),
    "bwd_kv32x64_w8": ({}, {"bwd": dict(BLOCK_M=32, BLOCK_N=64, num_stages=3, num_warps=8)}),
    "bwd_kv64x64_w8": ({}, {"bwd": dict(BLOCK_M=64, BLOCK_N=64, num_stages=3, num_warps=8)}),
    "bwd_kv32x128_w8": ({}, {"bwd": dict(BLOCK_M=32, BLOCK_N=128, num_stages=3, num_warps=8)}),
    "all_w8": ({"prefill": dict(BLOCK_M=64, num_stages=3, num_warps=8), "decode_warps": 8},
               {"bwd": dict(BLOCK_M=64, BLOCK_N=32, num_stages=3, num_warps=8),
                "bwd_dq": dict(BLOCK_M=64, BLOCK_N=32, num_stages=3, num_warps=8)}),
}


def apply(fwd: dict, bwd: dict) -> None:
    f = at.ATTN_FWD[BF]
    if "BLOCK_N" in fwd:
        f["BLOCK_N"] = fwd["BLOCK_N"]
    if "prefill" in fwd:
        f["prefill"] = dict(f["prefill"], **fwd["prefill"])
    if "decode_stages" in fwd:
        f["decode"] = dict(f["decode"], num_stages=fwd["decode_stages"])
    if "decode_warps" in fwd:
        f["decode"] = dict(f["decode"], num_warps=fwd["decode_warps"])
    for kind, cfg in bwd.items():
        at.ATTN_BWD[BF][kind] = dict(cfg)


def load_baseline(path: str):
    """An older attention.py as a module of the package (its relative imports resolve to today's common.py)."""
    spec = importlib.util.spec_from_file_location("rlalign.kernels.triton.attention_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def decode_equals_prefill(mod, q, k, v, o, B, T) -> bool:
    """Decode rows (one query per sequence at positions T - 1, T // 2, 100) equal the prefill rows."""
    kc, vc = k.view(B, T, HK, D), v.view(B, T, HK, D)
    qb, ob = q.view(B, T, H, D), o.view(B, T, H, D)
    ok = True
    for p in (T - 1, T // 2, 100):
        lengths = torch.full((B,), p + 1, dtype=torch.int32, device="cuda")
        od = mod.attention_decode(qb[:, p].contiguous(), kc, vc, lengths, D ** -0.5)
        ok &= bits_equal(od, ob[:, p])
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names (pinned always runs)")
    ap.add_argument("--baseline", default="", help="an older attention.py to time beside the product")
    args = ap.parse_args()
    names = ["pinned"] + [n for n in args.variants.split(",") if n and n != "pinned"]
    unknown = [n for n in names if n not in VARIANTS]
    base = load_baseline(args.baseline) if args.baseline else None
    if base is not None:
        names.append("baseline")
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    g = torch.Generator(device="cuda").manual_seed(1)
    saved = (copy.deepcopy(at.ATTN_FWD), copy.deepcopy(at.ATTN_BWD))
    rows = []
    for B, T in SHAPES:
        q = torch.randn(B * T, H, D, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(B * T, HK, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        go = torch.randn(B * T, H, D, device="cuda", generator=g).bfloat16()
        cu = [i * T for i in range(B + 1)]
        row = {"B": B, "T": T}
        for key, bwd in (("fwd", False), ("fwdbwd", True)):
            sd = {n: eager_ms(f) for n, f in sdpa_variants(q, k, v, B, T, bwd, go).items()}
            row[key + "_sdpa_ms"] = sd
            row[key + "_best_sdpa_ms"] = min(sd.values())
        ref = None
        for name in names:
            mod = base if name == "baseline" else at
            fo, bo = VARIANTS.get(name, ({}, {}))
            at.ATTN_FWD.clear()
            at.ATTN_FWD.update(copy.deepcopy(saved[0]))
            at.ATTN_BWD.clear()
            at.ATTN_BWD.update(copy.deepcopy(saved[1]))
            apply(fo, bo)
            try:
                with torch.no_grad():
                    o = mod.attention_prefill(q, k, v, cu, D ** -0.5)
                qkv = [t.clone().requires_grad_(True) for t in (q, k, v)]
                ob = attend(mod.attention_prefill, qkv, cu, go)
                grads = [t.grad for t in qkv]
                r = {"fwd_ms": eager_ms(partial(mod.attention_prefill, q, k, v, cu, D ** -0.5)),
                     "fwdbwd_ms": eager_ms(partial(attend, mod.attention_prefill,
                                                   [t.detach().clone().requires_grad_(True) for t in (q, k, v)],
                                                   cu, go))}
            except Exception as e:  # a config that does not compile or fit: recorded
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
                print(f"{B}x{T} {name}: {row[name]['error']}", flush=True)
                continue
            if ref is None:
                ref = (o, grads)
            r["fwd_over_best_sdpa"] = row["fwd_best_sdpa_ms"] / r["fwd_ms"]
            r["fwdbwd_over_best_sdpa"] = row["fwdbwd_best_sdpa_ms"] / r["fwdbwd_ms"]
            r["fwd_bits_equal_pinned"] = bits_equal(o, ref[0]) and bits_equal(ob.detach(), ref[0])
            r["grads_bits_equal_pinned"] = all(bits_equal(a, b) for a, b in zip(grads, ref[1]))
            r["decode_equals_prefill"] = decode_equals_prefill(mod, q, k, v, o, B, T)
            row[name] = r
            print(f"{B}x{T} {name}: fwd {r['fwd_ms']:.3f} ms ({r['fwd_over_best_sdpa']:.2f}x best SDPA), fwd+bwd "
                  f"{r['fwdbwd_ms']:.3f} ({r['fwdbwd_over_best_sdpa']:.2f}x); fwd bits = pinned "
                  f"{r['fwd_bits_equal_pinned']}, grads {r['grads_bits_equal_pinned']}, decode = prefill "
                  f"{r['decode_equals_prefill']}", flush=True)
        rows.append(row)
    at.ATTN_FWD.clear()
    at.ATTN_FWD.update(saved[0])
    at.ATTN_BWD.clear()
    at.ATTN_BWD.update(saved[1])
    summary = {}
    for name in names:
        ok = [r[name] for r in rows if "fwd_ms" in r.get(name, {})]
        if len(ok) == len(rows):
            summary[name] = {"fwd_over_best_sdpa_min": min(x["fwd_over_best_sdpa"] for x in ok),
                             "fwdbwd_over_best_sdpa_min": min(x["fwdbwd_over_best_sdpa"] for x in ok),
                             "decode_equals_prefill": all(x["decode_equals_prefill"] for x in ok),
                             "fwd_bits_equal_pinned": all(x["fwd_bits_equal_pinned"] for x in ok),
                             "grads_bits_equal_pinned": all(x["grads_bits_equal_pinned"] for x in ok)}
    payload = {"shapes": rows, "summary": summary, "baseline_file": args.baseline, "what_it_shows": (
        "Prefill attention launch configs against the fastest SDPA (causal, GQA 32/8, D 128, bf16), minimum over "
        f"{', '.join(f'{b}x{t}' for b, t in SHAPES)}: " + "; ".join(
            f"{n} fwd {s['fwd_over_best_sdpa_min']:.2f}x, fwd+bwd {s['fwdbwd_over_best_sdpa_min']:.2f}x "
            f"(bits = pinned {s['fwd_bits_equal_pinned']}, grads {s['grads_bits_equal_pinned']}, decode = prefill "
            f"{s['decode_equals_prefill']})"
            for n, s in summary.items()))}
    print(payload["what_it_shows"], flush=True)
    write(f"sweep_attention_tiles_{gpu_tag()}", payload, args.out)


if __name__ == "__main__":
    main()
