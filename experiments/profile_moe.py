"""Where the deterministic MoE step spends its time: torch.profiler over one forward+backward of
configs/model/bench-moe.yaml (4096 tokens), deterministic (triton) vs default; prints the top CUDA
kernels and the kernel-launch counts, writes results/profile_moe_<model>_<gpu>[_<name>].json.

    python experiments/profile_moe.py [--model NAME] [--out DIR] [--name SUFFIX]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402
from grouped_mm import grouped_mm  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.model import build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--model", default="bench-moe")
    ap.add_argument("--name", default="", help="suffix of the result name")
    a = ap.parse_args()
    args = model_args(load_config([f"model={a.model}"]))
    model = build_model(args, "bfloat16", seed=0, device="cuda")
    tokens = torch.randint(2, args.vocab_size, (4096,), device="cuda")
    cu = [0, 1024, 2048, 3072, 4096]
    out = {}
    for label, mode, backend in (("default", "default", "torch"), ("default_grouped_mm", "default", "torch"),
                                 ("deterministic", "deterministic", "triton")):
        with grouped_mm(label == "default_grouped_mm"), kernels.use(mode=mode, backend=backend):
            def step():
                model.zero_grad(set_to_none=True)
                kernels.token_logprobs(model(tokens, cu)[:-1], tokens[1:]).mean().backward()

            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            cuda = sorted([e for e in ev if e.device_time_total > 0], key=lambda e: -e.device_time_total)
            total_dev = sum(e.self_device_time_total for e in ev) / 1000
            launches = sum(e.count for e in ev if e.key.startswith("cudaLaunchKernel") or e.key == "cuLaunchKernel")
            rows = [{"name": e.key[:90], "calls": e.count, "device_ms": e.self_device_time_total / 1000}
                    for e in sorted(ev, key=lambda e: -e.self_device_time_total)[: a.top]]
            wall = max(e.cpu_time_total for e in ev) / 1000
            cpu_rows = [{"name": e.key[:90], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1000}
                        for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:10]]
            out[label] = {"device_ms_total": total_dev, "kernel_launches": launches, "cpu_ms_top_op": wall,
                          "top_kernels": rows, "top_cpu": cpu_rows}
            print(f"== {label}: device busy {total_dev:.1f} ms, launches {launches}")
            for r in rows:
                print(f"  {r['device_ms']:8.2f} ms  {r['calls']:6d}x  {r['name']}")
            print(f"  -- host (self CPU) time, total {sum(e.self_cpu_time_total for e in ev) / 1000:.1f} ms:")
            for r in cpu_rows:
                print(f"  {r['self_cpu_ms']:8.2f} ms  {r['calls']:6d}x  {r['name']}")
            del cuda
    gpu = torch.cuda.get_device_name(0).replace(" ", "_")
    print("wrote", record.write(f"profile_moe_{a.model}_{gpu}" + (f"_{a.name}" if a.name else ""), out, a.out))


if __name__ == "__main__":
    main()
