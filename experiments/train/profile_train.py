"""Where the trainer's step spends its time on one GPU: Trainer.train_step (forward_backward +
optimizer_step) of configs/model/bench-moe.yaml at trainer EP 1 (group=None) on an RL-shaped
batch (128 sequences of prompt ~64 + response up to 256 tokens, micro_batch_size 32, packed),
deterministic Triton kernels vs the default ones (`kernels.mode=default`), in one process.

Per variant: one warm-up step, then --steps timed steps (fresh samples each step, the same sample
sets for every variant; the step's wall time between two synchronizes), device time per phase (CUDA
events around each phase, read once per step: no host sync inside the step, so the instrumented step
runs as the plain one): forward = score_micro_batch, backward = Tensor.backward, loss = the algorithm's
loss (rlalign.training.losses) and its host copies, tree_add = TreeSum.add, tree = TreeSum.total,
optimizer = optimizer_step (grad_norm, AdamW step, the copy back)), the number and wall time of Triton
JIT compilations, then one step under
torch.profiler: CUDA time per kernel name (top N), the host's top ops and the device's idle gaps inside
the step (the largest with the kernels around them). Prints a table last; writes
results/train_profile_<model>_<gpu>[_<name>].json.

    python experiments/train/profile_train.py [--variants det,det_nofill,default] [--steps 3] [--out DIR]

Variants: det (kernels.mode=deterministic backend=triton, torch.use_deterministic_algorithms, which
also fills every torch.empty with NaN), det_nofill (the same with
torch.utils.deterministic.fill_uninitialized_memory=False: what rlalign.kernels.configure sets, the
production step), det_unfused (det_nofill with the step's pieces as they were before the fused ones, for
a before/after in one process: torch.optim.AdamW's step and a separate rounding copy into the model,
fp32 copies of bf16 leaves before the gradient trees' adds, the MoE input rows as an expand copy + an
index_select whose backward is a sorting index_put (the experts' first GEMM reading that copy), the
combine through a gathered copy, the response logits gathered and copied to fp32, the experts' SwiGLU
on copies of the gate/up halves, the grad norm's per-expert squares in full, the MoE dispatch of a
training micro-batch as the torch counting sort, the loss's host reads (pre-update logprobs, stats) and
pageable copies per micro-batch, the residual adds apart from the norms; `unfused` below),
default (kernels.mode=default, deterministic algorithms off).

--check-bits (with det_unfused and det_nofill): before the timed steps, one forward_backward of the
first batch under each, from the same weights: every gradient's and the logprobs' fingerprints must be
equal (the fused pieces keep the bits); and AdamW's update of two gradients (a dense and an expert one)
by the Triton kernel vs the definition's torch ops on the GPU (equal bits; torch.optim.AdamW's own
kernels give other bits, recorded too).

--result NAME: also NAME.json with the MFU of each variant: model FLOPs per step (6 x the active
matmul parameters x tokens, plus causal attention's 6 x 2 x H x D x sum of L^2 / 2 over layers and
sequences) / step time / the GPU's dense bf16 peak (--peak-tflops, 989 for an H200 SXM). --vendor FILE: the
kernel ratios of a bench_vs_vendor result written in the same call join that summary.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.config import load_config  # noqa: E402

VENDOR_KEYS = ("attn_fwd_over_sdpa_min", "attn_fwdbwd_over_sdpa_min", "linear_graph_over_cublas_min",
               "linear_rows_equal_main_config_all", "decode_vs_prefill_rows_differing")
PHASES = ("forward", "loss", "backward", "tree_add", "tree_total", "optimizer", "grad_norm", "adamw")


# name -> (kernels mode, deterministic algorithms, fill uninitialised memory)
VARIANTS = {
    "det": ("deterministic", True, True),
    "det_nofill": ("deterministic", True, False),
    "det_unfused": ("deterministic", True, False),
    "default": ("default", False, True),
}


PIECES = ("add", "slot", "combine", "lp", "swiglu", "squares", "dispatch", "step", "syncs", "norm")


@contextlib.contextmanager
def unfused(timers=None, keep=()):
    """The step's pieces as they were before the fused ones (same bits except AdamW, whose torch
    kernels are another definition), except those named in `keep` (PIECES): restored on exit."""
    import rlalign.kernels as K
    from rlalign.kernels import fixed_order as fo
    from rlalign.kernels import torch_deterministic as ref
    from rlalign.kernels import triton as tb
    from rlalign.kernels.triton import dispatch as D
    from rlalign.training.optimizer import MasterWeights
    from rlalign.training.trainer import Trainer

    def slot_rows(x, order, dest, k):
        if x.requires_grad and torch.is_grad_enabled():
            T, d = x.shape
            return x.unsqueeze(1).expand(T, k, d).reshape(T * k, d).index_select(0, order)
        return x.index_select(0, order // k)

    def combine_rows(y, weights, rows):
        T, k = weights.shape
        if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
            return tb.moe_combine(y.index_select(0, rows).view(T, k, y.shape[-1]), weights)
        return saved["combine"](y, weights, rows)

    def logprobs_rows(logits, rows, tokens, temperature=1.0, top_k=0, top_p=1.0):
        return K.token_logprobs(logits[rows], tokens, temperature, top_k, top_p)

    def step(self, grads, coef, model=None):  # torch.optim.AdamW's step on the masters, in AdamW's state
        if not isinstance(getattr(self, "torch_opt", None), torch.optim.AdamW):
            g = self.opt.param_groups[0]
            self.torch_opt = torch.optim.AdamW(g["params"], lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                               weight_decay=g["weight_decay"], foreach=False, fused=False)
            self.torch_opt.state = self.opt.state
        for n, m in self.master.items():
            m.grad = grads[n] * coef if coef < 1.0 else grads[n]
        self.torch_opt.step()
        self.torch_opt.zero_grad(set_to_none=True)
        return set()

    def ppo_loss(self, samples, alg, old, ref, minibatch=None):  # the loss with its host syncs per micro-batch
        from rlalign.training import trainer as trainer_module
        from rlalign.training.losses import LossBatch

        loss = trainer_module.resolve_loss(alg)  # as Trainer.ppo_loss resolves it (timed when _install wrapped it)
        members = [j for mb in minibatch for j in mb] if minibatch is not None else range(len(samples))
        sizes = dict(minibatch_tokens=sum(len(samples[j].response) for j in members), minibatch_sequences=len(members),
                     max_new_tokens=self.max_new_tokens)

        def loss_fn(lps, idx):
            new = [(lp, j) for lp, j in zip(lps, idx) if j not in old]
            if new:  # the pre-update logprobs copied to the host at once
                flat = torch.cat([lp.detach().float() for lp, _ in new]).cpu()
                for (_, j), x in zip(new, flat.split([lp.numel() for lp, _ in new])):
                    old[j] = x.clone()
            dev = lps[0].device
            cat = lambda xs: torch.cat(xs).to(dev).float() if xs else torch.zeros(0, device=dev)  # noqa: E731
            batch = LossBatch(torch.cat(lps), cat([samples[j].generator_logprobs for j in idx]),
                              cat([old[j] for j in idx]),
                              cat([torch.full((len(samples[j].response),), samples[j].advantage) for j in idx]),
                              [len(samples[j].response) for j in idx],
                              cat([ref[j] for j in idx]) if ref is not None else None, **sizes)
            value, st = loss(batch, alg)
            vals = [torch.as_tensor(v, device=dev).float().reshape(()) for v in st.values()]
            torch.stack(vals).tolist()  # the stats' host read per micro-batch
            return value, st

        return loss_fn

    def add_norm(h, a, w, eps):
        s = h + a
        return s, K.rmsnorm(s, w, eps)

    def squares(x):
        return fo.tree_sum(x**2, 1) if x.dim() == 2 else ref.sum_of_squares(x)

    saved = {"add": K.add_f32, "slot": K.moe_slot_rows, "slot_linear": K.moe_slot_linear,
             "combine": tb.moe_combine_rows, "lp": K.token_logprobs_rows, "step": MasterWeights.step,
             "swiglu": K.swiglu_halves, "norm": K.add_rmsnorm,
             "squares": K.sum_of_squares, "rows": D.MAX_ROWS, "loss": Trainer.__dict__["ppo_loss"]}
    if "syncs" not in keep:
        Trainer.ppo_loss = ppo_loss
    if "add" not in keep:
        K.add_f32 = lambda a, b, c=None: a.float() + b.float() if c is None else a.float() + (b.float() + c.float())
    if "slot" not in keep:
        K.moe_slot_rows = slot_rows
        K.moe_slot_linear = lambda x, order, dest, k, w, counts: K.grouped_linear(K.moe_slot_rows(x, order, dest, k),
                                                                                  w, counts)
    if "combine" not in keep:
        tb.moe_combine_rows = combine_rows
    if "lp" not in keep:
        K.token_logprobs_rows = logprobs_rows
    if "swiglu" not in keep:
        K.swiglu_halves = lambda h: K.swiglu(*h.chunk(2, dim=-1))
    if "norm" not in keep:
        K.add_rmsnorm = add_norm
    if "squares" not in keep:
        K.sum_of_squares = squares
    if "dispatch" not in keep:
        D.MAX_ROWS = 1 << 16  # training micro-batches (~80k rows) through the torch counting sort
    if "step" not in keep:
        MasterWeights.step = timers.wrap("adamw", step) if timers is not None else step
    try:
        yield
    finally:
        K.add_f32, K.moe_slot_rows, tb.moe_combine_rows = saved["add"], saved["slot"], saved["combine"]
        K.moe_slot_linear, K.add_rmsnorm = saved["slot_linear"], saved["norm"]
        K.token_logprobs_rows, MasterWeights.step = saved["lp"], saved["step"]
        K.swiglu_halves, K.sum_of_squares, D.MAX_ROWS = saved["swiglu"], saved["squares"], saved["rows"]
        Trainer.ppo_loss = saved["loss"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timers:
    """Phase times from CUDA events recorded around each wrapped call on the current stream (no host
    sync: the instrumented step runs as the plain one), read once per step by take(), after the step's
    own closing synchronize; on the CPU, host wall time. A phase's time is the device time between its
    events (kernels plus any idle the host leaves inside it)."""

    def __init__(self):
        self.events: list = []  # (phase, start, end)
        self.on = True

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            if not self.on:
                return fn(*a, **k)
            start = _mark()
            try:
                return fn(*a, **k)
            finally:
                self.events.append((name, start, _mark()))
        return inner

    def take(self):
        _sync()
        t = defaultdict(float)
        for name, start, end in self.events:
            t[name] += start.elapsed_time(end) / 1000 if torch.cuda.is_available() else end - start
        self.events.clear()
        return {k: round(v, 6) for k, v in t.items()}


def _mark():
    if not torch.cuda.is_available():
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def idle_gaps(prof, wall_s: float, top: int = 10) -> dict:
    """The device's idle time inside one profiled step: kernels (and copies) sorted by start, the gaps
    between the end of everything before and the next start; the largest with their neighbours' names."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    gaps, end, prev = [], spans[0][1], spans[0][2]
    for a, b, name in spans[1:]:
        if a > end:
            gaps.append((a - end, prev, name))
        if b > end:
            end, prev = b, name
    first, last = spans[0][0], end
    big = sorted(gaps, reverse=True)[:top]
    return {"span_ms": round((last - first) / 1000, 3), "idle_ms": round(sum(g[0] for g in gaps) / 1000, 3),
            "idle_gaps_over_50us": sum(1 for g in gaps if g[0] > 50),
            "idle_ms_in_gaps_over_50us": round(sum(g[0] for g in gaps if g[0] > 50) / 1000, 3),
            "wall_ms": round(wall_s * 1000, 3),
            "largest": [{"us": round(g[0], 1), "after": g[1][:70], "before": g[2][:70]} for g in big]}


