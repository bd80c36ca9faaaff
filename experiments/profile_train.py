"""Where the trainer's step spends its time on one GPU: Trainer.train_step (forward_backward +
optimizer_step) of configs/model/bench-moe.yaml at trainer EP 1 (group=None) on an RL-shaped
batch (128 sequences of prompt ~64 + response up to 256 tokens, micro_batch_size 32, packed),
deterministic Triton kernels vs the default ones (`kernels.mode=default`), in one process.

Per variant: one warm-up step, then --steps timed steps (fresh samples each step, the same sample
sets for every variant), wall time per phase (each phase fenced by torch.cuda.synchronize: forward
= score_micro_batch, backward = Tensor.backward, loss = policy_loss and its host copies, tree_add =
TreeSum.add, tree = TreeSum.total,
optimizer = optimizer_step (grad_norm, AdamW step, the copy back)), the number and wall time of
Triton JIT compilations, then one step under torch.profiler: CUDA time per kernel name (top N) and
the host's top ops. Prints a table last; writes results/train_profile_<model>_<gpu>[_<name>].json.

    python experiments/profile_train.py [--variants det,det_nofill,default] [--steps 3] [--out DIR]

Variants: det (kernels.mode=deterministic backend=triton, torch.use_deterministic_algorithms as
rlalign.factory.apply_kernels sets it, which also fills every torch.empty with NaN), det_nofill (the
same with torch.utils.deterministic.fill_uninitialized_memory=False), default (kernels.mode=default,
deterministic algorithms off).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config  # noqa: E402

PHASES = ("forward", "loss", "backward", "tree_add", "tree_total", "optimizer", "grad_norm", "adamw")


# name -> (kernels mode, deterministic algorithms, fill uninitialised memory)
VARIANTS = {
    "det": ("deterministic", True, True),
    "det_nofill": ("deterministic", True, False),
    "default": ("default", False, True),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timers:
    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)
        self.on = True

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            if not self.on:
                return fn(*a, **k)
            _sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _sync()
                self.t[name] += time.perf_counter() - t0
                self.n[name] += 1
        return inner

    def take(self):
        out = {k: round(v, 6) for k, v in self.t.items()}
        self.t.clear()
        self.n.clear()
        return out


def _install(timers: Timers, trainer) -> None:
    import rlalign.training.trainer as tr
    from rlalign.training.reduce import TreeSum

    tr.score_micro_batch = timers.wrap("forward", tr.score_micro_batch)
    tr.policy_loss = timers.wrap("loss", tr.policy_loss)
    torch.Tensor.backward = timers.wrap("backward", torch.Tensor.backward)
    TreeSum.add = timers.wrap("tree_add", TreeSum.add)
    TreeSum.total = timers.wrap("tree_total", TreeSum.total)
    tr.Trainer.optimizer_step = timers.wrap("optimizer", tr.Trainer.optimizer_step)
    tr.Trainer.grad_norm = timers.wrap("grad_norm", tr.Trainer.grad_norm)
    trainer.opt.step = timers.wrap("adamw", trainer.opt.step)


_COMPILES: list = []  # (kernel name, seconds)


def _count_compiles() -> bool:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    if not hasattr(JITFunction, "_do_compile"):
        return False
    orig = JITFunction._do_compile

    def _do_compile(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            _COMPILES.append((getattr(self, "__name__", "?"), time.perf_counter() - t0))

    JITFunction._do_compile = _do_compile
    return True


def make_samples(step: int, n: int, prompt: int, resp: int, vocab: int):
    """n samples with prompt lengths prompt±12 and responses of resp-16..resp tokens (random tokens,
    seeded by step): the RL run's shape (short prompts, responses near max_new_tokens)."""
    from rlalign.training.trainer import Sample

    rng = random.Random(1000 + step)
    out = []
    for i in range(n):
        p = [rng.randrange(2, vocab) for _ in range(rng.randint(max(1, prompt - 12), prompt + 12))]
        r = [rng.randrange(2, vocab) for _ in range(rng.randint(max(1, resp - 16), resp))]
        lp = torch.tensor([-rng.random() * 4 for _ in r], dtype=torch.float32)
        out.append(Sample(p, r, lp, advantage=rng.uniform(-1, 1), sample_id=step * n + i))
    return out


CHURN_T = [8203, 8192, 8208, 8256, 8320, 8385, 8449, 8465, 8464, 8128, 8001, 8017]


