"""Cost of topology-invariant training: the trainer's update step at the same EP size with
trainer.topology_invariant=true (one tree over global micro-batches, per-source expert weight
gradients) vs false (per rank, then over ranks in rank order), in the same run.

    python experiments/train/bench_topology.py [--ep 2] [--device cpu] [--samples 32] [--repeats 5]

Writes experiments/results/topology_<device>_ep<N>.json (medians of `repeats` train_step calls
after one warm-up, and the ratio invariant / current).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
from record import RESULTS, environment  # noqa: E402

from rlalign.config import load_config  # noqa: E402
from rlalign.parallel import launch  # noqa: E402


def _rank(rank, world, group, cfg_dict, n, repeats):
    from rlalign import kernels
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, group)
    g = torch.Generator().manual_seed(0)
    rand = lambda k: torch.randint(2, 60, (k,), generator=g).tolist()  # noqa: E731
    params = SamplingParams.from_config(cfg)
    samples = [Sample(rand(8), rand(24), torch.full((24,), -2.0), float(i % 3 - 1), i, params=params) for i in range(n)]
    alg = OmegaConf.create(cfg_dict["algorithm"])
    times = []
    for _ in range(repeats + 1):
        if group is not None:
            torch.distributed.barrier(group=group)
        t = time.perf_counter()
        tr.train_step(samples, alg)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="tiny-moe")
    a = ap.parse_args()
    res = {}
    for invariant in (True, False):
        cfg = load_config([f"model={a.model}", f"device={a.device}", f"trainer.ep_size={a.ep}",
                           f"trainer.micro_batch_size={a.micro_batch_size}",
                           f"trainer.topology_invariant={str(invariant).lower()}"])
        args = (OmegaConf.to_container(cfg, resolve=True), a.samples, a.repeats)
        per_rank = launch.run_workers(a.ep, _rank, args, a.device) if a.ep > 1 else [_rank(0, 1, None, *args)]
        res["invariant" if invariant else "current"] = {"train_step_s_median": max(per_rank)}
    res["ratio_invariant_over_current"] = (res["invariant"]["train_step_s_median"]
                                           / res["current"]["train_step_s_median"])
    out = {**environment(), "model": a.model, "device": a.device, "trainer_ep": a.ep, "samples": a.samples,
           "micro_batch_size": a.micro_batch_size, "repeats": a.repeats, **res}
    path = RESULTS / f"topology_{a.device}_ep{a.ep}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
