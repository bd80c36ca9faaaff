"""The price of determinism on one GPU: deterministic ÷ default time, both from this one call, for the
rollouts, the trainer step and the colocated RL step, beside the kernels that can be compared one by one
with the vendor's. kernels.mode=default is the fast vendor path (kernels/torch_default.py): cuBLAS,
torch._grouped_mm, SDPA / varlen flash, a split-KV paged decode, torch sampling, fused AdamW, CUDA graphs.

    python3 experiments/bench_determinism_tax.py [--quick] [--sections probe,vendor,trainer,rollout,rl]
        [--budget-s 560] [--out DIR] [--name determinism_tax_<card>] [--rollout-models M,...]

Each section runs in a subprocess of its own (GPU memory back between them; a crash is recorded, the
others still run) and leaves a part JSON in a scratch folder; the result merges them. Sections:
  probe    the default ops on this GPU against references (grouped_mm, varlen, split-KV decode; rel. error)
  vendor   prefill attention fwd and fwd+bwd (GQA 32/8, D 128; B x T = 8x1024, 2x4096, 16x512): the Triton
           kernel vs every SDPA backend torch offers here (the fastest is the bar); the MoE-shape GEMMs vs
           cuBLAS (CUDA-graph replays over rotated weights)
  trainer  Trainer.train_step at bench-moe-large on profile_train's RL-shaped batch (128 samples, prompts
           64+-12, responses 240-256, micro-batch 32), deterministic (Triton) then default, same trainer
  rollout  the native engine (config defaults) on bench_rollout_scale's prompts: bench-moe-large 256x256 and
           2048x256 plain, qwen3-30b-a3b-rehearsal (vocab 151,936) 1024x256 plain and top-p (T 0.8, p 0.95);
           each mode makes 2 generate() calls, the second timed and rescored by the trainer (its mismatches)
  rl       bench_rl_step.py rl: `rlalign train` colocated on one GPU at 2 B (qwen3-30b-a3b-rehearsal) and
           5 B (bench-moe-large), monitor at its default, per mode; the median step after the first
Tax = deterministic time / default time (rollouts: per token, default tok/s / deterministic tok/s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), *(str(HERE / d) for d in ("kernels", "train", "rollout"))]  # the scripts it times
import record  # noqa: E402

SECTIONS = ("vendor", "trainer", "rollout", "rl", "probe")
ATTN_SHAPES = ((8, 1024), (2, 4096), (16, 512))  # (B, T); 32 / 8 heads, D 128
MOE_GEMMS = ((4096, 768, 2048), (4096, 2048, 768))  # (M, N, K)
GOALS = {"tax": 1.10, "attn_fwd_over_best_sdpa_min": 0.85, "attn_fwdbwd_over_best_sdpa_min": 0.85,
         "gemm_over_cublas_min": 0.9, "realvocab_topp_over_plain_1024": 0.9, "realvocab_roofline_frac_1024": 0.4}


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --- probe ---------------------------------------------------------------------------------------------
def probe(a) -> dict:
    import torch

    from rlalign.kernels import torch_default as dflt
    from rlalign.kernels import torch_deterministic as det
    from rlalign.kernels.triton import splitkv

    g = torch.Generator(device="cuda").manual_seed(0)
    out = {"torch_has_grouped_mm": hasattr(torch, "_grouped_mm")}
    E, K, N = 8, 256, 384
    counts = torch.tensor([0, 37, 1, 200, 64, 0, 3, 95], device="cuda")
    R = int(counts.sum())
    x = torch.randn(R, K, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, N, K, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    go = torch.randn(R, N, device="cuda", generator=g).bfloat16()
    y = dflt.grouped_linear(x, w, counts)
    gx, gw = torch.autograd.grad(y, (x, w), go)
    y2 = dflt.grouped_linear_loop(x, w, counts)
    gx2, gw2 = torch.autograd.grad(y2, (x, w), go)
    out["grouped_mm_rel_err"] = {"y": rel_err(y, y2), "dx": rel_err(gx, gx2), "dw": rel_err(gw, gw2)}
    H, Hk, D = 32, 8, 128
    lens = [300, 257, 1024, 77, 512]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(cu[-1], h, D, device="cuda", generator=g).bfloat16().requires_grad_() for h in (H, Hk, Hk))
    o = dflt.attention_prefill(q, k, v, cu, D ** -0.5)
    ref = det.attention_prefill(q.float(), k.float(), v.float(), cu, D ** -0.5)
    gq = torch.autograd.grad(o, q, o.detach())[0]
    gq_ref = torch.autograd.grad(ref, q, ref.detach())[0]
    out["prefill_ragged_rel_err"] = {"fwd": rel_err(o, ref), "dq": rel_err(gq, gq_ref),
                                     "varlen_broken": dflt.BROKEN_PATHS.get("varlen")}
    page = 16
    for rows, ctx in ((1, 4000), (8, 1500), (256, 300)):
        P = rows * (-(-ctx // page) + 2)
        table = torch.randperm(P, device="cuda", generator=g).view(rows, -1).int()
        kp, vp = (torch.randn(P, page, Hk, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        pos = torch.randint(ctx // 2, ctx, (rows,), device="cuda", generator=g)
        seq = torch.arange(rows, device="cuda")
        qd = torch.randn(rows, H, D, device="cuda", generator=g).bfloat16()
        od = splitkv.paged_decode(qd, kp, vp, table, seq, pos, D ** -0.5)
        refd = det.attention_paged(qd.float(), kp.float(), vp.float(), table, seq, pos, D ** -0.5)
        keys = table.shape[1] * page
        out[f"splitkv_rows{rows}"] = {"rel_err": rel_err(od, refd), "splits": splitkv.num_splits(rows, Hk, keys,
                                                                                                 qd.device)}
    out["fallbacks_logged"] = sorted(map(list, dflt.LOGGED_FALLBACKS))
    print(json.dumps(out, indent=1), flush=True)
    return out


# --- vendor --------------------------------------------------------------------------------------------
def sdpa_variants(q, k, v, B, T, backward: bool, go):
    """name -> fn for every SDPA backend that runs this GQA shape ([B, H, T, D] views; cuDNN and the
    efficient kernel also with k, v repeated to H heads, made outside the timing)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, Hk, D = q.shape[1], k.shape[1], q.shape[2]
    sq, sk, sv = (t.view(B, T, t.shape[1], D).transpose(1, 2) for t in (q, k, v))
    kr, vr = (t.repeat_interleave(H // Hk, 1) for t in (sk, sv))
    if backward:
        sq, sk, sv, kr, vr = (t.detach().requires_grad_() for t in (sq, sk, sv, kr, vr))
        sgo = go.view(B, T, H, D).transpose(1, 2)
    fns = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for how, kk, vv, gqa in (("gqa", sk, sv, True), ("repeated", kr, vr, False)):
            def fn(be=be, kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(sq, kk, vv, is_causal=True, enable_gqa=gqa)
                    if backward:
                        o.backward(sgo)
                    return o
            try:
                fn()
                torch.cuda.synchronize()
                fns[f"{name}_{how}"] = fn
            except RuntimeError:
                pass
    return fns


def attend(fn, qkv, cu, go):
    o = fn(*qkv, cu, qkv[0].shape[-1] ** -0.5)
    if go is not None:
        o.backward(go)
    return o


def operand_traffic(M: int, N: int, K: int, bm: int, bn: int, el: int = 2) -> float:
    """Bytes a GEMM of bm x bn tiles reads into shared memory: each tile reads its A rows and B columns over K."""
    return M * N * K * el * (1 / bn + 1 / bm)


def kernel_names(fn) -> list:
    """The CUDA kernels one call of fn launches, full names (cuBLAS's name its tile, cluster and schedule)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    except Exception as e:  # noqa: BLE001 - a name is a detail: the timings stand without it
        return [f"error: {type(e).__name__}: {e}"[:200]]


def vendor(a) -> dict:
    import torch
    import triton
    from bench_vs_vendor import eager_ms, graph_ms

    from rlalign.kernels import torch_default as dflt
    from rlalign.kernels import triton as tb
    from rlalign.kernels.triton.gemm import small_m_config

    g = torch.Generator(device="cuda").manual_seed(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    H, Hk, D = 32, 8, 128
    attn = []
    for B, T in ATTN_SHAPES:
        q = torch.randn(B * T, H, D, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(B * T, Hk, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        go = torch.randn(B * T, H, D, device="cuda", generator=g).bfloat16()
        cu = [i * T for i in range(B + 1)]
        row = {"B": B, "T": T, "H": H, "Hk": Hk, "D": D}
        for bwd in (False, True):
            key = "fwdbwd" if bwd else "fwd"
            sd = {n: eager_ms(f) for n, f in sdpa_variants(q, k, v, B, T, bwd, go).items()}
            qkv = [t.clone().requires_grad_(bwd) for t in (q, k, v)]
            ours = eager_ms(partial(attend, tb.attention_prefill, qkv, cu, go if bwd else None))
            dfl = eager_ms(partial(attend, dflt.attention_prefill, qkv, cu, go if bwd else None))
            best = min(sd, key=sd.get)
            row[key] = {"sdpa_ms": sd, "best_sdpa": best, "triton_det_ms": ours, "default_mode_ms": dfl,
                        "det_over_best_sdpa": sd[best] / ours}
            every = json.dumps({n: round(t, 3) for n, t in sd.items()})
            print(f"attention {B}x{T} {key}: det {ours:.3f} ms, default mode {dfl:.3f} ms, best SDPA {best} "
                  f"{sd[best]:.3f} ms -> {sd[best] / ours:.2f}x; all {every}", flush=True)
        attn.append(row)
    gemms = []
    with torch.no_grad():
        for M, N, K in MOE_GEMMS:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            ws = [torch.randn(N, K, device="cuda", generator=g).bfloat16() for _ in range(8)]
            t_cub = graph_ms([partial(torch.matmul, x, w.t()) for w in ws])
            t_ours = graph_ms([partial(tb.linear, x, w) for w in ws])
            cfg = small_m_config(x.dtype, M, [N], sms)
            tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
            fill = tiles / (triton.cdiv(tiles, sms) * sms)  # the busy share of the SM-waves the tiles take
            gemms.append({"M": M, "N": N, "K": K, "cublas_us": 1e3 * t_cub, "triton_det_us": 1e3 * t_ours,
                          "det_over_cublas": t_cub / t_ours, "tflops_det": 2 * M * N * K / t_ours / 1e9,
                          "tile": [cfg["BLOCK_M"], cfg["BLOCK_N"]], "tiles": tiles, "sms": sms, "wave_fill": fill,
                          "det_over_cublas_per_busy_sm": t_cub / t_ours / fill,
                          "l2_to_sm_mb_det": operand_traffic(M, N, K, cfg["BLOCK_M"], cfg["BLOCK_N"]) / 1e6,
                          "cublas_kernels": kernel_names(partial(torch.matmul, x, ws[0].t()))})
            print(f"gemm {M}x{N}x{K}: cuBLAS {1e3 * t_cub:.1f} us, det {1e3 * t_ours:.1f} us -> {t_cub / t_ours:.2f}x",
                  flush=True)
        # the experts: bench-moe-large's 4,096 tokens x top-8 over 64 experts, router-like counts
        T, E, topk, d, inter = 4096, 64, 8, 2048, 768
        counts = torch.bincount(torch.randint(0, E, (T * topk,), device="cuda", generator=g), minlength=E)
        for name, (N, K) in {"gate_up": (2 * inter, d), "down": (d, inter)}.items():
            x = torch.randn(T * topk, K, device="cuda", generator=g).bfloat16()
            w = (torch.randn(E, N, K, device="cuda", generator=g) / 32).bfloat16()
            offs = counts.cumsum(0, dtype=torch.int32)
            t_v = graph_ms([partial(torch._grouped_mm, x, w.transpose(-2, -1), offs=offs)])
            t_o = graph_ms([partial(tb.grouped_linear, x, w, counts)])
            gemms.append({"grouped": name, "rows": T * topk, "E": E, "N": N, "K": K, "grouped_mm_us": 1e3 * t_v,
                          "triton_det_us": 1e3 * t_o, "det_over_cublas": t_v / t_o})
            print(f"grouped {name} {T * topk}x{N}x{K}/{E}: torch._grouped_mm {1e3 * t_v:.1f} us, "
                  f"det {1e3 * t_o:.1f} us -> {t_v / t_o:.2f}x", flush=True)
    return {"attention": attn, "gemm": gemms,
            "attn_fwd_over_best_sdpa_min": min(r["fwd"]["det_over_best_sdpa"] for r in attn),
            "attn_fwdbwd_over_best_sdpa_min": min(r["fwdbwd"]["det_over_best_sdpa"] for r in attn),
            "gemm_over_cublas_min": min(r["det_over_cublas"] for r in gemms if "grouped" not in r),
            "grouped_over_grouped_mm_min": min(r["det_over_cublas"] for r in gemms if "grouped" in r)}


# --- trainer -------------------------------------------------------------------------------------------
def trainer(a) -> dict:
    import torch
    from profile_train import VARIANTS, make_samples, model_flops

    from rlalign import kernels
    from rlalign.config import load_config
    from rlalign.sampling_params import SamplingParams
    from rlalign.training.trainer import Trainer

    seqs = 16 if a.quick else 128
    cfg = load_config(["model=bench-moe-large", "device=cuda", "kernels.backend=triton", "trainer.ep_size=1",
                       "trainer.micro_batch_size=32"])
    kernels.set_mode("deterministic", "triton")
    tr = Trainer(cfg, None)
    params = SamplingParams.from_config(cfg)
    batches = [make_samples(s, seqs, 64, 256, cfg.model.vocab_size, params) for s in range(a.train_steps + 1)]
    res = {"seqs": seqs, "prompt": 64, "resp": 256, "micro_batch_size": 32, "variants": {}}
    for name in ("det_nofill", "default"):
        mode, det_alg, fill = VARIANTS[name]
        torch.use_deterministic_algorithms(det_alg, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        walls = []
        with kernels.use(mode=mode, backend="triton"):
            for s in range(a.train_steps + 1):  # step 0: warm-up (compiles)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tr.train_step(batches[s], cfg.algorithm)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
                print(f"trainer {name} step {s}: {walls[-1]:.3f} s", flush=True)
        timed = sorted(walls[1:])
        med = timed[len(timed) // 2] if len(timed) % 2 else sum(timed[len(timed) // 2 - 1: len(timed) // 2 + 1]) / 2
        fl = model_flops(cfg, batches[1])["flops"]
        res["variants"][name] = {"mode": mode, "steps_s": walls, "median_s": med, "mfu": fl / med / 989e12}
        res["variants"][name]["profile"] = _profile(lambda: tr.train_step(batches[1], cfg.algorithm), mode)
    torch.use_deterministic_algorithms(False)
    res["tax"] = res["variants"]["det_nofill"]["median_s"] / res["variants"]["default"]["median_s"]
    return res


def _profile(step, mode: str) -> dict:
    """One more step under torch.profiler: device busy time, launches, the top kernels and ops."""
    import torch
    from profile_train import kernel_table
    from torch.profiler import ProfilerActivity, profile

    from rlalign import kernels

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with kernels.use(mode=mode, backend="triton"), profile(activities=acts) as p:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy, launches, rows, _, ops = kernel_table(p, 15)
    print(f"  {mode}: busy {busy:.1f} ms of {1e3 * wall:.1f} ms under the profiler, {launches} launches; top: "
          + "; ".join(f"{r['name'][:50]} {r['device_ms']:.1f}" for r in rows[:8]), flush=True)
    return {"wall_s_under_profiler": wall, "device_busy_ms": busy, "launches": launches, "top_kernels": rows,
            "top_ops": ops}


# --- rollouts ------------------------------------------------------------------------------------------
# kernel kinds by name: the top-p cut's launches are topp.py's _first_kernel (pass A, the estimate, the exact
# pass) and _window_kernel (the key search over the window; the retries)
KERNEL_KINDS = (("gemm", ("_gemm",)), ("attention", ("_attn",)), ("draw", ("gumbel",)),
                ("top_p_cut", ("_first_kernel", "_window_kernel")))


def by_kind(top: list, step_ms: float) -> dict:
    """A kernel table's ms by kind (KERNEL_KINDS); "other": the rest of step_ms."""
    kinds = {k: 0.0 for k, _ in KERNEL_KINDS}
    for name, t, _ in top:
        kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), None)
        if kind:
            kinds[kind] += t
    return {**kinds, "other": step_ms - sum(kinds.values())}


@contextmanager
def full_steps():
    """Keep, per decode-graph bucket, the inputs (host rows) of the last replayed step whose rows were all
    valid: the split below replays a steady-state step, not the call's tail (whose bucket is up to half
    padding rows). A host copy of [5, n] longs a step; nothing on the device."""
    from rlalign.rollout.native.graphs import DecodeGraphs, bucket

    call, kept = DecodeGraphs.__call__, {}

    def recorded(self, meta, follow=None, size=None, recapture=False):
        out = call(self, meta, follow, size, recapture)
        if meta.shape[1] == (size or bucket(meta.shape[1])):
            kept[meta.shape[1]] = meta.clone()
        return out

    DecodeGraphs.__call__ = recorded
    try:
        yield kept
    finally:
        DecodeGraphs.__call__ = call


def decode_step_split(eng, rows: int, full: dict) -> dict:
    """Where a decode step's device time goes: the engine's decode graph for `rows` rows (the bucket that
    served the timed call's steps) replayed 3 times under the profiler, its kernels by kind (kernel name),
    ms a step. Its inputs: the last step of the timed call with every row valid (full_steps), else the
    call's last step (marked "tail")."""
    from probe_rollout_steps import kernel_table

    dg = eng.state.graphs
    graphs = dg.graphs
    size = min((s for s in graphs if s >= rows), default=max(graphs))
    graph, static, _ = graphs[size]
    steady = size in full
    if steady:
        static.copy_(dg.host_rows(full[size], size).to(static.device))
    ms, top = kernel_table(graph.replay, reps=3, top=200)
    return {"rows": rows, "bucket": size, "inputs": "last full step" if steady else "tail", "step_ms": ms,
            "ms_by_kind": by_kind(top, ms), "top": top[:40]}


def rollout(a) -> dict:
    import torch
    from bench_generate import HBM_PEAK, run
    from bench_rollout_scale import BF16_DENSE_PEAK, SAMPLING, roofline

    from rlalign.config import load_config, model_args
    from rlalign.model import build_model
    from rlalign.rollout.types import EngineConfig
    from rlalign.sampling_params import SamplingParams

    cases = [("bench-moe-large", 256, 256, "plain"), ("bench-moe-large", 2048, 256, "plain"),
             ("qwen3-30b-a3b-rehearsal", 1024, 256, "plain"), ("qwen3-30b-a3b-rehearsal", 1024, 256, "top_p")]
    if a.rollout_models:
        cases = [c for c in cases if c[0] in a.rollout_models.split(",")]
    if a.quick:
        cases = [(m, min(B, 64), 32, s) for m, B, _, s in cases]
    gpu = torch.cuda.get_device_name(0)
    hbm = next((v for key, v in HBM_PEAK.items() if key in gpu), 4.8e12)
    flops = next((v for key, v in BF16_DENSE_PEAK.items() if key in gpu), 989.4e12)
    res, model, built = {}, None, None
    for name, B, new, samp in cases:
        if built != name:
            model = None
            torch.cuda.empty_cache()
            args = model_args(load_config([f"model={name}"]))
            model, built = build_model(args, "bfloat16", seed=0, device="cuda"), name
        g = torch.Generator().manual_seed(B)
        prompts = [torch.randint(2, args.vocab_size, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 201, (B,), generator=g)]
        params = SamplingParams(max_new_tokens=new, seed=7, **SAMPLING[samp])
        case = {}
        for mode in ("deterministic", "default"):
            torch.cuda.empty_cache()
            try:
                with full_steps() if mode == "deterministic" else nullcontext({}) as full:
                    split = partial(decode_step_split, rows=B, full=full) if mode == "deterministic" else None
                    outs, r = run(model, prompts, params, mode, EngineConfig(), warm=False, calls=2,
                                  score_micro_batch=64 if args.vocab_size < 65536 else 16,  # logits < 2**31
                                  inspect=split)
            except Exception as e:  # noqa: BLE001 - recorded, the other runs still go
                traceback.print_exc()
                case[mode] = {"error": f"{type(e).__name__}: {e}"[:800]}
                continue
            if mode == "deterministic":
                roof = roofline(args, model, outs[-1], hbm, flops)
                r.update(roofline=roof, fraction_of_roofline=r["tokens_per_s"] / roof["roofline_tokens_per_s"])
            case[mode] = r
            print(f"rollout {name} {B}x{new} {samp} {mode}: {r['tokens_per_s']:.0f} tok/s "
                  f"({r['tokens']} tokens, {r['seconds']:.2f} s, captures {r['calls_graph_captures']}), "
                  f"mismatched {r['mismatched_tokens']}", flush=True)
        if all("tokens_per_s" in case.get(m, {}) for m in ("deterministic", "default")):
            case["tax"] = case["default"]["tokens_per_s"] / case["deterministic"]["tokens_per_s"]
        res[f"{name}_{B}x{new}_{samp}"] = case
    return res


# --- the RL step ---------------------------------------------------------------------------------------
def rl(a) -> dict:
    res = {}
    models = {"2b": "qwen3-30b-a3b-rehearsal", "5b": "bench-moe-large"}
    with tempfile.TemporaryDirectory() as parts:
        for size, model in models.items():
            for mode in ("deterministic", "default"):
                label = f"{size}_{mode}"
                cmd = [sys.executable, str(HERE / "rl" / "bench_rl_step.py"), "rl", "--label", label, "--model", model,
                       "--steps", str(a.rl_steps), "--out", parts, f"kernels.mode={mode}",
                       "monitor.fingerprints=default"]
                if a.quick:
                    cmd += ["task.num_prompts=4", "task.max_new_tokens=32"]
                t0 = time.perf_counter()
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, a.deadline - time.time()))
                print(p.stdout[-3000:], p.stderr[-3000:] if p.returncode else "", flush=True)
                f = Path(parts) / f"part_rl_{label}.json"
                r = json.loads(f.read_text()) if f.exists() else {"error": f"rc {p.returncode}: {p.stderr[-1500:]}"}
                r["process_wall_s"] = time.perf_counter() - t0
                res[label] = r
            d, f = (res[f"{size}_{m}"].get("median_after_first", {}).get("step_s")
                    for m in ("deterministic", "default"))
            res[f"tax_{size}"] = d / f if d and f else None
    return res


