"""Where a rollout's time goes: the native engine on bench-moe-large, deterministic
Triton kernels, CUDA graphs on. Runs `generate` under torch.profiler (kernels inside graph replays
included) and splits the wall time into GPU kernel time by kernel family and the rest (host).

    python experiments/profile_generate.py [--model bench-moe-large] [--prompts 256] [--new 64]

Prints the top kernels and writes results/profile_generate_<model>_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, environment  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.model import build_model  # noqa: E402
from rlalign.rollout.native.engine import generate  # noqa: E402
from rlalign.rollout.types import EngineConfig, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-moe-large")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    args = model_args(load_config([f"model={a.model}"]))
    model = build_model(args, "bfloat16", seed=0, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, args.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 129, (a.prompts,), generator=g)]
    ids = list(range(a.prompts))
    params = SamplingParams(max_new_tokens=a.new, seed=1)
    res = {}
    with kernels.use(mode="deterministic", backend="triton"):
        for label, eng in (("graphs", EngineConfig(max_num_batched_tokens=4096)),
                           ("eager", EngineConfig(max_num_batched_tokens=4096, cuda_graphs=False))):
            generate(model, prompts, ids, params, engine=eng)  # compile, capture every bucket
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(model, prompts, ids, params, engine=eng)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                generate(model, prompts, ids, params, engine=eng)
                torch.cuda.synchronize()
            rows = []
            for e in prof.key_averages():
                dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if dev_us > 0 and e.device_type.name == "CUDA":
                    rows.append((e.key, dev_us, e.count))
            rows.sort(key=lambda r: -r[1])
            kernel_s = sum(r[1] for r in rows) / 1e6
            res[label] = {"wall_s": wall, "gpu_kernel_s": kernel_s, "tokens": a.prompts * a.new,
                          "tokens_per_s": a.prompts * a.new / wall,
                          "top": [{"kernel": k[:120], "seconds": us / 1e6, "calls": c} for k, us, c in rows[:a.top]]}
            print(f"\n== {label}: wall {wall:.3f}s, GPU kernels {kernel_s:.3f}s (profiled run), "
                  f"{a.prompts * a.new / wall:,.0f} tok/s")
            for k, us, c in rows[: a.top]:
                print(f"{us / 1e3:10.1f} ms {c:8d}  {k[:100]}")
    gpu = torch.cuda.get_device_name()
    out = {"command": " ".join(sys.argv), **environment(" ".join(sys.argv)), "model": a.model,
           "prompts": a.prompts, "max_new_tokens": a.new, "results": res}
    path = Path(a.out) / f"profile_generate_{a.model}_{gpu.split()[-1]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
