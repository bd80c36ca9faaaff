"""Topology-invariant training on GPUs: trainer EP 1 vs EP 2 (NCCL), Triton backend, bench-moe.

    python experiments/train/gpu_topology.py [--model bench-moe] [--steps 3] [--samples 32] [--out DIR]

Runs `steps` RL updates (2 minibatches each) of the same batch at trainer EP 1 (one GPU) and EP 2
(two GPUs), with trainer.topology_invariant true, and compares the gradients, AdamW moments and
fp32 weights bitwise (unsharded); the twin topology_invariant=false at EP 2 must differ. Step
times (median of the second half of the steps: the first half compiles Triton specialisations)
of EP 2 invariant vs the twin give the overhead. Prints a table and writes
DIR/topology_<device>_<model>.json. `--device cpu --backend torch --model tiny-moe` is the CPU rehearsal.
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


def _rank(rank, world, group, cfg_dict, n, steps, profile=False):
    from rlalign import kernels
    from rlalign.parallel.ep import is_expert_param
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    if cfg.device.startswith("cuda"):
        cfg.device = f"cuda:{rank}"
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, group)
    g = torch.Generator().manual_seed(0)
    vocab = tr.model.args.vocab_size
    rand = lambda lo, hi: torch.randint(2, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),),  # noqa: E731
                                        generator=g).tolist()
    longest = min(320, tr.model.args.max_position_embeddings) - 64  # prompt + response fit the context
    samples = []
    for i in range(n):
        response = rand(longest // 8, longest)
        samples.append(Sample(rand(16, 64), response, torch.full((len(response),), -2.0), float(i % 3 - 1), i,
                              params=SamplingParams.from_config(cfg)))
    alg = OmegaConf.create({**cfg_dict["algorithm"], "num_minibatches": 2})
    cuda = cfg.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for k in range(steps):
        sync()
        t = time.perf_counter()
        if profile and rank == 0 and k == steps - 1:
            with torch.profiler.profile() as prof:
                tr.train_step(samples, alg)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
        else:
            tr.train_step(samples, alg)
        sync()
        times.append(time.perf_counter() - t)
    fps = {}
    from rlalign.fingerprint import fingerprint

    for name in tr.names:  # the bitwise comparison: unsharded tensors' fingerprints
        st = tr.opt.state[tr.master[name]]
        for key, t in (("grad", tr.grads[name]), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"]),
                       ("master", tr.master[name].data)):
            if world > 1 and is_expert_param(name):
                parts = [torch.empty_like(t) for _ in range(world)]
                torch.distributed.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts, 0)
            fps[f"{key}/{name}"] = fingerprint(t)
    return {"fps": fps, "step_s": times, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-moe")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="profile EP 2 invariant's last step (rank 0)")
    ap.add_argument("--backend", default="triton")
    a = ap.parse_args()

    def run(ep, invariant, profile=False):
        cfg = load_config([f"model={a.model}", f"device={a.device}", f"kernels.backend={a.backend}",
                           f"trainer.ep_size={ep}", f"trainer.micro_batch_size={a.micro_batch_size}",
                           f"trainer.topology_invariant={str(invariant).lower()}"])
        args = (OmegaConf.to_container(cfg, resolve=True), a.samples, a.steps, profile)
        return launch.run_workers(ep, _rank, args, a.device, 600)

    ref, ep2, twin = run(1, True), run(2, True, a.profile), run(2, False)
    diff = sorted(k for k in ref[0]["fps"] if ref[0]["fps"][k] != ep2[0]["fps"][k])
    twin_diff = sorted(k for k in ref[0]["fps"] if ref[0]["fps"][k] != twin[0]["fps"][k])
    warm = a.steps // 2  # the first half compiles Triton specialisations as new shapes come up
    med = lambda outs: max(statistics.median(o["step_s"][warm:]) for o in outs)  # noqa: E731
    fastest = lambda outs: max(min(o["step_s"]) for o in outs)  # noqa: E731
    res = {"model": a.model, "device": a.device, "backend": a.backend, "samples": a.samples,
           "micro_batch_size": a.micro_batch_size, "steps": a.steps,
           "tensors_compared": len(ref[0]["fps"]), "ep1_vs_ep2_differing": diff,
           "twin_ep1_vs_ep2_current_differing": len(twin_diff),
           "train_step_s_ep1_invariant": med(ref), "train_step_s_ep2_invariant": med(ep2),
           "train_step_s_ep2_current": med(twin), "ratio_invariant_over_current": med(ep2) / med(twin),
           "fastest_step_s_ep2_invariant": fastest(ep2), "fastest_step_s_ep2_current": fastest(twin),
           "ratio_fastest_invariant_over_current": fastest(ep2) / fastest(twin),
           "peak_gib_ep1": ref[0]["peak_gib"], "peak_gib_ep2_invariant": ep2[0]["peak_gib"],
           "peak_gib_ep2_current": twin[0]["peak_gib"],
           "step_s_all": {"ep1_invariant": [o["step_s"] for o in ref], "ep2_invariant": [o["step_s"] for o in ep2],
                          "ep2_current": [o["step_s"] for o in twin]}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"topology_{a.device}_{a.model}.json").write_text(json.dumps({**environment(), **res}, indent=1) + "\n")
    print(f"{'check':52s} result")
    n = len(ref[0]["fps"])
    print(f"{'EP1 vs EP2 invariant: tensors differing':52s} {len(diff)} of {n}")
    print(f"{'twin EP1 vs EP2 current: tensors differing':52s} {len(twin_diff)} of {n}")
    print(f"{'train_step EP2 invariant / current (median s)':52s} {med(ep2):.3f} / {med(twin):.3f} = "
          f"{res['ratio_invariant_over_current']:.3f}")
    print(f"{'train_step EP2 invariant / current (fastest s)':52s} {fastest(ep2):.3f} / {fastest(twin):.3f} = "
          f"{res['ratio_fastest_invariant_over_current']:.3f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
