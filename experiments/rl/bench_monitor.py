"""What the monitor's fingerprints cost: the kernel's bits and bandwidth, and an RL step with the
monitor on vs off (and vs default kernels). Each phase writes a part JSON; `summary` merges them.

    python experiments/rl/bench_monitor.py demo    [--steps 8 --reps 3]    CPU: `rlalign train` defaults,
                                                                         monitor off / default interleaved
    python experiments/rl/bench_monitor.py kernel  [--gb 10]               GPU bits == CPU bits; GB/s of one
                                                                         fingerprint_sums over mixed bf16/fp32
    python experiments/rl/bench_monitor.py rl --model M [--runs det:default det:off default:off] [--steps 4]
                                                                         `rlalign train` in-process, one Ray
    python experiments/rl/bench_monitor.py host    [--model M --steps 12]  CPU: the trace's host work per
                                                                         trainer step at M's record count
    python experiments/rl/bench_monitor.py summary --name NAME              parts -> results/NAME.json

A run `MODE:LEVEL` is kernels.mode=MODE (det = deterministic) with monitor.fingerprints=LEVEL, on the
issue's settings (one GPU, colocated, 16 prompts x 8 samples x 256 new tokens, synchronous saves,
no checkpoint); a step's time is the median over the steps after the first (no step writes a
checkpoint). A run named twice in --runs is repeated (e.g. det:default det:off det:off det:default: each
setting first once, so that an order effect in one process falls on both); its medians pool the
repetitions' steps after their first. --warmup-steps N: a monitor-off run of N steps first, not counted.
Tiny CPU settings of the same path: --tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

HBM_PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0}  # vendor peaks, GB/s
TIMES = ("step_s", "generate_s", "train_s", "sync_s", "sync_trainer_s", "sync_generator_s", "sync_resume_s",
         "sync_generator_call_s", "trainer_gc_s", "train_trainer_s", "train_monitor_s", "generate_engine_s",
         "generate_monitor_s")


def _part(out: Path, name: str, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"part_{name}.json").write_text(json.dumps(payload, indent=1) + "\n")


# --- the kernel ----------------------------------------------------------------------------------------
def _bit_cases(device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    big = torch.randn(512, 1000, generator=g)
    experts = torch.randn(8, 96, 64, generator=g).bfloat16()
    cases = {
        "fp32 [512,1000]": big, "bf16 [512,1000]": big.bfloat16(), "bf16 [5,3] (a padded tail)": big[:5, :3].bfloat16(),
        "int64 tokens": torch.randint(0, 151936, (4099,), generator=g), "bool": big[0] > 0,
        "transposed view": big.t()[:100], "bf16 view 2 bytes in": big.bfloat16().view(-1)[1:4097],
        "0-d": torch.tensor(1.5), "empty": torch.zeros(0, 7),
        "uint8 odd": torch.randint(0, 255, (1001,), dtype=torch.uint8, generator=g),
    }
    from rlalign.kernels.fingerprint import Part

    parts = [Part(t.to(device), name=k) for k, t in cases.items()]
    parts += [Part(experts.to(device), rows=True, name="expert rows"), Part(big[100:300].to(device), first_row=100,
                                                                             name="share rows 100..299"),
              Part(big[:4].to(device), first_row=(1 << 32) // 1000 - 1, name="share across word index 2**32")]
    return parts


def kernel(a) -> None:
    import numpy as np
    import torch

    from rlalign import kernels
    from rlalign.fingerprint import fingerprint
    from rlalign.kernels import fingerprint as fpk
    from rlalign.kernels.fingerprint import Part
    from rlalign.kernels.triton import fingerprint as tfp

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"}
    # bits: the device's sums == numpy's of the same bytes; the pinned values of tests/test_fingerprint.py
    parts = _bit_cases(dev)
    got = kernels.fingerprint_sums(parts).cpu().numpy().view(np.uint32)
    want = fpk.sums_cpu([Part(p.tensor.cpu(), p.rows, p.first_row, p.name) for p in parts])
    x = torch.arange(12, dtype=torch.float32, device=dev).reshape(3, 4)
    res["bits"] = {"device_equals_numpy": bool(np.array_equal(got, want)), "results": int(len(want)),
                   "pinned_fp32": fingerprint(x) == "7afa5e57437ee2c4",
                   "pinned_bf16": fingerprint(x.bfloat16()) == "0535c290658502cb"}
    flipped = parts[0].tensor.clone()
    flipped.view(torch.int32)[7, 7] ^= 1
    res["bits"]["flipped_bit_seen"] = bool((kernels.fingerprint_sums([Part(flipped)]).cpu().numpy().view(np.uint32)
                                            != want[:1]).any())
    print("bits:", res["bits"], flush=True)
    if dev.type != "cuda":
        a.gb = min(a.gb, 0.05)
    # bandwidth: ~a.gb GB of a model-state mix: 4 x (bf16 weights + fp32 grads and 2 moments) of one size
    # (90 %), stacked bf16 experts read as rows (10 %), 64 bf16 norms
    total = a.gb * 1e9
    k = int(0.9 * total / 56) // 2048 * 2048  # elements per matrix: 4 groups x (2 + 3 x 4) bytes
    gen = torch.Generator(device=dev).manual_seed(1)
    mats = []
    for _ in range(4):
        mats.append(("bf16", torch.randn(k // 2048, 2048, device=dev, generator=gen).bfloat16()))
        mats += [("fp32", torch.randn(k // 2048, 2048, device=dev, generator=gen)) for _ in range(3)]
    experts = torch.randn(64, max(1, int(0.1 * total / 2 / 64 / 2048)), 2048, device=dev, generator=gen).bfloat16()
    norms = [torch.randn(2048, device=dev, generator=gen).bfloat16() for _ in range(64)]
    parts = [Part(t) for _, t in mats] + [Part(experts, rows=True)] + [Part(t) for t in norms]
    nbytes = sum(p.tensor.numel() * p.tensor.element_size() for p in parts)
    res["bandwidth_setup"] = {"bytes": nbytes, "tensors": len(parts), "results": len(fpk.result_salts(parts)),
                              "mix": "16 matrices [*, 2048] (1/4 bf16, 3/4 fp32), 64 stacked bf16 experts as rows, "
                                     "64 bf16 norms [2048]"}

    def timed(fn, reps):
        ts = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    reps = 10 if dev.type == "cuda" else 2
    kernels.fingerprint_sums(parts)  # compile
    t = timed(lambda: kernels.fingerprint_sums(parts), reps)
    res["fingerprint_call_s"] = t  # one call with a host sync around it: the host's work table included
    res["fingerprint_call_gbps"] = nbytes / t / 1e9
    t0 = time.perf_counter()
    main, odd, views, n_out = fpk.work_table(parts)
    res["work_table_ms"] = (time.perf_counter() - t0) * 1e3
    out = torch.zeros(n_out, 2, dtype=torch.int32, device=dev)
    tables = []
    for vec, tab in ((4, main), (1, odd)):
        if len(tab):
            tab = tab.copy()
            tab[:, 0] = (tab[:, 0] - out.data_ptr()) // 4
            tables.append((vec, torch.from_numpy(tab).to(dev)))

    def launches(block, warps):
        for vec, tab in tables:
            tfp.fingerprint_kernel[(len(tab),)](out, tab, out, K1=fpk.K1, K2=fpk.K2, STEP1=block * fpk.K1 % 2**32,
                                                 M1=fpk.M1, M2=fpk.M2, VEC=vec, BLOCK=block,
                                                 num_warps=warps if dev.type == "cuda" else 1)

    def kernel_s(block, warps, n):
        """Seconds per pass of the bare kernel launches (tables built once), n passes back to back."""
        launches(block, warps)  # compile
        if dev.type != "cuda":
            return timed(lambda: launches(block, warps), 1)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        torch.cuda.synchronize()
        ev[0].record()
        for _ in range(n):
            launches(block, warps)
        ev[1].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) / 1e3 / n

    tk = kernel_s(tfp.BLOCK, tfp.NUM_WARPS, reps)
    res["fingerprint_kernel_s"] = tk
    res["fingerprint_gbps"] = nbytes / tk / 1e9  # the kernel's read rate (CUDA events over back-to-back passes)
    if dev.type == "cuda":  # calls back to back (host work overlapping the device): the rate a trace step sees
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        torch.cuda.synchronize()
        ev[0].record()
        for _ in range(reps):
            kernels.fingerprint_sums(parts)
        ev[1].record()
        torch.cuda.synchronize()
        res["fingerprint_calls_back_to_back_gbps"] = nbytes / (ev[0].elapsed_time(ev[1]) / 1e3 / reps) / 1e9
    ref = mats[1][1]  # one fp32 matrix: torch.sum's read rate, a reference on this device
    res["torch_sum_fp32_gbps"] = ref.numel() * 4 / timed(lambda: ref.sum(), reps) / 1e9
    peak = next((v for k, v in HBM_PEAK_GBPS.items() if k in res["device"]), None)
    if peak:
        res["hbm_peak_gbps"] = peak
        res["fingerprint_frac_of_peak"] = res["fingerprint_gbps"] / peak
    # the pinned config beside others (the value does not depend on them: checked per config)
    sweep = {}
    for block, warps in ((4096, 8), (2048, 4), (2048, 8), (8192, 8), (4096, 4), (8192, 16), (1024, 4)):
        if (dev.type != "cuda" and block > 1024) or not a.sweep:
            continue
        sweep[f"BLOCK={block} num_warps={warps}"] = {"gbps": nbytes / kernel_s(block, warps, max(2, reps // 2)) / 1e9}
    out.zero_()
    launches(tfp.BLOCK, tfp.NUM_WARPS)
    ref_ab = out.clone()
    for key in sweep:
        block, warps = (int(x.split("=")[1]) for x in key.split())
        out.zero_()
        launches(block, warps)
        sweep[key]["same_sums_as_pinned_config"] = bool(torch.equal(out, ref_ab))
    res["config_sweep"] = sweep
    print(f"fingerprint kernel: {nbytes / 1e9:.2f} GB in {tk * 1e3:.2f} ms = {res['fingerprint_gbps']:.0f} GB/s; one "
          f"call {res['fingerprint_call_gbps']:.0f} GB/s (work table {res['work_table_ms']:.1f} ms); calls back to "
          f"back {res.get('fingerprint_calls_back_to_back_gbps', 0):.0f} GB/s; torch.sum fp32 "
          f"{res['torch_sum_fp32_gbps']:.0f} GB/s; sweep "
          + ", ".join(f"{k}: {v['gbps']:.0f}" for k, v in sweep.items()),
          flush=True)
    _part(Path(a.out), "kernel", res)


# --- RL steps ------------------------------------------------------------------------------------------
def _base(model: str, tiny: bool) -> list[str]:
    if tiny:  # the same path on the CPU in seconds
        return [f"model={model}", "device=cpu", "run.steps=3", "task.num_prompts=2", "task.samples_per_prompt=2",
                "task.max_new_tokens=8", "trainer.ep_size=1", "generator.ep_size=1", "checkpoint.enabled=false",
                "monitor.on_mismatch=warn", "logger.console=false"]
    return [f"model={model}", "device=cuda", "kernels.backend=triton", "trainer.ep_size=1", "generator.ep_size=1",
            "placement.colocate=true", "task.num_prompts=16", "task.samples_per_prompt=8", "task.max_new_tokens=256",
            "checkpoint.async_save=false", "checkpoint.enabled=false", "monitor.on_mismatch=warn",
            "logger.console=false"]



def _summarise(rows: list[dict]) -> dict:
    steady = rows[1:] or rows
    med = {k: statistics.median(r.get(f"time/{k}", 0.0) for r in steady) for k in TIMES}
    return {"steps": len(rows), "median_after_first": med,
            "per_step": [{k: r.get(f"time/{k}") for k in TIMES} for r in rows],
            "mismatched_tokens": sum(r["consistency/mismatched_tokens"] for r in rows),
            "tokens": sum(r["consistency/tokens"] for r in rows),
            "peak_gib": {k: max(r.get(f"memory/{k}_peak_gib", 0.0) for r in rows) for k in ("trainer", "generator")}}


def _pooled(reps: list[dict]) -> dict:
    """One run setting over its repetitions: medians over every repetition's steps after its first."""
    steady = [st for rep in reps for st in (rep["per_step"][1:] or rep["per_step"])]
    return {"repetitions": len(reps), "steps_pooled": len(steady),
            "median_after_first": {k: statistics.median(st.get(k) or 0.0 for st in steady) for k in TIMES},
            "mismatched_tokens": sum(rep["mismatched_tokens"] for rep in reps),
            "tokens": sum(rep["tokens"] for rep in reps), "command": reps[0]["command"]}