def churn(model, vocab: int, device: str, token_counts=None, expert_rows=(900, 1400)) -> dict:
    """New batch compositions after the warm-up: one packed micro-batch forward+backward per token
    count in CHURN_T (residues mod 16 and 64 that differ), then the per-source EP path's grouped
    GEMM (host-list counts) forward+backward for 8 new count vectors; Triton compilations each."""
    g = torch.Generator(device="cpu").manual_seed(7)
    rows = []
    for T in token_counts or CHURN_T:
        lens = [256] * (T // 256) + ([T % 256] if T % 256 else [])
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        tokens = torch.randint(2, vocab, (T,), generator=g).to(device)
        n0 = len(_COMPILES)
        _sync()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        kernels.token_logprobs(model(tokens, cu)[:-1], tokens[1:]).sum().backward()
        _sync()
        comp = _COMPILES[n0:]
        rows.append({"tokens": T, "wall_s": round(time.perf_counter() - t0, 4), "triton_compiles": len(comp),
                     "compile_s": round(sum(c[1] for c in comp), 3), "compiled": sorted({c[0] for c in comp})})
    model.zero_grad(set_to_none=True)
    grouped = []
    d = model.args.hidden_size
    w = (torch.randn(16, d, d, generator=g) * 0.02).to(device, torch.bfloat16).requires_grad_()
    for _ in range(8):
        counts = [int(c) for c in torch.randint(expert_rows[0], expert_rows[1], (16,), generator=g)]
        x = torch.randn(sum(counts), d, generator=g).to(device, torch.bfloat16).requires_grad_()
        n0 = len(_COMPILES)
        _sync()
        t0 = time.perf_counter()
        kernels.grouped_linear(x, w, counts).float().sum().backward()
        _sync()
        comp = _COMPILES[n0:]
        grouped.append({"rows": sum(counts), "wall_s": round(time.perf_counter() - t0, 4),
                        "triton_compiles": len(comp), "compile_s": round(sum(c[1] for c in comp), 3),
                        "compiled": sorted({c[0] for c in comp})})
    for name, rs in (("micro-batch", rows), ("grouped (list counts)", grouped)):
        print(f"-- churn {name}: " + ", ".join(f"{r.get('tokens', r.get('rows'))}:{r['triton_compiles']}"
                                                for r in rs) + f"; compile {sum(r['compile_s'] for r in rs):.2f} s",
              flush=True)
    return {"micro_batches": rows, "grouped_list_counts": grouped,
            "compiles_total": sum(r["triton_compiles"] for r in rows + grouped),
            "compile_s_total": round(sum(r["compile_s"] for r in rows + grouped), 3)}


def kernel_table(prof, top: int):
    from torch.autograd import DeviceType

    ev = prof.key_averages()
    kern = [e for e in ev if getattr(e, "device_type", None) == DeviceType.CUDA and e.self_device_time_total > 0]
    if not kern:  # older/newer profilers: kernels are the rows with device time that are not aten ops
        kern = [e for e in ev if e.self_device_time_total > 0 and not e.key.startswith(("aten::", "cuda"))]
    busy = sum(e.self_device_time_total for e in kern) / 1000
    rows = [{"name": e.key[:100], "calls": e.count, "device_ms": round(e.self_device_time_total / 1000, 3)}
            for e in sorted(kern, key=lambda e: -e.self_device_time_total)[:top]]
    host = [{"name": e.key[:100], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3)}
            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]]
    launches = sum(e.count for e in kern)
    kset = {id(e) for e in kern}
    ops = [{"name": e.key[:100], "calls": e.count, "device_ms_incl": round(e.device_time_total / 1000, 3)}
           for e in sorted((e for e in ev if id(e) not in kset and e.device_time_total > 0),
                           key=lambda e: -e.device_time_total)[:top]]
    return busy, launches, rows, host, ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-moe")
    ap.add_argument("--variants", default="det,det_nofill,default")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--resp", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=32, help="trainer.micro_batch_size")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting variants past this")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (torch backend)")
    ap.add_argument("--churn", action="store_true", help="after the variants: compilations on new batch shapes")
    a = ap.parse_args()
    backend = "triton" if a.device == "cuda" else "torch"

    t_start = time.perf_counter()
    compiles_counted = _count_compiles()
    cfg = load_config([f"model={a.model}", f"device={a.device}", f"kernels.backend={backend}", "trainer.ep_size=1",
                       f"trainer.micro_batch_size={a.mbs}"])
    from rlalign.training.trainer import Trainer

    kernels.set_mode("deterministic", backend)
    trainer = Trainer(cfg, None)
    alg = cfg.algorithm
    timers = Timers()
    _install(timers, trainer)
    vocab = cfg.model.vocab_size
    batches = [make_samples(s, a.seqs, a.prompt, a.resp, vocab) for s in range(a.steps + 2)]
    tokens = [sum(len(s.prompt) + len(s.response) for s in b) for b in batches]
    results = {}
    for name in a.variants.split(","):
        if time.perf_counter() - t_start > a.budget_s:
            print(f"-- {name}: skipped (past --budget-s)", flush=True)
            continue
        mode, det_alg, fill = VARIANTS[name]
        torch.use_deterministic_algorithms(det_alg, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        rec = {"mode": mode, "deterministic_algorithms": det_alg, "fill_uninitialized_memory": fill, "steps": []}
        with kernels.use(mode=mode, backend=backend):
            for s in range(a.steps + 1):  # step 0: warm-up (compiles)
                n0 = len(_COMPILES)
                _sync()
                t0 = time.perf_counter()
                trainer.train_step(batches[s], alg)
                _sync()
                wall = time.perf_counter() - t0
                comp = _COMPILES[n0:]
                step = {"step": s, "tokens": tokens[s], "wall_s": round(wall, 4), "phases_s": timers.take(),
                        "triton_compiles": len(comp), "compile_s": round(sum(c[1] for c in comp), 3),
                        "compiled": sorted({c[0] for c in comp})}
                rec["steps"].append(step)
                print(f"-- {name} step {s}: {wall:.3f} s, {tokens[s]} tokens, compiles {len(comp)} "
                      f"({step['compile_s']:.2f} s) {json.dumps(step['phases_s'])}", flush=True)
            timed = rec["steps"][1:]
            rec["median_wall_s"] = sorted(x["wall_s"] for x in timed)[len(timed) // 2] if timed else None
            rec["median_phases_s"] = {p: sorted(x["phases_s"].get(p, 0.0) for x in timed)[len(timed) // 2]
                                      for p in PHASES} if timed else {}
            if not a.no_profile:
                from torch.profiler import ProfilerActivity, profile

                timers.on = False
                _sync()
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
                with profile(activities=acts) as prof:
                    t0 = time.perf_counter()
                    trainer.train_step(batches[a.steps + 1], alg)
                    _sync()
                    wall = time.perf_counter() - t0
                timers.on = True
                busy, launches, rows, host, ops = kernel_table(prof, a.top)
                rec["profile"] = {"wall_s_under_profiler": round(wall, 4), "device_busy_ms": round(busy, 2),
                                  "kernel_launches": launches, "top_kernels": rows, "top_host_ops": host,
                                  "top_ops_device_incl": ops}
        results[name] = rec
    churn_rec = None
    if a.churn:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        with kernels.use(mode="deterministic", backend=backend):
            churn_rec = churn(trainer.model, vocab, a.device)
    torch.use_deterministic_algorithms(False)

    # --- the table, last ---------------------------------------------------------------------
    print("\n== wall time per phase (median of timed steps, s)")
    names = list(results)
    print(f"{'phase':<12}" + "".join(f"{n:>14}" for n in names))
    for p in ("step",) + PHASES:
        vals = [results[n]["median_wall_s"] if p == "step" else results[n]["median_phases_s"].get(p, 0.0)
                for n in names]
        print(f"{p:<12}" + "".join(f"{v:>14.4f}" for v in vals))
    for n in names:
        pr = results[n].get("profile")
        if not pr:
            continue
        print(f"\n== {n}: top kernels by CUDA time (one step: device busy {pr['device_busy_ms']:.1f} ms, "
              f"{pr['kernel_launches']} launches, wall {pr['wall_s_under_profiler']:.3f} s under the profiler)")
        for r in pr["top_kernels"]:
            print(f"  {r['device_ms']:9.2f} ms {r['calls']:6d}x  {r['name']}")
        print("  -- ops (autograd nodes, aten) by device time of the kernels under them:")
        for r in pr["top_ops_device_incl"][:15]:
            print(f"  {r['device_ms_incl']:9.2f} ms {r['calls']:6d}x  {r['name']}")
        print("  -- host, top self CPU:")
        for r in pr["top_host_ops"][:8]:
            print(f"  {r['self_cpu_ms']:9.2f} ms {r['calls']:6d}x  {r['name']}")
    payload = {"setup": {"model": a.model, "seqs": a.seqs, "prompt": a.prompt, "resp": a.resp,
                         "micro_batch_size": a.mbs, "trainer_ep": 1, "layout": "packed", "steps": a.steps,
                         "tokens_per_step": tokens, "compiles_counted": compiles_counted},
               "variants": results, "churn": churn_rec}
    gpu = torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else "cpu"
    out = a.out or os.environ.get("OUT")
    print("wrote", record.write(f"train_profile_{a.model}_{gpu}" + (f"_{a.name}" if a.name else ""), payload, out))


if __name__ == "__main__":
    main()