def _install(timers: Timers, trainer) -> None:
    import rlalign.training.trainer as tr
    from rlalign.training.reduce import TreeSum

    tr.score_micro_batch = timers.wrap("forward", tr.score_micro_batch)
    tr.resolve_loss = lambda alg, _resolve=tr.resolve_loss: timers.wrap("loss", _resolve(alg))
    torch.Tensor.backward = timers.wrap("backward", torch.Tensor.backward)
    TreeSum.add = timers.wrap("tree_add", TreeSum.add)
    TreeSum.total = timers.wrap("tree_total", TreeSum.total)
    tr.Trainer.optimizer_step = timers.wrap("optimizer", tr.Trainer.optimizer_step)
    tr.Trainer.grad_norm = timers.wrap("grad_norm", tr.Trainer.grad_norm)
    from rlalign.training.optimizer import MasterWeights

    MasterWeights.step = timers.wrap("adamw", MasterWeights.step)  # AdamW (+ the fused rounding into the model)


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


def make_samples(step: int, n: int, prompt: int, resp: int, vocab: int, params):
    """n samples with prompt lengths prompt±12 and responses of resp-16..resp tokens (random tokens,
    seeded by step), drawn with `params`: the RL run's shape (short prompts, responses near max_new_tokens)."""
    from rlalign.sequences import Sample

    rng = random.Random(1000 + step)
    out = []
    for i in range(n):
        p = [rng.randrange(2, vocab) for _ in range(rng.randint(max(1, prompt - 12), prompt + 12))]
        r = [rng.randrange(2, vocab) for _ in range(rng.randint(max(1, resp - 16), resp))]
        lp = torch.tensor([-rng.random() * 4 for _ in r], dtype=torch.float32)
        out.append(Sample(p, r, lp, advantage=rng.uniform(-1, 1), sample_id=step * n + i, params=params))
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


