# ruff: noqa: B023  (the benchmark lambdas run inside the loop iteration that defines them)
"""The experts' gate_up GEMM with the SwiGLU in its epilogue (grouped_mm(..., swiglu=True), the kernels'
moe_slot_swiglu) against the GEMM writing [R, 2I] and swiglu_halves reading it back, bench-moe-large's
gate_up [64, 1536, 2048] over the token rows gathered in place (routed top-8 by a router GEMM, counts on the
device as in the decode graphs). Bits: the fused output against swiglu_halves(GEMM) with torch.equal on the raw
bits, on the timed inputs and on inputs holding inf / NaN entries and rows whose products overflow. Time: each
variant under a CUDA graph (sweep_grouped_sched's CALLS launches a replay), the graphs replayed in turn
(interleaved_us), median.

--engine CASES (e.g. 256x256,2048x256): the native engine on bench-moe-large (probe_rollout_steps.py's prompts),
two engines of one model, one with the fused op and one with the two ops (the Triton backend's moe_slot_swiglu
hidden: kernels.moe_slot_swiglu composes them), each run once to compile and capture; then their generate()
calls in turn (wall time, tokens and logprobs compared bitwise) and their largest decode graphs replayed in turn.

    python experiments/bench_swiglu_fused.py [--tokens 256,1024,2048,4096,8192] [--engine CASES] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vendor import bits_equal  # noqa: E402
from record import RESULTS, write  # noqa: E402
from sweep_grouped_sched import CALLS, capture, interleaved_us, routed, use  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.kernels.triton import elementwise, gemm, gemm_configs  # noqa: E402

BF = torch.bfloat16
WHAT = "gate_up GEMM + swiglu_halves vs the SwiGLU in the GEMM's epilogue: bits and time under CUDA graphs"
MAIN = dict(gemm.MATMUL_CONFIGS[BF])
GRID = gemm_configs.TILE_PER_PROGRAM
# --sweep: schedules of the fused op (one config for every size; the same K chunks: the bits are checked). The
# epilogue's exp and division (2 MUFU ops an output) stall the tile's MMAs; tiles small enough for two or more
# programs an SM might overlap one program's epilogue with another's MMAs. Measured (H200, R2 of 2026-12-02,
# results/bench_swiglu_epilogue_h200.json): every one 1.0-1.6x slower than the pinned tables, bits equal
SWEEP = {
    "n128_w4_s4_x2": dict(MAIN, BLOCK_N=128, num_warps=4, num_stages=4, PER_SM=2),
    "n128_w4_s3_grid": dict(MAIN, BLOCK_N=128, num_warps=4, num_stages=3, PER_SM=GRID),
    "n128_w8_s4_grid": dict(MAIN, BLOCK_N=128, num_warps=8, num_stages=4, PER_SM=GRID),
    "m64_w4_s4_grid": dict(MAIN, BLOCK_M=64, num_warps=4, num_stages=4, PER_SM=GRID),
    "main_s4_grid": dict(MAIN, num_stages=4, PER_SM=GRID),
}


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """x with an inf, a -inf and a NaN entry in three rows and two rows of +-3e38 (the GEMM's sums overflow)."""
    x = x.clone()
    x[0, 5], x[1, 17], x[2, 1000] = float("inf"), float("-inf"), float("nan")
    x[3], x[4] = 3e38, -3e38
    return x


@contextlib.contextmanager
def two_ops():
    """The Triton backend without its fused ops: kernels.moe_slot_swiglu / grouped_swiglu compose the two."""
    saved = tb.moe_slot_swiglu, tb.grouped_swiglu
    tb.moe_slot_swiglu = tb.grouped_swiglu = None
    try:
        yield
    finally:
        tb.moe_slot_swiglu, tb.grouped_swiglu = saved


def engine_ab(cases: str) -> dict:
    from probe_rollout_steps import prompts_of

    from rlalign.config import load_config, model_args
    from rlalign.model import build_model
    from rlalign.rollout.native.engine import NativeEngine
    from rlalign.rollout.types import EngineConfig, SamplingParams

    args = model_args(load_config(["model=bench-moe-large"]))
    model = build_model(args, "bfloat16", seed=0, device="cuda")
    ctx = {"fused": contextlib.nullcontext, "two_ops": two_ops}
    out = {}
    with kernels.use(mode="deterministic", backend="triton"):
        for case in cases.split(","):
            B, new = (int(x) for x in case.split("x"))
            prompts, ids = prompts_of(B, args.vocab_size), list(range(B))
            params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=7)
            engines, results, walls = {}, {}, {n: [] for n in ctx}
            for n, c in ctx.items():
                engines[n] = NativeEngine(model, EngineConfig())
                with c():
                    results[n] = engines[n].generate(prompts, ids, params)  # compile, capture
            for rep in range(2):
                for n in (list(ctx) if rep % 2 == 0 else list(ctx)[::-1]):
                    with ctx[n]():
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        results[n] = engines[n].generate(prompts, ids, params)
                        torch.cuda.synchronize()
                        walls[n].append(time.perf_counter() - t0)
            f, u = results["fused"], results["two_ops"]
            row = {"tokens": sum(len(o.tokens) for o in f),
                   "tokens_equal": all(a.tokens == b.tokens for a, b in zip(f, u)),
                   "logprobs_equal": all(bits_equal_f32(a.logprobs, b.logprobs) for a, b in zip(f, u)),
                   "wall_s": {n: min(v) for n, v in walls.items()}}
            row["tokens_per_s"] = {n: row["tokens"] / w for n, w in row["wall_s"].items()}
            size = max(engines["fused"].state.graphs.graphs)
            graphs = {n: e.state.graphs.graphs[size][0] for n, e in engines.items()}
            row["decode_replay_bucket"] = size
            row["decode_replay_ms"] = {n: us * CALLS / 1e3 for n, us in interleaved_us(graphs).items()}  # 1 a replay
            for e in engines.values():
                e.close()
            del engines, graphs
            torch.cuda.empty_cache()
            out[case] = row
            print(f"engine {case}: tokens_equal {row['tokens_equal']} logprobs_equal {row['logprobs_equal']} | "
                  + "  ".join(f"{n} {row['tokens_per_s'][n]:,.0f} tok/s ({row['wall_s'][n]:.3f} s) decode replay "
                              f"{row['decode_replay_ms'][n]:.3f} ms" for n in ctx), flush=True)
    return out


