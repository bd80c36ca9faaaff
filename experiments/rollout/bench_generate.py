"""Rollout speed of the native engine: tokens/s, the fraction of the HBM roofline,
and agreement with the trainer, for the deterministic Triton kernels (CUDA graphs on and off)
and the default kernels in the same engine, same prompts, same run.

    python experiments/rollout/bench_generate.py [--model bench-moe-large] [--prompts 256] [--new 256] [--calls 2]

Modes: default (torch kernels), eager (Triton, no graphs), graphs (CUDA graphs captured in every
generate() call: EngineConfig.keep_state=False, the engine before graph reuse), kept (graphs, KV
cache and block table kept on the model across calls); +tdisp: the MoE dispatch as torch ops (~12
launches per MoE layer) instead of kernels/triton/dispatch.py's one launch (its MAX_ROWS set to -1 for
the mode); +nola: no lookahead (each
step's tokens read back before the next step is enqueued). Each mode starts
from a cleared engine state, warms up, then times --calls consecutive generate() calls (seeds 7, 8, ...: what an RL run
does once per step); tokens_per_s is the last call's (steady state), every call's time is recorded.

Roofline: a decode step must read the weights it uses (dense weights, the lm head, and the experts
that the step's rows route to: E * (1 - (1 - k/E)^B) per layer at batch B if routing is uniform)
plus every live row's keys/values; tokens/s at the HBM peak = tokens / (bytes / peak bandwidth),
summed over the steps of the measured run (its live-row counts and context lengths). Prefill is
counted in the measured time and not in the roofline (it favours the roofline). Writes
experiments/results/generate_<model>_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
from record import RESULTS, environment  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.kernels.triton import dispatch as fused_dispatch  # noqa: E402
from rlalign.model import build_model  # noqa: E402
from rlalign.rollout.native.engine import NativeEngine  # noqa: E402
from rlalign.rollout.types import EngineConfig  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402
from rlalign.training.scoring import score  # noqa: E402

HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12}


def roofline(args, model, rollouts, peak: float) -> dict:
    """Tokens/s if every decode step only moved its bytes at `peak` B/s."""
    el = model.dtype.itemsize
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_dense = sum(p.numel() for p in model.parameters()) - n_expert
    E, k, L = args.num_experts, args.top_k, args.num_layers
    per_expert = n_expert / max(1, E)  # over all MoE layers
    kv_per_token = L * 2 * args.num_kv_heads * args.head_dim * el
    total_bytes, steps = 0.0, 0
    max_new = max(len(r.tokens) for r in rollouts)
    for t in range(max_new):  # step t samples token t of every row still live
        live = [r for r in rollouts if len(r.tokens) > t]
        B = len(live)
        touched = E * (1 - (1 - k / E) ** B) if E else 0
        total_bytes += n_dense * el + touched * per_expert * el + sum(len(r.prompt) + t for r in live) * kv_per_token
        steps += 1
    tokens = sum(len(r.tokens) for r in rollouts)
    secs = total_bytes / peak
    return {"bytes_moved": total_bytes, "decode_steps": steps, "roofline_seconds": secs,
            "roofline_tokens_per_s": tokens / secs, "hbm_peak_bytes_per_s": peak,
            "weights_bytes": (n_dense + n_expert) * el}


def run(model, prompts, params, mode: str, engine: EngineConfig, warm: bool = True, score_it: bool = True,
        calls: int = 1, score_micro_batch: int = 16, inspect=None):
    """Warm up, then `calls` timed generate() calls (seeds params.seed, +1, ...): (every call's rollouts,
    the last call's numbers with every call's seconds, decode-graph captures and engine stats). inspect: a
    function of the engine after the timed calls, its result kept under "inspect"."""
    backend = "triton" if mode == "deterministic" else "torch"
    eng = NativeEngine(model, engine)
    with kernels.use(mode=mode, backend=backend):
        if warm:  # compile kernels, capture the small buckets, then the full batch's (its prefill chunks and
            # decode bucket: compiling them inside the timed run cost the first of two runs ~4 s)
            eng.generate(prompts[:8], list(range(8)), SamplingParams(max_new_tokens=8, seed=1))
            eng.generate(prompts, list(range(len(prompts))), SamplingParams(max_new_tokens=2, seed=1))
        all_outs, times, captures = [], [], []
        for c in range(calls):
            st = eng.state
            g0 = st.graphs if st is not None else None
            n0 = g0.captures if g0 is not None else 0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = eng.generate(prompts, list(range(len(prompts))), replace(params, seed=params.seed + c))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            st = eng.state  # None when the engine keeps nothing (keep_state=False)
            g1 = st.graphs if st is not None else None
            captures.append(None if g1 is None else g1.captures - (n0 if g1 is g0 else 0))
            all_outs.append(outs)
        secs = times[-1]
        looked = {} if inspect is None else {"inspect": inspect(eng)}
        toks = sum(len(r.tokens) for r in outs)
        res = {"seconds": secs, "tokens": toks, "tokens_per_s": toks / secs, "calls_seconds": times,
               "calls_tokens_per_s": [sum(len(r.tokens) for r in o) / t for o, t in zip(all_outs, times)],
               "calls_graph_captures": captures, "last_call_stats": dict(eng.stats), **looked}
        if not score_it:
            return all_outs, res
        with torch.no_grad():  # the trainer's scoring, without keeping its autograd graph
            lps = score(model, [r.prompt for r in outs], [r.tokens for r in outs], params,
                        micro_batch_size=score_micro_batch)
    diff = [(r.logprobs - lp.float().cpu()).abs() for r, lp in zip(outs, lps)]
    return all_outs, {**res, "mismatched_tokens": int(sum(int((d != 0).sum()) for d in diff)),
                      "max_abs_diff": float(max(float(d.max()) for d in diff if d.numel()))}


def _same(a, b) -> bool:
    return all(x.tokens == y.tokens and torch.equal(x.logprobs.view(torch.int32), y.logprobs.view(torch.int32))
               for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-moe-large")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--modes", default="default,eager,graphs,kept",
                    help="graphs last: a failed capture cannot spoil the others")
    ap.add_argument("--calls", type=int, default=2, help="timed generate() calls per mode (seeds 7, 8, ...)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--max-batched", type=int, default=4096, help="generator.max_num_batched_tokens")
    ap.add_argument("--no-score", action="store_true", help="skip the trainer's rescoring (speed only)")
    ap.add_argument("--dump", default="", help="torch.save each mode's tokens and logprobs here (to compare runs)")
    a = ap.parse_args()
    cfg = load_config([f"model={a.model}"])
    args = model_args(cfg)
    model = build_model(args, "bfloat16", seed=0, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, args.vocab_size, (int(torch.randint(a.prompt_min, a.prompt_max + 1, (1,),
                                                                    generator=g)),), generator=g).tolist()
               for _ in range(a.prompts)]
    params = SamplingParams(max_new_tokens=a.new, eos_token_id=args.eos_token_id, seed=7)
    gpu = torch.cuda.get_device_name(0)
    peak = next((v for k, v in HBM_PEAK.items() if k in gpu), 4.8e12)

    def write(results: dict) -> Path:
        res = dict(results)
        ok = [m for m in res if "tokens_per_s" in res[m]]
        for i, old in enumerate(ok):  # every later mode over every earlier one (the first: the engine before)
            for new in ok[i + 1:]:
                res[f"{new}_over_{old}_speed"] = res[new]["tokens_per_s"] / res[old]["tokens_per_s"]
        for m in ("kept", "graphs", "eager"):
            if "tokens_per_s" in res.get(m, {}) and "tokens_per_s" in res.get("default", {}):
                res[f"{m}_over_default_speed"] = res[m]["tokens_per_s"] / res["default"]["tokens_per_s"]
        out = {**environment(), "model": a.model, "prompts": a.prompts, "max_new_tokens": a.new,
               "prompt_len": [a.prompt_min, a.prompt_max],
               "max_num_batched_tokens": a.max_batched, "calls": a.calls,
               "baseline_tokens_per_s": 2700,
               "results": res}
        if a.dump:
            torch.save(dumps, a.dump)
        path = Path(a.out) / f"generate_{a.model}_{gpu.replace(' ', '_')}{'_' + a.tag if a.tag else ''}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
        return path

    results, ref, ref_mode, dumps = {}, None, None, {}
    max_rows = fused_dispatch.MAX_ROWS
    for mode in a.modes.split(","):
        torch.cuda.empty_cache()
        base, *opts = mode.split("+")  # +tdisp: the torch MoE dispatch; +nola: no lookahead
        if set(opts) - {"tdisp", "nola"}:
            raise SystemExit(f"mode {mode!r}: options are +tdisp and +nola")
        fused_dispatch.MAX_ROWS = -1 if "tdisp" in opts else max_rows  # -1: no step fits the Triton dispatch
        engine = EngineConfig(cuda_graphs=base in ("graphs", "kept"), keep_state=base != "graphs",
                              lookahead="nola" not in opts, max_num_batched_tokens=a.max_batched)
        try:
            outs, r = run(model, prompts, params, "default" if base == "default" else "deterministic", engine,
                          score_it=not a.no_score, calls=a.calls)
        except Exception as e:  # noqa: BLE001 - recorded, the other modes still run
            results[mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(mode, "FAILED", results[mode]["error"], flush=True)
            continue
        finally:
            fused_dispatch.MAX_ROWS = max_rows
        dumps[mode] = [[(r.tokens, r.logprobs) for r in o] for o in outs]
        if "roofline" not in results:
            results["roofline"] = roofline(args, model, outs[-1], peak)
        if base != "default":
            if ref is None:
                ref, ref_mode = outs, mode
            else:  # every timed call: the same tokens and logprob bits
                r["same_tokens_and_bits_as_" + ref_mode] = all(_same(x, y) for x, y in zip(outs, ref, strict=True))
        r["fraction_of_roofline"] = r["tokens_per_s"] / results["roofline"]["roofline_tokens_per_s"]
        results[mode] = r
        calls = " ".join(f"{t:.3f}" for t in r["calls_seconds"])
        print(f"{mode:8s} {r['tokens']:7d} tok {r['seconds']:7.3f} s {r['tokens_per_s']:9.0f} tok/s "
              f"{100 * r['fraction_of_roofline']:5.1f}% roofline  calls [{calls}] s  captures "
              f"{r['calls_graph_captures']}  mismatched {r.get('mismatched_tokens', '-')}  "
              f"same bits {r.get('same_tokens_and_bits_as_' + str(ref_mode), '-')}", flush=True)
        write(results)  # after every mode: a run stopped later keeps what it measured
    path = write(results)
    print(json.dumps({k: v for k, v in results.items() if k != "roofline"}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
