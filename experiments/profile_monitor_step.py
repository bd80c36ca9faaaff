"""What the monitor's default fingerprints add to a trainer step on one GPU, piece by piece: a Trainer
(trainer EP 1, deterministic Triton kernels, in this process, no Ray) on the RL step's batch shape, each
step followed by what a trainer rank does with monitor.fingerprints=default (rlalign.workers.record_train_step
+ Trace.flush, then, as colocated, fence + synchronize). Per step: the train step alone (synchronized), the
records' host time, the flush's host time, the wait for the fingerprints; then one step under
torch.profiler (kernels by name, host ops) of the monitor part alone. Prints a table; writes
results/NAME.json.

    python experiments/profile_monitor_step.py [--model bench-moe-large] [--steps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402
from profile_train import kernel_table, make_samples  # noqa: E402

from rlalign.config import load_config  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _monitor_part(trace, trainer, lps, step: int, every: int) -> dict:
    from rlalign.workers import record_train_step

    t0 = time.perf_counter()
    trace.step = step
    record_train_step(trace, trainer, lps, step % every == 0)
    t1 = time.perf_counter()
    trace.flush()
    t2 = time.perf_counter()
    trace.fence()
    _sync()
    t3 = time.perf_counter()
    return {"records_host_ms": (t1 - t0) * 1e3, "flush_host_ms": (t2 - t1) * 1e3, "wait_ms": (t3 - t2) * 1e3,
            "monitor_ms": (t3 - t0) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-moe-large")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--resp", type=int, default=256)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="profile_monitor_step_h200")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (torch backend)")
    a = ap.parse_args()
    from rlalign.factory import apply_kernels
    from rlalign.monitor.trace import Trace, fixed_environment
    from rlalign.training.trainer import Trainer

    backend = "triton" if a.device == "cuda" else "torch"
    cfg = load_config([f"model={a.model}", f"device={a.device}", f"kernels.backend={backend}", "trainer.ep_size=1"])
    apply_kernels(cfg)
    trainer = Trainer(cfg, None)
    alg = cfg.algorithm
    batches = [make_samples(s, a.seqs, a.prompt, a.resp, cfg.model.vocab_size) for s in range(a.steps + 1)]
    trace = Trace(Path(tempfile.mkdtemp()) / "trainer-rank0.jsonl", "trainer", 0, fixed_environment(cfg), 0)
    rows = []
    for s in range(a.steps + 1):  # step 0: compiles
        trace.fence()
        _sync()
        t0 = time.perf_counter()
        lps, _ = trainer.train_step(batches[s], alg)
        _sync()
        row = {"step": s, "train_ms": (time.perf_counter() - t0) * 1e3,
               **_monitor_part(trace, trainer, lps, s, cfg.monitor.optim_every)}
        rows.append(row)
        print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    # the production order: the records right after train_step returns (no synchronize between)
    prod = []
    for s in range(1, a.steps + 1):
        trace.fence()
        _sync()
        t0 = time.perf_counter()
        lps, _ = trainer.train_step(batches[s], alg)
        t1 = time.perf_counter()
        m = _monitor_part(trace, trainer, lps, a.steps + s, cfg.monitor.optim_every)
        prod.append({"train_returned_ms": (t1 - t0) * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3, **m})
        print("production order:", " ".join(f"{k} {v:.1f}" for k, v in prod[-1].items()), flush=True)
    trace.fence()
    _sync()
    lps, _ = trainer.train_step(batches[1], alg)
    _sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (a.device == "cuda")
    with torch.profiler.profile(activities=acts) as prof:
        _monitor_part(trace, trainer, lps, 2 * a.steps + 1, cfg.monitor.optim_every)
    table = kernel_table(prof, a.top)
    host = prof.key_averages().table(sort_by="cpu_time_total", row_limit=a.top)
    print(host)
    trace.close()
    timed = rows[1:]
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0] if k != "step"}
    pmed = {k: statistics.median(r[k] for r in prod) for k in prod[0]}
    res = {"model": a.model, "steps": rows, "production_order": prod, "median": med, "median_production": pmed,
           "monitor_kernels": table, "trace_bytes": trace.path.stat().st_size,
           "what_it_shows": (f"{a.model} trainer step on one GPU, monitor default's records after it: train "
                             f"{med['train_ms']:.1f} ms; records host {med['records_host_ms']:.1f} ms, flush host "
                             f"{med['flush_host_ms']:.1f} ms, wait {med['wait_ms']:.1f} ms (monitor "
                             f"{med['monitor_ms']:.1f} ms); in production order train+monitor "
                             f"{pmed['total_ms']:.1f} ms")}
    print(res["what_it_shows"])
    print(f"{'piece':24} {'ms':>8}")
    for k, v in {**med, **{f"prod_{k}": v for k, v in pmed.items()}}.items():
        print(f"{k:24} {v:8.1f}")
    print("wrote", record.write(a.name, res, a.out))


if __name__ == "__main__":
    main()