def rl(a) -> None:
    from rlalign import cluster
    from rlalign.config import load_config
    from rlalign.rl import train

    out = Path(a.out)
    name = f"rl_{a.model}"
    base = _base(a.model, a.tiny) if a.tiny else [*_base(a.model, a.tiny), f"run.steps={a.steps}"]
    res = {"model": a.model, "base_overrides": base, "runs": {}}
    if (out / f"part_{name}.json").exists():  # an earlier call's runs of this model: add to them
        res["runs"] = json.loads((out / f"part_{name}.json").read_text())["runs"]
    cluster.connect()
    try:
        for k, run in enumerate(["det:off"] * bool(a.warmup_steps) + a.runs):
            warmup = bool(a.warmup_steps) and k == 0  # the process's first run: compiles, starts Ray's workers
            mode, level = run.split(":")
            base = [o for o in res["base_overrides"] if not (warmup and o.startswith("run.steps="))]
            over = [*base, *([f"run.steps={a.warmup_steps}"] if warmup else []),
                    f"kernels.mode={'deterministic' if mode == 'det' else mode}", f"monitor.fingerprints={level}"]
            with tempfile.TemporaryDirectory(dir=a.run_root) as d:
                if not a.tiny:
                    record.wait_gpu_free()
                t0 = time.perf_counter()
                train(load_config([*over, f"run.dir={d}"]))
                rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines() if x.strip()]
                traces = sorted(p.name for p in (Path(d) / "traces").glob("*.jsonl")) if level != "off" else []
                records = sum(len(open(Path(d) / "traces" / t).readlines()) - 1 for t in traces)
            rep = {**_summarise(rows), "wall_s": time.perf_counter() - t0, "trace_records": records,
                   "command": "rlalign train " + " ".join(over)}
            if warmup:
                res["warmup"] = rep
                print(f"{a.model} warm-up {run} ({a.warmup_steps} steps, not counted): wall {rep['wall_s']:.0f}s",
                      flush=True)
                continue
            entry = res["runs"].setdefault(run, {"reps": []})
            entry["reps"].append(rep)
            entry.update(_pooled(entry["reps"]))
            m = rep["median_after_first"]
            print(f"{a.model} {run:12} rep {len(entry['reps'])} step {m['step_s']:.3f}s (generate "
                  f"{m['generate_s']:.3f} [engine {m['generate_engine_s'] or 0:.3f} monitor "
                  f"{(m['generate_monitor_s'] or 0) * 1e3:.1f} ms] train {m['train_s']:.3f} [trainer "
                  f"{m['train_trainer_s'] or 0:.3f} monitor {(m['train_monitor_s'] or 0) * 1e3:.1f} ms] "
                  f"sync {m['sync_s'] * 1e3:.2f} ms) mismatched "
                  f"{rep['mismatched_tokens']} of {rep['tokens']}, {records} trace records, wall {rep['wall_s']:.0f}s",
                  flush=True)
            _part(out, name, res)  # after every run: a timeout keeps what finished
    finally:
        cluster.disconnect(True)