# --- the one call --------------------------------------------------------------------------------------
def _section(a, name: str, parts: Path) -> dict:
    """Run one section in a subprocess of this script; its part JSON (or the error)."""
    path = parts / f"{name}.json"
    cmd = [sys.executable, __file__, "--section-only", name, "--parts", str(parts), "--deadline", str(a.deadline),
           "--train-steps", str(a.train_steps), "--rl-steps", str(a.rl_steps),
           "--rollout-models", a.rollout_models] + (["--quick"] if a.quick else [])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, timeout=max(10, a.deadline - time.time()))
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    out = json.loads(path.read_text()) if path.exists() else {"error": f"section {name}: rc {rc}, no result"}
    out["section_wall_s"] = time.perf_counter() - t0
    return out


def summarize(parts: dict) -> dict:
    ro, tr, rlr, ve = (parts.get(k, {}) for k in ("rollout", "trainer", "rl", "vendor"))

    def case(key):
        return next((v for k, v in ro.items() if k.endswith(key) and isinstance(v, dict)), {})

    def mism(mode):
        n = sum(v.get(mode, {}).get("mismatched_tokens", 0) for v in ro.values() if isinstance(v, dict))
        return n + sum(v.get("mismatched_tokens", 0) for k, v in rlr.items()
                       if isinstance(v, dict) and k.endswith(mode))

    plain, topp = case("1024x256_plain"), case("1024x256_top_p")
    tps = {m: (plain.get(m, {}).get("tokens_per_s"), topp.get(m, {}).get("tokens_per_s"))
           for m in ("deterministic", "default")}
    det_tp = tps["deterministic"]
    return {
        "gpu": record.environment().get("machine", {}).get("gpu"),
        "tax_rollout_256": case("256x256_plain").get("tax"),
        "tax_rollout_2048": case("2048x256_plain").get("tax"),
        "tax_rollout_realvocab_plain": plain.get("tax"),
        "tax_rollout_realvocab_topp": topp.get("tax"),
        "tax_trainer_step": tr.get("tax"),
        "tax_rl_step_2b": rlr.get("tax_2b"),
        "tax_rl_step_5b": rlr.get("tax_5b"),
        "attn_fwd_over_best_sdpa_min": ve.get("attn_fwd_over_best_sdpa_min"),
        "attn_fwdbwd_over_best_sdpa_min": ve.get("attn_fwdbwd_over_best_sdpa_min"),
        "gemm_over_cublas_min": ve.get("gemm_over_cublas_min"),
        "grouped_over_grouped_mm_min": ve.get("grouped_over_grouped_mm_min"),
        "realvocab_topp_over_plain_1024": det_tp[1] / det_tp[0] if all(det_tp) else None,
        "realvocab_roofline_frac_1024": plain.get("deterministic", {}).get("fraction_of_roofline"),
        "det_mismatched_tokens": mism("deterministic"),
        "default_mismatched_tokens": mism("default"),
        "goals": GOALS,
        "where_the_time_goes": where_the_time_goes(ve, plain, topp),
    }


