"""Tokens/s of generation and of trainer forward+backward for the tiny MoE on CPU,
deterministic vs default kernels, as ratios measured in the same run.

    python experiments/kernels/bench_core.py [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.model import build_model  # noqa: E402
from rlalign.rollout.native.engine import generate  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402
from rlalign.training.scoring import score  # noqa: E402


def _median_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(mode, args, dtype, prompts, params, a) -> dict:
    with kernels.use(mode=mode):
        model = build_model(args, dtype, seed=0)
        ids = list(range(len(prompts)))
        outs = generate(model, prompts, ids, params)
        gen_tokens = sum(len(o.tokens) for o in outs)
        t_gen = _median_time(lambda: generate(model, prompts, ids, params), a.repeats)
        P, R = [o.prompt for o in outs], [o.tokens for o in outs]
        n_tok = sum(len(p) + len(r) for p, r in zip(P, R))

        def train_step():
            model.zero_grad(set_to_none=True)
            lps = score(model, P, R, params, micro_batch_size=a.micro_batch)
            (-torch.cat(lps).mean()).backward()

        t_train = _median_time(train_step, a.repeats)
    return {"generate_tokens_per_s": gen_tokens / t_gen, "generate_s": t_gen, "train_tokens_per_s": n_tok / t_train,
            "train_step_s": t_train, "generated_tokens": gen_tokens, "train_tokens": n_tok}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = load_config([])
    args = model_args(cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (int(torch.randint(4, 17, (1,), generator=g)),), generator=g).tolist()
               for _ in range(a.prompts)]
    params = SamplingParams(max_new_tokens=a.new_tokens, eos_token_id=None, seed=0)
    rows = []
    for dtype in ("bfloat16", "float32"):
        res = {mode: _measure(mode, args, dtype, prompts, params, a) for mode in ("deterministic", "default")}
        d, f = res["deterministic"], res["default"]
        rows.append({"dtype": dtype, **{f"{m}_{k}": v for m in res for k, v in res[m].items()},
                     "generate_speed_ratio_det_over_default": d["generate_tokens_per_s"] / f["generate_tokens_per_s"],
                     "train_speed_ratio_det_over_default": d["train_tokens_per_s"] / f["train_tokens_per_s"]})
    setup = {"model": "tiny-moe", "prompts": a.prompts, "max_new_tokens": a.new_tokens,
             "micro_batch_size": a.micro_batch, "repeats": a.repeats, "timing": "median wall-clock after 1 warm-up"}
    path = record.write("core_cpu_tokens_per_s", {"setup": setup, "rows": rows}, a.out)
    print(f"{'dtype':9} {'gen det tok/s':>14} {'gen def tok/s':>14} {'ratio':>6} {'train det tok/s':>16} "
          f"{'train def tok/s':>16} {'ratio':>6}")
    for r in rows:
        cells = [r["deterministic_generate_tokens_per_s"], r["default_generate_tokens_per_s"],
                 r["generate_speed_ratio_det_over_default"], r["deterministic_train_tokens_per_s"],
                 r["default_train_tokens_per_s"], r["train_speed_ratio_det_over_default"]]
        print(f"{r['dtype']:9} {cells[0]:14.0f} {cells[1]:14.0f} {cells[2]:6.2f} {cells[3]:16.0f} {cells[4]:16.0f} "
              f"{cells[5]:6.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