# --- the CPU demo --------------------------------------------------------------------------------------
def demo(a) -> None:
    from rlalign import cluster
    from rlalign.config import load_config
    from rlalign.rl import train

    levels = ("off", "default")
    times: dict[str, list[float]] = {lv: [] for lv in levels}
    per_run = []
    cluster.connect()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(a.reps):
                for lv in (levels if rep % 2 == 0 else levels[::-1]):  # off, default, default, off, ...
                    d = Path(tmp) / f"{lv}-{rep}"
                    train(load_config([f"run.steps={a.steps}", f"run.dir={d}", f"monitor.fingerprints={lv}",
                                       "logger.console=false", *a.overrides]))
                    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
                    steps = [r["time/step_s"] for r in rows[1:-1]]  # not the first, not the final checkpoint's
                    times[lv] += steps
                    per_run.append({"level": lv, "rep": rep, "median_step_s": statistics.median(steps)})
                    print(f"rep {rep} {lv:8}: median step {statistics.median(steps):.3f}s", flush=True)
    finally:
        cluster.disconnect(True)
    med = {lv: statistics.median(v) for lv, v in times.items()}
    pairs = [[r["median_step_s"] for r in per_run if r["rep"] == k] for k in range(a.reps)]
    res = {"setup": {"steps_per_run": a.steps, "reps": a.reps, "order": "off, default; then default, off; ...",
                     "overrides": a.overrides, "steps_used": "each run's steps after the first, before the last "
                     "(the last writes the final checkpoint)",
                     "config": "`rlalign train` defaults (tiny MoE, repeat task, trainer EP 2, generator EP 1, CPU)"},
           "median_step_s": med, "default_over_off": med["default"] / med["off"], "runs": per_run,
           "rep_ratios_default_over_off": [p[1] / p[0] if per_run[2 * k]["level"] == "off" else p[0] / p[1]
                                           for k, p in enumerate(pairs)]}
    print(f"median step: off {med['off']:.3f}s, default {med['default']:.3f}s, default/off "
          f"{res['default_over_off']:.3f}", flush=True)
    shows = (f"`rlalign train` defaults on a 2-core CPU, monitor off / default interleaved ({a.reps} reps x "
             f"{a.steps} steps): median step {med['off']:.3f} s off, {med['default']:.3f} s with the default "
             f"fingerprints (weights, grads, AdamW moments per step on every trainer rank, the synced weights on the "
             f"generator): default/off {res['default_over_off']:.3f}.")
    print("wrote", record.write(a.name or "monitor_overhead_cpu", {**res, "what_it_shows": shows}, a.results))