def _fingerprints(trainer) -> dict[str, str]:
    from rlalign.fingerprint import fingerprint

    return {n: fingerprint(g) for n, g in sorted(trainer.grads.items())}


def check_bits(trainer, samples, alg) -> dict:
    """One forward_backward of `samples` unfused and fused from the same weights: gradients and
    logprobs compared by fingerprint; then AdamW on two of the gradients: the Triton kernel vs the
    definition's torch ops (and torch.optim.AdamW's step, another definition)."""
    from rlalign.fingerprint import fingerprint
    from rlalign.kernels import torch_deterministic as ref
    from rlalign.kernels import triton as tb
    from rlalign.training.optimizer import adamw_scalars

    runs = {}
    for name in ("det_unfused", "det_nofill"):
        old: dict = {}
        loss_fn = trainer.ppo_loss(samples, alg, old, None)
        ctx = unfused() if name == "det_unfused" else contextlib.nullcontext()
        with ctx:
            trainer.forward_backward(samples, loss_fn)
        _sync()
        runs[name] = {"grads": _fingerprints(trainer),
                      "logprobs": fingerprint(torch.cat([old[i] for i in sorted(old)]))}
    a, b = runs["det_unfused"], runs["det_nofill"]
    differ = [n for n in a["grads"] if a["grads"][n] != b["grads"].get(n)]
    norm_fused = trainer.gradients.norm()  # the fused step's gradients: the norm's sums fused and not
    with unfused(keep=tuple(p for p in PIECES if p != "squares")):
        norm_unfused = trainer.gradients.norm()
    out = {"gradients": len(a["grads"]), "gradients_differing": differ, "grads_equal": not differ,
           "logprobs_equal": a["logprobs"] == b["logprobs"], "logprobs_fingerprint": b["logprobs"],
           "grad_norm_equal": norm_fused == norm_unfused, "grad_norm": norm_fused}
    # each piece fused alone against all unfused: which one moves bits, if any
    pieces = {}
    for piece in ("add", "slot", "combine", "lp", "swiglu", "dispatch", "norm"):
        old = {}
        with unfused(keep=(piece,)):
            trainer.forward_backward(samples, trainer.ppo_loss(samples, alg, old, None))
        fp = _fingerprints(trainer)
        pieces[piece] = {"gradients_differing": sum(fp[n] != a["grads"][n] for n in fp),
                         "logprobs_equal": fingerprint(torch.cat([old[i] for i in sorted(old)])) == a["logprobs"]}
    out["pieces_alone"] = pieces
    print(f"-- bits by piece: {json.dumps(pieces)}", flush=True)
    again: dict = {}  # the unfused run repeated: are the bits even repeatable here?
    with unfused():
        trainer.forward_backward(samples, trainer.ppo_loss(samples, alg, again, None))
    fp = _fingerprints(trainer)
    out["unfused_repeat_differing"] = sum(fp[n] != a["grads"][n] for n in fp)
    adam = {}
    names = [trainer.dense_names[1], trainer.expert_names[0]]
    for n in names:
        g = trainer.grads[n]
        p0 = trainer.master[n].data
        res = {}
        for impl in ("triton", "torch_ops", "torch_optim"):
            p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
            if impl == "torch_optim":
                q = torch.nn.Parameter(p)
                opt = torch.optim.AdamW([q], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, foreach=False,
                                        fused=False)
                for _ in range(2):
                    q.grad = g * 0.5
                    opt.step()
                res[impl] = fingerprint(q.data)
                continue
            for t in (1.0, 2.0):
                sc = adamw_scalars(0.01, (0.9, 0.99), 1e-8, 0.01, t, 0.5, p.device)
                (tb.adamw_ if impl == "triton" else ref.adamw_)(p, g.contiguous(), m, v, sc)
            res[impl] = [fingerprint(p), fingerprint(m), fingerprint(v)]
            del p, m, v
        adam[n] = {"numel": g.numel(), "triton_equals_torch_ops": res["triton"] == res["torch_ops"],
                   "torch_optim_equals_definition": res["torch_optim"] == res["torch_ops"][0]}
    out["adamw"] = adam
    trainer.gradients.grads = {}
    _sync()
    print(f"-- bits: gradients {len(a['grads'])}, differing {len(differ)} {differ[:4]}; logprobs equal "
          f"{out['logprobs_equal']}; grad norm equal {out['grad_norm_equal']}; adamw {json.dumps(adam)}", flush=True)
    return out


