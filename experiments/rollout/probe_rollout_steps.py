"""Where a rollout's wall time goes, step by step: the native engine (deterministic Triton kernels,
CUDA graphs, the config defaults) on bench-moe-large with bench_rollout_scale.py's prompts (8-200
tokens). Every ModelRunner.run is bracketed by CUDA events: a step's device time (its kernels and any
launch gaps inside it) and the device's idle time between steps, summed by kind (steps run eagerly:
prompt rows over ModelRunner.graph_rows; graph replays: decode steps and smaller steps with prompt rows).
Then kernel tables: the largest decode graph replayed at the call's last (longest) contexts, and the
prefill alone (a generate() sampling one token).

    python experiments/rollout/probe_rollout_steps.py [--model M] [--cases 256x256,2048x256] [--top-p P --temperature T]
        [--out DIR] [--host-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
from record import RESULTS, gpu_tag, write  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.model import build_model  # noqa: E402
from rlalign.rollout.native.engine import NativeEngine  # noqa: E402
from rlalign.rollout.native.runner import ModelRunner  # noqa: E402
from rlalign.rollout.types import EngineConfig  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402


def prompts_of(B: int, vocab: int) -> list[list[int]]:
    """bench_rollout_scale.py's prompts for B rows."""
    g = torch.Generator().manual_seed(B)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(8, 201, (B,), generator=g)]


class StepTimer:
    """ModelRunner.run wrapped: per step (rows, samples, prompt rows, graph, context sum, events)."""

    def __init__(self):
        self.rec: list[dict] = []
        self.orig = ModelRunner.run
        timer = self

        def run(runner, step, previous=None):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0, replays = time.perf_counter(), runner.stats["graph_steps"]
            out = timer.orig(runner, step, previous)
            host = time.perf_counter() - t0
            e1.record()
            n, s = len(step.rows), len(step.sample_at)
            timer.rec.append(dict(rows=n, samples=s, graph=runner.stats["graph_steps"] > replays, e0=e0, e1=e1,
                                  host=host, ctx=sum(p + 1 for _, p in step.rows) if n == s else 0))
            return out

        ModelRunner.run = run

    def table(self, start=None, end=None) -> dict:
        """start / end: events recorded just before generate() and after its return (the device time
        before the first step: the host's set-up; after the last: the read-back and assembly)."""
        torch.cuda.synchronize()
        r = self.rec
        for a in r:
            a["gpu"] = a["e0"].elapsed_time(a["e1"]) / 1e3
        idle = [r[i]["e1"].elapsed_time(r[i + 1]["e0"]) / 1e3 for i in range(len(r) - 1)]
        kinds = {"prefill_steps": [a for a in r if not a["graph"]], "decode_steps": [a for a in r if a["graph"]]}
        out = {k: {"steps": len(v), "gpu_s": sum(a["gpu"] for a in v), "host_enqueue_s": sum(a["host"] for a in v),
                   "rows": sum(a["rows"] for a in v)} for k, v in kinds.items()}
        out["idle_between_steps_s"] = max(0.0, sum(idle))
        if start is not None and r:
            out["before_first_step_s"] = start.elapsed_time(r[0]["e0"]) / 1e3
            out["after_last_step_s"] = r[-1]["e1"].elapsed_time(end) / 1e3
        dec = kinds["decode_steps"]
        pick = sorted({0, len(dec) // 4, len(dec) // 2, 3 * len(dec) // 4, len(dec) - 1}) if dec else []
        out["decode_curve"] = [{"i": i, "rows": dec[i]["rows"], "ctx_sum": dec[i]["ctx"],
                                "ms": 1e3 * dec[i]["gpu"]} for i in pick]
        by_rows: dict = {}
        for a in dec:
            b = by_rows.setdefault(1 << max(0, (a["rows"] - 1).bit_length()), [0, 0.0])
            b[0], b[1] = b[0] + 1, b[1] + a["gpu"]
        out["decode_by_bucket"] = {str(k): {"steps": v[0], "gpu_s": v[1]} for k, v in sorted(by_rows.items())}
        out["prefill_detail"] = [{"rows": a["rows"], "samples": a["samples"], "ms": 1e3 * a["gpu"],
                                  "host_ms": 1e3 * a["host"]} for a in kinds["prefill_steps"]]
        return out


def kernel_table(fn, reps: int = 1, top: int = 24) -> tuple[float, list]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:80], (getattr(e, "device_time_total", None) or e.cuda_time_total) / reps / 1e3, e.count / reps)
            for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda x: -x[1])
    return sum(x[1] for x in rows), rows[:top]