def bits_equal_f32(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,1024,2048,4096,8192")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="bench_swiglu_epilogue_h200")
    ap.add_argument("--sweep", action="store_true", help="also the fused op under SWEEP's schedules")
    ap.add_argument("--engine", default="", help="CASES (BxNEW,...): the engine with the fused op and with two ops")
    a = ap.parse_args()
    d, E, k, inter = 2048, 64, 8, 768
    rows, sweep = [], a.sweep
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(0)
        gu = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") * 0.02).to(BF)
        for T in (int(t) for t in a.tokens.split(",") if t):
            g = torch.Generator(device="cuda").manual_seed(T)
            counts, order = routed(T, "router", g)
            xt = torch.randn(T, d, generator=g, device="cuda").to(BF)
            xs = with_specials(xt)
            fns = {"gemm": lambda x=xt: gemm.grouped_mm(x, gu, counts, order, k),
                   "gemm_swiglu": lambda x=xt: elementwise.swiglu_halves(gemm.grouped_mm(x, gu, counts, order, k)),
                   "fused": lambda x=xt: gemm.grouped_mm(x, gu, counts, order, k, swiglu=True)}
            ref, ref_s = fns["gemm_swiglu"](), fns["gemm_swiglu"](xs)
            hc = counts.tolist()
            xg = xs.index_select(0, order // k)
            row = {"tokens": T, "counts": {"min": min(hc), "max": max(hc)},
                   "bits_equal": bits_equal(fns["fused"](), ref),
                   "bits_equal_specials": bits_equal(fns["fused"](xs), ref_s),
                   "specials_nonfinite": int((~ref_s.float().isfinite()).sum()),
                   "bits_equal_host_counts": bits_equal(gemm.grouped_mm(xg, gu, hc, swiglu=True),
                                                        elementwise.swiglu_halves(gemm.grouped_mm(xg, gu, hc)))}
            graphs = {n: capture(f) for n, f in fns.items()}
            pinned = (list(gemm.GROUPED_SMALL_M[BF]), gemm.GROUPED_SHORT_K[BF])
            for name, cfg in (SWEEP.items() if sweep and T > 256 else ()):
                use(cfg)
                try:
                    row[f"bits_equal_{name}"] = bits_equal(fns["fused"](), ref)
                    graphs[name] = capture(fns["fused"])
                except Exception as e:  # noqa: BLE001 - out of shared memory, ...
                    row[f"error_{name}"] = f"{type(e).__name__}: {e}"[:160]
                finally:
                    use(pinned)
            row["us"] = interleaved_us(graphs)
            del graphs
            rows.append(row)
            us = row["us"]
            print(f"T={T:5d} counts {row['counts']['min']}-{row['counts']['max']} bits "
                  f"{row['bits_equal']}/{row['bits_equal_specials']}/{row['bits_equal_host_counts']} "
                  f"(nonfinite {row['specials_nonfinite']}) | gemm {us['gemm']:.1f} "
                  f"gemm+swiglu {us['gemm_swiglu']:.1f} "
                  f"fused {us['fused']:.1f} us ({us['fused'] / us['gemm_swiglu']:.3f}x)"
                  + "".join(f" | {n} {us[n]:.1f}{'' if row[f'bits_equal_{n}'] else ' BITDIFF'}"
                            for n in SWEEP if n in us), flush=True)
            write(a.name, {"rows": rows, "what_it_shows": WHAT}, a.out)
    engine = engine_ab(a.engine) if a.engine else {}
    print("wrote", write(a.name, {"rows": rows, "engine": engine, "what_it_shows": WHAT}, a.out))


if __name__ == "__main__":
    main()
