"""Rollouts at scale on one GPU: the native engine (deterministic Triton kernels, CUDA graphs, the
config defaults) at a few batch sizes, plain sampling (T 1) and top-p (T 0.8, top-p 0.95) on the
same prompts. Each run makes --calls generate() calls on one engine (what an RL run does once per
step, seeds 7, 8, ...); the first captures the graphs, the last --timed calls are timed (tokens/s:
their median) and every timed call's tokens are rescored by the trainer (0 mismatched expected).

    python experiments/rollout/bench_rollout_scale.py [--model bench-moe-large] [--cases 256x256,2048x256]
        [--calls 2] [--timed 1] [--budget-s 80] [--max-batched N] [--out DIR] [--name rollout_scale_h200]

Roofline per decode step: max(memory time, compute time). Memory: the weights the step reads
(dense, the lm head, the experts its rows route to if routing is uniform) plus every live row's
keys and values, at the HBM peak. Compute: 2 FLOP per active parameter per row (dense matmuls, the
lm head, top_k experts) plus attention's 4 * heads * head_dim * context per layer, at the dense bf16
tensor-core peak. Summed over the steps of the measured run (its live rows and context lengths);
prefill is in the measured time and not in the roofline. Random prompts of 8-200 tokens.
Writes DIR/NAME.json with a "summary" object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
from bench_generate import HBM_PEAK, run  # noqa: E402
from record import RESULTS, gpu_tag, write  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.model import build_model  # noqa: E402
from rlalign.rollout.types import EngineConfig  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402
from rlalign.training.scoring import score  # noqa: E402

BF16_DENSE_PEAK = {"H200": 989.4e12, "H100": 989.4e12}  # FLOP/s, dense (no sparsity)
SAMPLING = {"plain": dict(temperature=1.0), "top_p": dict(temperature=0.8, top_p=0.95)}


def roofline(args, model, rollouts, hbm_peak: float, flop_peak: float) -> dict:
    """Tokens/s if every decode step took max(its bytes / hbm_peak, its FLOPs / flop_peak)."""
    el = model.dtype.itemsize
    names = dict(model.named_parameters())
    n_expert = sum(p.numel() for n, p in names.items() if ".experts." in n)
    embed = model.model.embed_tokens.weight
    n_embed = embed.numel()
    n_all = sum(p.numel() for p in model.parameters())
    n_dense = n_all - n_expert
    tied = model.lm_head.weight is embed
    n_dense_matmul = n_dense - (0 if tied else n_embed)  # the embedding lookup reads one row, no FLOPs
    E, k, L = args.num_experts, args.top_k, args.num_layers
    per_expert = n_expert / max(1, E)  # one expert's parameters over all MoE layers
    kv_per_token = L * 2 * args.num_kv_heads * args.head_dim * el
    flop_per_row = 2 * (n_dense_matmul + k * per_expert)
    attn_flop_per_ctx = 4 * L * args.num_heads * args.head_dim
    mem_s = flop_s = roof_s = 0.0
    max_new = max(len(r.tokens) for r in rollouts)
    steps_compute_bound = 0
    for t in range(max_new):  # step t samples token t of every row still live
        live = [r for r in rollouts if len(r.tokens) > t]
        B = len(live)
        ctx = sum(len(r.prompt) + t for r in live)
        touched = E * (1 - (1 - k / E) ** B) if E else 0
        m = (n_dense * el + touched * per_expert * el + ctx * kv_per_token) / hbm_peak
        f = (B * flop_per_row + ctx * attn_flop_per_ctx) / flop_peak
        mem_s, flop_s, roof_s = mem_s + m, flop_s + f, roof_s + max(m, f)
        steps_compute_bound += f > m
    tokens = sum(len(r.tokens) for r in rollouts)
    return {"decode_steps": max_new, "memory_seconds": mem_s, "compute_seconds": flop_s, "roofline_seconds": roof_s,
            "roofline_tokens_per_s": tokens / roof_s, "steps_compute_bound": steps_compute_bound,
            "hbm_peak_bytes_per_s": hbm_peak, "flop_peak_per_s": flop_peak,
            "flop_per_row_excl_attention": flop_per_row, "attention_flop_per_context_token": attn_flop_per_ctx,
            "active_params_per_token": n_dense_matmul + k * per_expert}


def timed(model, outs: list, r: dict, params: SamplingParams, n: int) -> None:
    """r's speed as the median of the last n calls' tokens/s; the n - 1 calls before the last (which run()
    rescored) rescored by the trainer too, their mismatches added."""
    if not 1 <= n <= len(outs) - 1:
        raise ValueError(f"--timed {n}: must be 1 .. calls - 1 = {len(outs) - 1} (the first call captures)")
    rates = sorted(r["calls_tokens_per_s"][-n:])
    r.update(tokens_per_s=rates[n // 2] if n % 2 else (rates[n // 2 - 1] + rates[n // 2]) / 2, timed_calls=n)
    r["seconds"] = r["tokens"] / r["tokens_per_s"]
    for c in range(len(outs) - n, len(outs) - 1):
        rolls = outs[c]
        with torch.no_grad(), kernels.use(mode="deterministic", backend="triton"):  # run()'s scoring kernels
            lps = score(model, [x.prompt for x in rolls], [x.tokens for x in rolls], rolls[0].params,
                        micro_batch_size=64)
        r["mismatched_tokens"] += sum(int((x.logprobs != lp.float().cpu()).sum()) for x, lp in zip(rolls, lps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-moe-large")
    ap.add_argument("--cases", default="256x256,2048x256", help="PROMPTSxNEW,...")
    ap.add_argument("--sampling", default="plain,top_p")
    ap.add_argument("--calls", type=int, default=2,
                    help="generate() calls per run (seeds 7, 8, ...): the first captures, the last is timed")
    ap.add_argument("--timed", type=int, default=1, help="the last this many calls are timed (median) and rescored")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds (0: no limit)")
    ap.add_argument("--max-batched", type=int, default=None,
                    help="generator.max_num_batched_tokens (default: the config default)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default=None, help="result name (default rollout_scale_<card>, e.g. _h200)")
    a = ap.parse_args()
    a.name = a.name or f"rollout_scale_{gpu_tag()}"
    t_start = time.perf_counter()
    cfg = load_config([f"model={a.model}"])
    args = model_args(cfg)
    model = build_model(args, "bfloat16", seed=0, device="cuda")
    gpu = torch.cuda.get_device_name(0)
    hbm = next((v for key, v in HBM_PEAK.items() if key in gpu), 4.8e12)
    flops = next((v for key, v in BF16_DENSE_PEAK.items() if key in gpu), 989.4e12)
    engine = EngineConfig()  # the config defaults
    if a.max_batched is not None:
        engine.max_num_batched_tokens = a.max_batched
    results, summary = {}, {"mismatched_tokens": 0}

    def save():
        return write(a.name, {"model": a.model, "engine": vars(engine), "prompt_len": [8, 200],
                              "what_it_shows": "tokens/s of the native engine at 256 and 2048 rows, plain and top-p "
                              "sampling, against a roofline of max(memory, compute) time per decode step; every "
                              "timed token rescored by the trainer", "summary": summary, "results": results}, a.out)

    for case in a.cases.split(","):
        B, new = (int(x) for x in case.split("x"))
        g = torch.Generator().manual_seed(B)
        prompts = [torch.randint(2, args.vocab_size, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 201, (B,), generator=g)]
        for name in a.sampling.split(","):
            if a.budget_s and time.perf_counter() - t_start > a.budget_s:
                print(f"{case} {name}: skipped (budget)", flush=True)
                continue
            params = SamplingParams(max_new_tokens=new, seed=7, **SAMPLING[name])
            torch.cuda.empty_cache()
            try:
                outs, r = run(model, prompts, params, "deterministic", engine, warm=False, calls=a.calls,
                              score_micro_batch=64)
            except Exception as e:  # noqa: BLE001 - recorded, the other runs still go
                results[f"{case}_{name}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(case, name, "FAILED", results[f"{case}_{name}"]["error"], flush=True)
                continue
            timed(model, outs, r, params, a.timed)
            roof = roofline(args, model, outs[-1], hbm, flops)
            r.update(roofline=roof, fraction_of_roofline=r["tokens_per_s"] / roof["roofline_tokens_per_s"],
                     sampling=SAMPLING[name])
            results[f"{case}_{name}"] = r
            summary["mismatched_tokens"] += r["mismatched_tokens"]
            plain, top_p = results.get(f"{case}_plain", {}), results.get(f"{case}_top_p", {})
            if "tokens_per_s" in plain:
                summary[f"tok_s_{case}"] = plain["tokens_per_s"]
                summary[f"roofline_frac_{case}"] = plain["fraction_of_roofline"]
                if "tokens_per_s" in top_p:
                    summary[f"top_p_over_plain_{B}"] = top_p["tokens_per_s"] / plain["tokens_per_s"]
            save()  # after every run: a run stopped later keeps what it measured
            print(f"{case:9s} {name:6s} {r['tokens']:8d} tok {r['seconds']:7.3f} s {r['tokens_per_s']:9.0f} tok/s "
                  f"roofline {roof['roofline_tokens_per_s']:9.0f} tok/s ({100 * r['fraction_of_roofline']:5.1f} %, "
                  f"{roof['steps_compute_bound']}/{roof['decode_steps']} steps compute-bound)  mismatched "
                  f"{r['mismatched_tokens']}  t={time.perf_counter() - t_start:.0f}s", flush=True)
    print("summary", summary)
    print("wrote", save())


if __name__ == "__main__":
    main()
