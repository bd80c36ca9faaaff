"""Where a CUDA-graph decode step's wall time goes: bench-moe-large, 256 prompts (--prompts), deterministic
Triton kernels. Wraps the engine's graph call to time each step on the host and on the GPU (CUDA
events around copy-in + replay + copy-out), then replays the batch's graph alone, plain and under
torch.profiler (kernel time vs replay time: the gaps between the graph's kernels).

    python experiments/probe_decode_step.py [--prompts 256] [--new 64] [--top-p 1.0] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, write  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.model import build_model  # noqa: E402
from rlalign.rollout.native.engine import NativeEngine  # noqa: E402
from rlalign.rollout.native.graphs import DecodeGraphs  # noqa: E402
from rlalign.rollout.types import EngineConfig, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=128, help="prompt lengths uniform in [16, max-len]")
    ap.add_argument("--batched-tokens", type=int, default=4096, help="generator.max_num_batched_tokens")
    ap.add_argument("--skip-prefill", action="store_true", help="no prefill-alone timing and profile")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    args = model_args(load_config(["model=bench-moe-large"]))
    model = build_model(args, "bfloat16", seed=0, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, args.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(16, a.max_len + 1, (a.prompts,), generator=g)]
    ids = list(range(a.prompts))
    bucket = 1 << max(0, (a.prompts - 1).bit_length())
    sp = dict(temperature=a.temperature, top_p=a.top_p, seed=1)
    eng = EngineConfig(max_num_batched_tokens=a.batched_tokens)
    orig = DecodeGraphs.__call__
    rec, keep = [], []

    def timed(self, meta, *args, **kw):  # (meta, follow=...) since the lookahead engine
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        out = orig(self, meta, *args, **kw)
        e1.record()
        rec.append((t0, time.perf_counter(), e0, e1, meta.shape[1]))
        if not keep:
            keep.append(self)
        return out

    DecodeGraphs.__call__ = timed
    engine = NativeEngine(model, eng)
    with kernels.use(mode="deterministic", backend="triton"):
        engine.generate(prompts, ids, SamplingParams(max_new_tokens=4, **sp))  # compile, capture
        rec.clear()
        keep.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, ids, SamplingParams(max_new_tokens=a.new, **sp))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        first = rec[0][0] - t0  # prefill (eager steps) until the first graph step is called
        steps = [r for r in rec if r[4] == a.prompts]
        gpu = [s[2].elapsed_time(s[3]) / 1e3 for s in steps]
        interval = [steps[i + 1][0] - steps[i][0] for i in range(len(steps) - 1)]
        enqueue = [s[1] - s[0] for s in steps]
        idle = [steps[i][3].elapsed_time(steps[i + 1][2]) / 1e3 for i in range(len(steps) - 1)]
        if bucket not in keep[0].graphs:
            raise SystemExit(f"no decode-only step of {a.prompts} rows (graphs {sorted(keep[0].graphs)}): raise --new "
                             "above the prefill's steps")
        graph, static, _ = keep[0].graphs[bucket]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        replay = e0.elapsed_time(e1) / 10 / 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        kern = [(e.key, (getattr(e, "device_time_total", None) or e.cuda_time_total) / 3 / 1e6, e.count / 3)
                for e in prof.key_averages() if e.device_type.name == "CUDA"]
        prefill_wall, pk = float("nan"), []
        if not a.skip_prefill:
            # the prefill (eager chunks of max_num_batched_tokens rows) alone: generate() sampling one token
            one = SamplingParams(max_new_tokens=1, **sp)
            engine.generate(prompts, ids, one)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(prompts, ids, one)
            torch.cuda.synchronize()
            prefill_wall = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.generate(prompts, ids, one)
                torch.cuda.synchronize()
            pk = [(e.key, (getattr(e, "device_time_total", None) or e.cuda_time_total) / 1e6, e.count)
                  for e in prof.key_averages() if e.device_type.name == "CUDA"]
    pk.sort(key=lambda r: -r[1])
    kern.sort(key=lambda r: -r[1])
    ksum = sum(k[1] for k in kern)
    nk = sum(k[2] for k in kern)

    def med(v):
        return sorted(v)[len(v) // 2] if v else float("nan")

    res = {"new_tokens": a.new, "wall_s": wall, "prefill_until_first_graph_step_s": first,
           "prompts": a.prompts, "graph_bucket": bucket, "top_p": a.top_p, "temperature": a.temperature,
           "graph_steps": len(steps),
           "step_interval_median_s": med(interval), "step_gpu_median_s": med(gpu), "enqueue_median_s": med(enqueue),
           "gpu_idle_between_steps_median_s": med(idle), "replay_alone_s": replay, "replay_kernel_sum_s": ksum,
           "kernels_per_replay": nk, "top_kernels_per_replay": [(k[:90], s, c) for k, s, c in kern[:25]],
           "prefill_wall_s": prefill_wall, "prefill_kernel_sum_s": sum(k[1] for k in pk),
           "prefill_prompt_tokens": sum(len(p) for p in prompts),
           "prefill_top_kernels": [(k[:90], s, c) for k, s, c in pk[:20]]}
    for k, v in res.items():
        if k not in ("top_kernels_per_replay", "prefill_top_kernels"):
            print(f"{k:34s} {v:.6f}" if isinstance(v, float) else f"{k:34s} {v}")
    for k, s, c in kern[:25]:
        print(f"  {s * 1e3:8.3f} ms {c:6.0f}  {k[:90]}")
    for k, s, c in pk[:20]:
        print(f"  prefill {s * 1e3:8.3f} ms {c:6.0f}  {k[:90]}")
    name = "probe_decode_step_bench-moe-large" + (f"_{a.prompts}" if a.prompts != 256 else "") + "_H200"
    print("wrote", write(name + (f"_{a.tag}" if a.tag else ""), res, a.out))


if __name__ == "__main__":
    main()