def where_the_time_goes(ve: dict, plain: dict, topp: dict) -> dict:
    """The measured split behind the kernel goals: the real-vocabulary decode step's device time by kernel
    kind (plain and top-p, the bucket that served the timed call, replayed) beside the step the roofline
    allows, and each MoE-shape GEMM's ratio to cuBLAS over the share of SM-waves its tiles fill."""
    out = {}
    for name, case in (("realvocab_plain_1024", plain), ("realvocab_topp_1024", topp)):
        det = case.get("deterministic", {})
        split = det.get("inspect")
        if split:
            out[name] = {**{k: split[k] for k in ("rows", "bucket", "step_ms")}, "inputs": split.get("inputs", "tail"),
                         "ms_by_kind": by_kind(split["top"], split["step_ms"])}
    roof = plain.get("deterministic", {}).get("roofline", {}).get("roofline_tokens_per_s")
    if roof and "realvocab_plain_1024" in out:
        out["realvocab_plain_1024"]["roofline_step_ms"] = 1e3 * out["realvocab_plain_1024"]["rows"] / roof
    keys = ("M", "N", "K", "tile", "tiles", "sms", "wave_fill", "det_over_cublas", "det_over_cublas_per_busy_sm",
            "l2_to_sm_mb_det", "cublas_kernels")
    out["gemm"] = [{k: r.get(k) for k in keys} for r in ve.get("gemm", []) if "grouped" not in r]
    return out