def model_flops(cfg, batch) -> dict:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward's 2 per multiply-add) over
    the step's tokens: the active parameters of every linear (attention q/k/v/o, router, top-k
    experts' gate/up/down, the LM head; the embedding is a lookup) and causal attention (QK^T and PV:
    2 x 2 x H x D per (query, key) pair, L (L + 1) / 2 pairs per sequence of length L per layer)."""
    m = cfg.model
    d, H, Hk, D = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    attn = d * H * D * 2 + d * Hk * D * 2
    moe = m.num_experts > 0
    mlp = (d * m.num_experts + m.top_k * 3 * d * m.moe_intermediate_size) if moe else 3 * d * m.intermediate_size
    active = m.num_layers * (attn + mlp) + d * m.vocab_size
    lens = [len(s.prompt) + len(s.response) for s in batch]
    tokens = sum(lens)
    pairs = sum(n * (n + 1) // 2 for n in lens)
    linear = 6 * active * tokens
    attention = 3 * 2 * 2 * H * D * pairs * m.num_layers
    return {"active_matmul_params": active, "tokens": tokens, "linear_flops": linear, "attention_flops": attention,
            "flops": linear + attention}


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
    ap.add_argument("--check-bits", action="store_true", help="unfused vs fused gradients and AdamW first")
    ap.add_argument("--result", default=None, help="also write RESULT.json: MFU per variant and the summary")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200 SXM: 989)")
    ap.add_argument("--vendor", default=None, help="a bench_vs_vendor result of the same call: its kernel ratios "
                                                    "join RESULT's summary")
    a = ap.parse_args()
    backend = "triton" if a.device == "cuda" else "torch"

    t_start = time.perf_counter()
    compiles_counted = _count_compiles()
    cfg = load_config([f"model={a.model}", f"device={a.device}", f"kernels.backend={backend}", "trainer.ep_size=1",
                       f"trainer.micro_batch_size={a.mbs}"])
    from rlalign.sampling_params import SamplingParams
    from rlalign.training.trainer import Trainer

    kernels.set_mode("deterministic", backend)
    trainer = Trainer(cfg, None)
    alg = cfg.algorithm
    timers = Timers()
    _install(timers, trainer)
    vocab = cfg.model.vocab_size
    params = SamplingParams.from_config(cfg)
    batches = [make_samples(s, a.seqs, a.prompt, a.resp, vocab, params) for s in range(a.steps + 2)]
    tokens = [sum(len(s.prompt) + len(s.response) for s in b) for b in batches]
    results, errors = {}, {}
    bits = None
    if a.check_bits:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        timers.on = False
        try:
            with kernels.use(mode="deterministic", backend=backend):
                bits = check_bits(trainer, batches[0], alg)
        except Exception as e:  # the timings still run; the record says what failed
            traceback.print_exc()
            bits = {"error": f"{type(e).__name__}: {e}"[:2000], "grads_equal": False, "logprobs_equal": False,
                    "adamw": {}}
        timers.on = True
    for name in a.variants.split(","):
        if time.perf_counter() - t_start > a.budget_s:
            print(f"-- {name}: skipped (past --budget-s)", flush=True)
            continue
        mode, det_alg, fill = VARIANTS[name]
        torch.use_deterministic_algorithms(det_alg, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        rec = {"mode": mode, "deterministic_algorithms": det_alg, "fill_uninitialized_memory": fill, "steps": []}
        pieces = unfused(timers) if name == "det_unfused" else contextlib.nullcontext()
        try:
            with kernels.use(mode=mode, backend=backend), pieces:
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
                for st in rec["steps"]:
                    fl = model_flops(cfg, batches[st["step"]])
                    st["flops"] = fl["flops"]
                    st["mfu"] = round(fl["flops"] / st["wall_s"] / (a.peak_tflops * 1e12), 4)
                timed = rec["steps"][1:]
                rec["median_mfu"] = sorted(x["mfu"] for x in timed)[len(timed) // 2] if timed else None
                rec["median_wall_s"] = sorted(x["wall_s"] for x in timed)[len(timed) // 2] if timed else None
                rec["median_phases_s"] = {p: sorted(x["phases_s"].get(p, 0.0) for x in timed)[len(timed) // 2]
                                          for p in PHASES} if timed else {}
                if not a.no_profile:
                    from torch.profiler import ProfilerActivity, profile

                    timers.on = False
                    _sync()
                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
                    for _ in range(2):  # the second: the profiler's own start-up (and a new batch's) not in it
                        with profile(activities=acts) as prof:
                            t0 = time.perf_counter()
                            trainer.train_step(batches[a.steps + 1], alg)
                            _sync()
                            wall = time.perf_counter() - t0
                    timers.on = True
                    busy, launches, rows, host, ops = kernel_table(prof, a.top)
                    rec["profile"] = {"wall_s_under_profiler": round(wall, 4), "device_busy_ms": round(busy, 2),
                                      "kernel_launches": launches, "top_kernels": rows, "top_host_ops": host,
                                      "top_ops_device_incl": ops, "idle": idle_gaps(prof, wall)}
        except Exception as e:  # the other variants still run; the record says what failed
            traceback.print_exc()
            errors[name] = f"{type(e).__name__}: {e}"[:2000]
            continue
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
        idle = pr.get("idle") or {}
        if idle:
            print(f"  -- device idle {idle['idle_ms']:.1f} ms of a {idle['span_ms']:.1f} ms span "
                  f"({idle['idle_gaps_over_50us']} gaps > 50 us: {idle['idle_ms_in_gaps_over_50us']:.1f} ms); largest:")
            for g in idle["largest"][:6]:
                print(f"  {g['us']:9.1f} us  after {g['after'][:40]}  before {g['before'][:40]}")
        print("  -- host, top self CPU:")
        for r in pr["top_host_ops"][:8]:
            print(f"  {r['self_cpu_ms']:9.2f} ms {r['calls']:6d}x  {r['name']}")
    payload = {"setup": {"model": a.model, "seqs": a.seqs, "prompt": a.prompt, "resp": a.resp,
                         "micro_batch_size": a.mbs, "trainer_ep": 1, "layout": "packed", "steps": a.steps,
                         "tokens_per_step": tokens, "compiles_counted": compiles_counted},
               "variants": results, "churn": churn_rec, "bits": bits, "errors": errors}
    print(f"\n== MFU (model FLOPs / median step time / peak {a.peak_tflops:.0f} TFLOP/s)")
    for n in names:
        print(f"  {n:<14} {results[n]['median_wall_s']} s  MFU {results[n]['median_mfu']}")
    gpu = torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else "cpu"
    out = a.out or os.environ.get("OUT")
    print("wrote", record.write(f"train_profile_{a.model}_{gpu}" + (f"_{a.name}" if a.name else ""), payload, out))
    if a.result:
        res = mfu_result(cfg, a, results, bits, batches)
        if a.vendor:
            vendor = json.loads(Path(a.vendor).read_text())
            res["summary"].update({k: vendor["summary"][k] for k in VENDOR_KEYS if k in vendor.get("summary", {})})
            res["vendor"] = {"file": Path(a.vendor).name, "command": vendor.get("command"),
                             "git_commit": vendor.get("git_commit"), "bars": vendor.get("bars")}
            sm = res["summary"]
            res["what_it_shows"] += (
                f" Kernels in the same call ({Path(a.vendor).name}): attention prefill fwd >= "
                f"{sm.get('attn_fwd_over_sdpa_min', float('nan')):.2f}x, fwd+bwd >= "
                f"{sm.get('attn_fwdbwd_over_sdpa_min', float('nan')):.2f}x SDPA flash; linear >= "
                f"{sm.get('linear_graph_over_cublas_min', float('nan')):.2f}x cuBLAS under CUDA graphs.")
        print("wrote", record.write(a.result, {**res, "errors": errors}, out))


def mfu_result(cfg, a, results: dict, bits, batches) -> dict:
    """The MFU result: per variant the step time, FLOPs and MFU, where the step goes (top kernels); the
    summary holds the fused step's (det_nofill: the production settings) MFU as trainer_mfu."""
    fl = model_flops(cfg, batches[1])
    variants = {}
    for n, r in results.items():
        pr = r.get("profile") or {}
        variants[n] = {"median_step_s": r["median_wall_s"], "median_mfu": r["median_mfu"],
                       "median_phases_s": r["median_phases_s"],
                       "steps": [{k: x[k] for k in ("step", "tokens", "wall_s", "flops", "mfu")} for x in r["steps"]],
                       "device_busy_ms": pr.get("device_busy_ms"), "kernel_launches": pr.get("kernel_launches"),
                       "profiled_step_wall_s": pr.get("wall_s_under_profiler"), "idle": pr.get("idle"),
                       "top_kernels": pr.get("top_kernels")}
    main = results.get("det_nofill") or {}
    before = results.get("det_unfused")
    summary = {"trainer_mfu": main.get("median_mfu"), "trainer_step_s": main.get("median_wall_s"),
               "trainer_mfu_is": "det_nofill (the production settings): model FLOPs / the median of the timed "
                                 "steps' wall time / peak; phase timers are CUDA events read once per step (no host "
                                 "sync inside the step)",
               "peak_tflops": a.peak_tflops, "flops": fl["flops"], "model": a.model}
    for n, r in results.items():
        summary[f"step_s_{n}"] = r["median_wall_s"]
    if before:
        summary.update(trainer_mfu_unfused=before["median_mfu"], trainer_step_s_unfused=before["median_wall_s"])
    if bits:
        summary.update(grads_equal_unfused_fused=bits["grads_equal"],
                       logprobs_equal_unfused_fused=bits["logprobs_equal"],
                       grad_norm_equal_unfused_fused=bits.get("grad_norm_equal"),
                       adamw_triton_equals_definition=bool(bits["adamw"]) and all(
                           v["triton_equals_torch_ops"] for v in bits["adamw"].values()))
    return {"summary": summary, "flop_count": {**fl, "formula": model_flops.__doc__.split(chr(10))[0] + " ...",
                                               "peak_flops": a.peak_tflops * 1e12},
            "setup": {"model": a.model, "seqs": a.seqs, "prompt": a.prompt, "resp": a.resp, "micro_batch_size": a.mbs,
                      "trainer_ep": 1, "timed_steps": a.steps},
            "variants": variants, "bits": bits,
            "what_it_shows": _shows(a, fl, variants, bits)}


