"""Trainer step time and generation time at EP 1/2/4 (gloo on CPU, NCCL on GPU), deterministic vs
default kernels. Timed inside the ranks (process start-up excluded), median of --repeats after
one warm-up; the slowest rank's time counts.

    python experiments/rl/bench_ep.py [--eps 1,2,4] [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign.agree import random_prompts  # noqa: E402
from rlalign.config import load_config  # noqa: E402
from rlalign.parallel.launch import run_workers, shard_range  # noqa: E402


def _timed(fn, repeats, group, device):
    fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = torch.tensor([statistics.median(times)], device="cuda" if device.startswith("cuda") else "cpu")
    if group is not None:
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return float(med)


def bench_worker(rank, world, group, cfg_dict, prompts, repeats):
    from omegaconf import OmegaConf

    from rlalign import kernels
    from rlalign.parallel.launch import Lockstep
    from rlalign.rollout.native.engine import NativeEngine
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    if cfg.device.startswith("cuda"):
        cfg.device = f"cuda:{rank}"
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    trainer = Trainer(cfg, group if world > 1 else None)
    part = shard_range(len(prompts), world, rank)
    params = SamplingParams.from_config(cfg, None, 0, cfg.agree.max_new_tokens)  # no EOS: each decodes them all
    mine = [prompts[i] for i in part]
    engine = NativeEngine(trainer.model, None, Lockstep(group) if world > 1 else None)
    gen = lambda: engine.generate(mine, list(part), params)  # noqa: E731
    outs = gen()
    t_gen = _timed(gen, repeats, group if world > 1 else None, cfg.device)
    samples = [Sample(o.prompt, o.tokens, o.logprobs, params=o.params) for o in outs]
    total = len(prompts) * params.max_new_tokens

    def loss_fn(lps, idx):
        return -torch.cat(lps).sum(), {}

    def step():
        trainer.forward_backward(samples, loss_fn, total)
        trainer.optimizer_step()

    t_train = _timed(step, repeats, group if world > 1 else None, cfg.device)
    return {"generate_s": t_gen, "train_step_s": t_train,
            "tokens": total, "train_tokens": sum(len(p) for p in prompts) + total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", default="1,2,4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for dtype in ("bfloat16",):
        for ep in map(int, a.eps.split(",")):
            res = {}
            for mode in ("deterministic", "default"):
                cfg = load_config([f"device={a.device}", f"model.dtype={dtype}", f"kernels.mode={mode}",
                                   f"trainer.ep_size={ep}", "agree.num_prompts=64", "agree.max_new_tokens=32",
                                   "trainer.micro_batch_size=8", *a.overrides])
                from omegaconf import OmegaConf

                prompts = random_prompts(cfg, cfg.model.vocab_size)
                cd = OmegaConf.to_container(cfg, resolve=True)
                if ep == 1:
                    res[mode] = bench_worker(0, 1, None, cd, prompts, a.repeats)
                else:
                    res[mode] = run_workers(ep, bench_worker, (cd, prompts, a.repeats), a.device)[0]
            d, f = res["deterministic"], res["default"]
            row = {"dtype": dtype, "ep": ep, "deterministic": d, "default": f,
                   "generate_time_ratio_det_over_default": d["generate_s"] / f["generate_s"],
                   "train_time_ratio_det_over_default": d["train_step_s"] / f["train_step_s"]}
            rows.append(row)
            print(f"EP {ep} {dtype}: generate det {d['generate_s']:.2f}s default {f['generate_s']:.2f}s "
                  f"(x{row['generate_time_ratio_det_over_default']:.2f}); train step det {d['train_step_s']:.2f}s "
                  f"default {f['train_step_s']:.2f}s (x{row['train_time_ratio_det_over_default']:.2f})", flush=True)
    setup = {"prompts": 64, "max_new_tokens": 32, "micro_batch_size": 8, "repeats": a.repeats,
             "overrides": a.overrides, "timing": "median inside ranks after 1 warm-up, slowest rank"}
    print("wrote", record.write(a.name or f"ep_bench_{a.device.split(':')[0]}", {"setup": setup, "rows": rows}, a.out))


if __name__ == "__main__":
    main()