# --- the trace's host work per trainer step --------------------------------------------------------------
def _state_records(model: str, moments: bool):
    """(name, shape, dtype, rows) of the state records a topology-invariant trainer at EP 1 writes per
    step for `model` (rlalign.training.trainer.topology_record_groups), in its order."""
    import torch

    from rlalign.config import load_config, model_args
    from rlalign.model.model import build_model
    from rlalign.parallel.ep import is_expert_param

    m = build_model(model_args(load_config([f"model={model}"])), seed=None, device="meta")
    kinds = [("grad", torch.float32)] + ([("optim/exp_avg", torch.float32), ("optim/exp_avg_sq", torch.float32)]
                                         if moments else []) + [("weights", torch.bfloat16)]
    out = []
    for n, p in sorted(m.named_parameters()):
        for prefix, dt in kinds:
            out.append((f"state/{prefix}/{n}", tuple(p.shape), dt, is_expert_param(n)))
    return out


def host(a) -> None:
    """What the trace costs the host per trainer step at a model's record count, on the CPU: (1) the
    records through Trace.record_many + flush over tiny stand-ins of the same names, kinds and rows
    (record dicts, salts, hex, JSON lines), the kernel replaced by a GPU rank's host work for the
    launch (segments, the work table of the stand-ins, the result buffer; the CPU hash of the tiny
    bytes is measured apart, a GPU rank does not run it), (2) the work table over the real sizes
    (chunk count), built from the per-part cache as a GPU rank does each step and, for reference,
    built directly (the cost of a cold cache)."""
    import numpy as np
    import torch

    from rlalign import kernels
    from rlalign.kernels import fingerprint as fpk
    from rlalign.monitor.trace import RowNames, Trace

    def launch_host_work(parts):
        segs, _, n = fpk.segments(parts)
        fpk.segment_tables(segs)
        return torch.zeros(n, 2, dtype=torch.int32)

    def per_step(fn, n):
        ts = []
        for s in range(n):
            t0 = time.perf_counter()
            fn(s)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[2:] or ts)

    res = {"model": a.model, "steps": a.steps}
    for label, moments in (("every_step_with_moments", True), ("without_moments", False)):
        recs = _state_records(a.model, moments)
        items = [(RowNames(n + "/expert", 0) if rows else n, torch.zeros((shape[0], 2) if rows else (2,), dtype=dt))
                 for n, shape, dt, rows in recs]
        segs, addr, dst = [], 1 << 40, 0
        for _, shape, dt, rows in recs:
            nb, r = int(np.prod(shape)) * dt.itemsize, shape[0] if rows else 1
            segs.append((addr, r, nb // r, 0, dst))
            addr, dst = addr + nb + 512, dst + r
        with tempfile.TemporaryDirectory() as d:
            tr = Trace(Path(d) / "t.jsonl", "trainer", 0, {})

            def step(s, tr=tr, items=items):
                tr.step = s
                tr.fence()
                tr.record_many(items)
                tr.flush()

            cpu_hash = kernels.fingerprint_sums
            kernels.fingerprint_sums = launch_host_work
            try:
                trace_s = per_step(step, a.steps)
            finally:
                kernels.fingerprint_sums = cpu_hash
            tr.close()
        hash_s = per_step(lambda s, items=items: kernels.fingerprint_sums([fpk.Part(t, rows=isinstance(n, RowNames))
                                                                            for n, t in items]), max(3, a.steps // 3))
        table_s = per_step(lambda s, segs=segs: fpk.segment_tables(segs), a.steps)
        direct_s = per_step(lambda s, segs=segs: fpk.chunk_tables(segs, fpk.CHUNK), max(3, a.steps // 3))
        rows = sum(len(t) for t in fpk.segment_tables(segs))
        res[label] = {"records": len(recs), "results": dst, "bytes": addr - (1 << 40) - 512 * len(recs),
                      "work_table_chunks": rows, "trace_record_flush_ms": trace_s * 1e3,
                      "cpu_hash_of_the_stand_ins_ms (not on a GPU rank)": hash_s * 1e3,
                      "work_table_cached_ms": table_s * 1e3, "work_table_direct_ms": direct_s * 1e3}
        print(f"{a.model} {label}: {len(recs)} records ({dst} results, {res[label]['bytes'] / 1e9:.1f} GB, {rows} "
              f"chunks): record_many + flush {trace_s * 1e3:.1f} ms, work table {table_s * 1e3:.1f} ms cached / "
              f"{direct_s * 1e3:.1f} ms direct", flush=True)
    w, o = res["every_step_with_moments"], res["without_moments"]
    shows = (f"The trace's host work per trainer step at {a.model}'s record count on this CPU: "
             f"{w['records']} records (weights, gradients, AdamW moments) {w['trace_record_flush_ms']:.1f} ms "
             f"record_many + flush + {w['work_table_cached_ms']:.1f} ms work table ({w['work_table_direct_ms']:.1f} "
             f"ms built directly); without the moments (monitor.optim_every's other steps) {o['records']} records "
             f"{o['trace_record_flush_ms']:.1f} + {o['work_table_cached_ms']:.1f} ms, {o['bytes'] / 1e9:.1f} of "
             f"{w['bytes'] / 1e9:.1f} GB read on the device.")
    print("wrote", record.write(a.name or "monitor_host_cpu", {**res, "what_it_shows": shows}, a.results))


# --- summary -------------------------------------------------------------------------------------------
def summary(a) -> None:
    out = Path(a.out)
    parts = {p.stem.removeprefix("part_"): json.loads(p.read_text()) for p in sorted(out.glob("part_*.json"))}
    k = parts.get("kernel", {})
    models = {}
    for name, p in parts.items():
        if not name.startswith("rl_"):
            continue
        runs = {r: v["median_after_first"] for r, v in p["runs"].items()}
        m = {"runs": runs}
        if "det:default" in runs and "det:off" in runs:
            m["monitor_on_over_off_step"] = runs["det:default"]["step_s"] / runs["det:off"]["step_s"]
            m["monitor_on_over_off_sync"] = runs["det:default"]["sync_s"] / runs["det:off"]["sync_s"]
            m["monitor_on_over_off_train"] = runs["det:default"]["train_s"] / runs["det:off"]["train_s"]
        if "default:off" in runs and "det:default" in runs:
            m["deterministic_with_monitor_over_default_kernels_step"] = (runs["det:default"]["step_s"]
                                                                         / runs["default:off"]["step_s"])
        models[p["model"]] = m
    ratios = [m["monitor_on_over_off_step"] for m in models.values() if "monitor_on_over_off_step" in m]
    summ = {"gpu": k.get("device"), "monitor_on_over_off_step": max(ratios) if ratios else None,
            "fingerprint_gbps": k.get("fingerprint_gbps"),
            "fingerprint_call_gbps": k.get("fingerprint_call_gbps"),
            "fingerprint_frac_of_hbm_peak": k.get("fingerprint_frac_of_peak"),
            "sync_on_over_off": {mm: m.get("monitor_on_over_off_sync") for mm, m in models.items()},
            "monitor_on_over_off_sync": max((m["monitor_on_over_off_sync"] for m in models.values()
                                             if "monitor_on_over_off_sync" in m), default=None),
            "step_on_over_off": {mm: m.get("monitor_on_over_off_step") for mm, m in models.items()},
            **{f"train_s_off_{mm.replace('-', '_')}": m["runs"]["det:off"]["train_s"] for mm, m in models.items()
               if "det:off" in m["runs"]},
            **{f"sync_s_{r.split(':')[1]}_{mm.replace('-', '_')}": v["sync_s"] for mm, m in models.items()
               for r, v in m["runs"].items() if r.startswith("det:")},
            "bits_device_equals_cpu": (k.get("bits") or {}).get("device_equals_numpy")}
    res = {"summary": summ, "models": models, "kernel": k,
           "rl": {n: p for n, p in parts.items() if n.startswith("rl_")}}
    lines = ["| model | run | step_s | generate_s | train_s | sync_s | generator call | copy+hash | resume |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mm, m in models.items():
        for r, v in m["runs"].items():
            lines.append(f"| {mm} | {r} | {v['step_s']:.3f} | {v['generate_s']:.3f} | {v['train_s']:.3f} | "
                         f"{v['sync_s'] * 1e3:.2f} ms | {v.get('sync_generator_call_s', 0.0) * 1e3:.2f} ms | "
                         f"{v['sync_generator_s'] * 1e3:.2f} ms | {v.get('sync_resume_s', 0.0) * 1e3:.2f} ms |")
    print("\n".join(lines))
    print(json.dumps(summ))
    def fmt(v, f):
        return format(v, f) if isinstance(v, (int, float)) else "n/a"

    gb = (k.get("bandwidth_setup") or {}).get("bytes", 0) / 1e9
    frac = 100 * (k.get("fingerprint_frac_of_peak") or 0)
    shows = (f"One call: the fingerprint kernel reads {gb:.1f} GB of mixed bf16/fp32 tensors at "
             f"{fmt(k.get('fingerprint_gbps'), '.0f')} GB/s ({frac:.0f} % of the HBM peak), its bits equal numpy's; "
             f"RL step with monitor.fingerprints=default over off: "
             + ", ".join(f"{mm} {fmt(m.get('monitor_on_over_off_step'), '.3f')} (sync "
                         f"{fmt(m.get('monitor_on_over_off_sync'), '.2f')}x)" for mm, m in models.items()) + ".")
    path = record.write(a.name, {**res, "what_it_shows": shows}, a.results, command=a.command)
    print("wrote", path)
    if a.kernel_name and k:
        sw, nt = k.get("config_sweep") or {}, (k.get("bandwidth_setup") or {}).get("tensors")
        kshows = (f"kernels.fingerprint_sums' kernel over {gb:.1f} GB of mixed bf16/fp32 tensors "
                  f"({nt} tensors): {fmt(k.get('fingerprint_gbps'), '.0f')} "
                  f"GB/s = {frac:.0f} % of the HBM peak (CUDA events over back-to-back launches, tables built once); "
                  f"one call with its host work table and a sync around it "
                  f"{fmt(k.get('fingerprint_call_gbps'), '.0f')} GB/s; torch.sum fp32 "
                  f"{fmt(k.get('torch_sum_fp32_gbps'), '.0f')} GB/s on the same GPU; configs: "
                  + ", ".join(f"{c} {fmt(v.get('gbps'), '.0f')}" for c, v in sw.items())
                  + f". Bits equal numpy's on every case: {(k.get('bits') or {}).get('device_equals_numpy')}.")
        print("wrote", record.write(a.kernel_name, {**k, "what_it_shows": kshows}, a.results, command=a.command))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("demo", "kernel", "rl", "host", "summary"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_monitor"), help="part JSONs")
    ap.add_argument("--results", default=None, help="where the result JSON goes (default experiments/results)")
    ap.add_argument("--name", default=None, help="result name (summary; demo: monitor_overhead_cpu; "
                    "host: monitor_host_cpu)")
    ap.add_argument("--kernel-name", default=None, help="summary: also write the kernel phase as this result")
    ap.add_argument("--command", default=None, help="the whole call's command line, recorded by summary")
    ap.add_argument("--gb", type=float, default=10.0)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="kernel: the pinned config only")
    ap.add_argument("--model", default="qwen3-30b-a3b-rehearsal")
    ap.add_argument("--runs", nargs="*", default=["det:default", "det:off"])
    ap.add_argument("--warmup-steps", type=int, default=0, help="rl: first a monitor-off run of this many steps "
                    "that is not counted (compilation and Ray's start fall on it)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="rl: CPU-sized settings (tests the path)")
    ap.add_argument("--run-root", default=None, help="rl: where the run dirs go (default: the temp dir)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[])
    a = ap.parse_args()
    {"demo": demo, "kernel": kernel, "rl": rl, "host": host, "summary": summary}[a.phase](a)


if __name__ == "__main__":
    main()