def _shows(a, fl: dict, variants: dict, bits) -> str:
    """One paragraph with the numbers: each variant's step and MFU, where the device time went, the bits."""
    parts = [f"{a.model} trainer step (Trainer.train_step, trainer EP 1, {a.seqs} RL-shaped sequences = "
             f"{fl['tokens']} tokens, micro-batch {a.mbs}), {fl['flops'] / 1e12:.1f} TFLOP of model FLOPs a step, "
             f"peak {a.peak_tflops:.0f} TFLOP/s; median of {a.steps} timed steps (phase timers: CUDA events, no host "
             "sync):"]
    for n, v in variants.items():
        idle = (v.get("idle") or {}).get("idle_ms")
        parts.append(f"{n} {v['median_step_s']} s = MFU {v['median_mfu']} (profiled step: device busy "
                     f"{v.get('device_busy_ms')} ms, idle {idle} ms, {v.get('kernel_launches')} launches);")
    if bits and "gradients" in bits:
        moved = {k: v["gradients_differing"] for k, v in (bits.get("pieces_alone") or {}).items()
                 if v["gradients_differing"] or not v["logprobs_equal"]}
        parts.append(f"bits, fused vs unfused pieces from the same weights: {bits['gradients']} gradients, "
                     f"{len(bits['gradients_differing'])} differing, logprobs equal {bits['logprobs_equal']}, grad "
                     f"norm equal {bits.get('grad_norm_equal')}; pieces that move gradient bits alone: "
                     + (", ".join(f"{k} ({v} gradients)" for k, v in moved.items()) or "none") + ".")
    return " ".join(parts)


if __name__ == "__main__":
    main()