def probe(model, args, B: int, new: int, timer: StepTimer, host_profile: bool = False,
          sampling: dict | None = None) -> dict:
    """sampling: SamplingParams fields beside the defaults (temperature 1, no filter), e.g. top_p."""
    prompts, ids = prompts_of(B, args.vocab_size), list(range(B))
    eng = NativeEngine(model, EngineConfig())
    sampling = {"temperature": 1.0, "seed": 7, **(sampling or {})}
    params = SamplingParams(max_new_tokens=new, **sampling)
    eng.generate(prompts, ids, params)  # compile, capture
    timer.rec.clear()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    outs = eng.generate(prompts, ids, params)
    end.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "tokens": sum(len(o.tokens) for o in outs), **timer.table(start, end),
           "stats": dict(eng.stats)}
    if host_profile:  # a third call under cProfile: where the host's time goes (its wall is not the one above)
        prof = cProfile.Profile()
        prof.enable()
        eng.generate(prompts, ids, params)
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        res["host_profile_tottime"] = text.getvalue().splitlines()[-40:]
    res["tokens_per_s"] = res["tokens"] / wall
    graphs = eng.state.graphs
    size = max(graphs.graphs)
    graph = graphs.graphs[size][0]
    ms, top = kernel_table(graph.replay, reps=3)
    res["last_decode_replay"] = {"bucket": size, "kernel_ms": ms, "top": top}
    one = SamplingParams(max_new_tokens=1, **sampling)
    eng.generate(prompts, ids, one)
    ms, top = kernel_table(lambda: eng.generate(prompts, ids, one))
    res["prefill_only"] = {"prompt_tokens": sum(len(p) for p in prompts), "kernel_ms": ms, "top": top}
    eng.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-moe-large")
    ap.add_argument("--cases", default="256x256,2048x256")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default=None, help="result name (default probe_rollout_steps_<card>, e.g. _h200)")
    ap.add_argument("--host-profile", action="store_true", help="one more call per case under cProfile")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="e.g. 0.95 with --temperature 0.8: bench_rollout_scale's "
                    "top-p case (the filter's share of a decode step in the kernel table)")
    a = ap.parse_args()
    a.name = a.name or f"probe_rollout_steps_{gpu_tag()}"
    sampling = {"temperature": a.temperature, "top_p": a.top_p}
    args = model_args(load_config([f"model={a.model}"]))
    model = build_model(args, "bfloat16", seed=0, device="cuda")
    timer = StepTimer()
    results = {}
    with kernels.use(mode="deterministic", backend="triton"):
        for case in a.cases.split(","):
            B, new = (int(x) for x in case.split("x"))
            try:
                results[case] = r = probe(model, args, B, new, timer, a.host_profile, sampling)
            except Exception as e:  # noqa: BLE001 - recorded, the next case still runs
                results[case] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(case, "FAILED", results[case]["error"], flush=True)
                continue
            torch.cuda.empty_cache()
            print(f"\n== {case}: wall {r['wall_s']:.3f} s, {r['tokens_per_s']:,.0f} tok/s, stats {r['stats']}")
            for k in ("prefill_steps", "decode_steps"):
                v = r[k]
                print(f"  {k:14s} {v['steps']:4d} steps {v['rows']:8d} rows  gpu {v['gpu_s']:.3f} s  "
                      f"host enqueue {v['host_enqueue_s']:.3f} s")
            print(f"  idle between steps {r['idle_between_steps_s']:.3f} s, before the first step "
                  f"{r.get('before_first_step_s', 0):.3f} s, after the last {r.get('after_last_step_s', 0):.3f} s")
            print("\n".join(r.get("host_profile_tottime", [])))
            for c in r["decode_curve"]:
                print(f"  decode step {c['i']:4d}: {c['rows']:5d} rows ctx {c['ctx_sum']:8d}  {c['ms']:.2f} ms")
            print("  by bucket", r["decode_by_bucket"])
            print("  prefill steps (rows, samples, ms, host ms):",
                  [(p["rows"], p["samples"], round(p["ms"], 1), round(p["host_ms"], 1)) for p in r["prefill_detail"]])
            for label in ("last_decode_replay", "prefill_only"):
                print(f"  -- {label}: kernels {r[label]['kernel_ms']:.2f} ms")
                for k, ms, n in r[label]["top"]:
                    print(f"     {ms:9.3f} ms {n:7.0f}  {k}")
            # written after every case
            print("wrote", write(a.name, {"model": a.model, "sampling": sampling, "results": results,
                                          "what_it_shows": "per-step device time of the native engine by step kind"},
                                 a.out), flush=True)


if __name__ == "__main__":
    main()
