"""MoE dispatch of one decode step's rows: the torch counting sort (~12 launches) vs the
one-launch Triton kernel (kernels/triton/dispatch.py), timed inside CUDA graphs (as the decode
step replays them) with triton.testing.do_bench_cudagraph (median), and checked equal.

    python experiments/bench_dispatch.py [--out DIR]

Writes experiments/results/moe_dispatch_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, environment  # noqa: E402

from rlalign.kernels.triton.dispatch import moe_dispatch  # noqa: E402
from rlalign.model.model import dispatch_torch  # noqa: E402


def _bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens, e, k in ((1, 64, 8), (64, 64, 8), (256, 64, 8), (256, 128, 8), (1024, 64, 8), (2048, 64, 8)):
        flat = torch.randint(0, e, (tokens * k,), generator=g, device="cuda")
        same = all(torch.equal(x, y) for x, y in zip(dispatch_torch(flat, e), moe_dispatch(flat, e), strict=True))
        t_torch = _bench(lambda f=flat, e=e: dispatch_torch(f, e))
        t_triton = _bench(lambda f=flat, e=e: moe_dispatch(f, e))
        rows.append({"tokens": tokens, "experts": e, "top_k": k, "rows": tokens * k, "torch_us": t_torch * 1e3,
                     "triton_us": t_triton * 1e3, "speedup": t_torch / t_triton, "equal": same})
        print(f"tokens {tokens:5d} E {e:4d} rows {tokens * k:6d}: torch {t_torch * 1e3:7.1f} us  triton "
              f"{t_triton * 1e3:7.1f} us  x{t_torch / t_triton:5.2f}  equal {same}", flush=True)
    gpu = torch.cuda.get_device_name(0)
    out = {**environment(), "what": "MoE dispatch (counting sort) per MoE layer of a decode step, inside CUDA graphs",
           "results": rows}
    path = Path(a.out) / f"moe_dispatch_{gpu.replace(' ', '_')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