def resummarize(path: Path, command: str) -> None:
    """The summary of the call recorded at path, recomputed from its sections by this script's summarize (its
    gpu as recorded); the command and commit that did so are recorded beside the call's own."""
    res = json.loads(path.read_text())
    summary = {**summarize({k: res[k] for k in SECTIONS if k in res}), "gpu": res["summary"]["gpu"]}
    res["summary"] = summary
    res["summary_recomputed"] = {"command": command, "git_commit": record.environment().get("git_commit")}
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(summary["where_the_time_goes"], indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="small cases: checks the script end to end")
    ap.add_argument("--rollout-models", default="",
                    help="the rollout section's cases of these models only (comma list; e.g. qwen3-30b-a3b-rehearsal "
                         "for the real-vocabulary pair)")
    ap.add_argument("--budget-s", type=float, default=560.0, help="no section starts past this many seconds")
    ap.add_argument("--train-steps", type=int, default=3, help="timed trainer steps per mode (after a warm-up)")
    ap.add_argument("--rl-steps", type=int, default=3, help="RL steps per run (the first not timed)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(record.RESULTS))
    ap.add_argument("--name", default=None, help="result name (default determinism_tax_<card>, e.g. _h200)")
    ap.add_argument("--resummarize", default=None, metavar="RESULT",
                    help="recompute a result's summary from its sections (this script's summarize; the GPU's name "
                         "kept) and write it back; no GPU")
    ap.add_argument("--section-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--parts", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.resummarize:
        return resummarize(Path(a.resummarize), " ".join(["python3", "experiments/bench_determinism_tax.py",
                                                          *sys.argv[1:]]))
    a.name = a.name or f"determinism_tax_{record.gpu_tag()}"
    if a.section_only:  # a subprocess: one section, its part JSON
        res = globals()[a.section_only](a)
        (Path(a.parts) / f"{a.section_only}.json").write_text(json.dumps(res, indent=1, default=str))
        return
    a.deadline = time.time() + a.budget_s
    command = " ".join(["python3", "experiments/bench_determinism_tax.py", *sys.argv[1:]])
    parts: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for name in a.sections.split(","):
            if time.time() > a.deadline:
                parts[name] = {"error": "skipped: past --budget-s"}
                continue
            print(f"== {name}", flush=True)
            parts[name] = _section(a, name, Path(d))
            summary = summarize(parts)
            path = record.write(a.name, {"summary": summary, "what_it_shows": __doc__.split("\n\n")[0],
                                         "quick": a.quick, **parts}, a.out, command=command)
    print("\n== summary (deterministic / default time; goal <= 1.10)")
    for k, v in summary.items():
        if k != "goals":
            print(f"  {k:34s} {v:.3f}" if isinstance(v, float) and math.isfinite(v) else f"  {k:34s} {v}")
    print("wrote", path)


if __name__ == "__main__":
    main()
