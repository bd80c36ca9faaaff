"""Host cost per call of the Triton wrappers, and of the MoE layer with host vs device expert counts, in
one run on one GPU.

    python experiments/kernels/bench_launch.py [--out DIR] [--rounds 7] [--calls 200]

Variants of each op, same inputs, timed interleaved, median over rounds:
  dispatch  plans cached, every launch through triton's JIT dispatcher (common.Launch.__call__ replaced
            here by a call of the JIT function: what a launch cost before launch plans called the
            compiled kernel directly)
  direct    the wrappers as they run: the compiled kernel called directly (common.Launch)
  torch     the torch / cuBLAS op
host_us: time to enqueue `calls` calls / calls (one sync at the end); wall_us: including that sync.
Every op checks that `dispatch` and `direct` give the same bits and that `direct` reaches no JIT
dispatch. Writes launch_overhead_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
from record import environment  # noqa: E402

from rlalign.kernels import torch_default  # noqa: E402
from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.kernels.triton import common  # noqa: E402


def timed(fn, calls: int) -> tuple[float, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / calls, 1e6 * (t2 - t0) / calls


_DIRECT = common.Launch.__call__


def _dispatched(self, *tensors):
    self.fn[self.grid](*tensors, *self.scalars, **self.meta)


def fast(flag: bool):
    """A setup that makes launch plans call the compiled kernel directly (True) or go through triton's
    JIT dispatcher (False)."""
    def setup():
        common.Launch.__call__ = _DIRECT if flag else _dispatched
    return setup


def measure(variants: dict, rounds: int, calls: int) -> dict:
    """variants: name -> (setup, fn); interleaved rounds, medians."""
    samples = {name: ([], []) for name in variants}
    for _ in range(rounds):
        for name, (setup, fn) in variants.items():
            setup()
            h, w = timed(fn, calls)
            samples[name][0].append(h)
            samples[name][1].append(w)
    fast(True)()
    return {name: {"host_us": round(statistics.median(h), 2), "wall_us": round(statistics.median(w), 2)}
            for name, (h, w) in samples.items()}


def same_bits(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(same_bits(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def moe_forward(ops, gate_w, gate_up, down, x, k: int, device_counts: bool):
    """The MoE layer of rlalign/model/model.py through an op module: host counts (bincount + tolist: a
    host sync) or device counts (sort + searchsorted, the layer's path)."""
    T, d = x.shape
    E = gate_up.shape[0]
    weights, ids = ops.moe_route(ops.linear(x, gate_w), k, True)
    flat = ids.reshape(-1)
    if device_counts:
        sorted_ids, order = torch.sort(flat, stable=True)
        counts = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=x.device)).diff()
    else:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
    xs = x.unsqueeze(1).expand(T, k, d).reshape(T * k, d).index_select(0, order)
    h = ops.grouped_linear(xs, gate_up, counts)
    g, u = h.chunk(2, dim=-1)
    y = ops.grouped_linear(ops.swiglu(g, u), down, counts)
    return ops.moe_combine(y.index_select(0, torch.argsort(order)).view(T, k, d), weights)


class _DefaultOps:  # torch_default with the op names above
    linear = staticmethod(torch_default.linear)
    moe_route = staticmethod(torch_default.moe_route)
    grouped_linear = staticmethod(torch_default.grouped_linear)
    swiglu = staticmethod(torch_default.swiglu)
    moe_combine = staticmethod(torch_default.moe_combine)


def takes_direct_path(fn) -> bool:
    """True when a call of fn (already warmed up) reaches no triton JIT dispatch: every launch went
    through common.Launch's direct path."""
    from triton.runtime.jit import JITFunction

    calls, run = [], JITFunction.run

    def counting(self, *a, **kw):
        calls.append(1)
        return run(self, *a, **kw)

    JITFunction.run = counting
    try:
        fn()
    finally:
        JITFunction.run = run
    return not calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    x1, w4k = rnd(1, 4096), rnd(4096, 4096, scale=0.02)
    a64, w1k = rnd(64, 1024), rnd(1024, 1024, scale=0.03)
    x256, w6k = rnd(256, 2048), rnd(6144, 2048, scale=0.02)
    h64, nw = rnd(64, 2048), rnd(2048) + 1
    gate, up = rnd(64, 6144), rnd(64, 6144)
    q = rnd(64, 16, 128)
    cos, sin = (torch.randn(64, 128, device=dev, generator=g) for _ in range(2))
    z, tok = rnd(64, 32000, dtype=torch.float32), torch.randint(0, 32000, (64,), device=dev, generator=g)
    rl = rnd(64, 64, dtype=torch.float32)
    ys, wts = rnd(64, 8, 2048), torch.rand(64, 8, device=dev, generator=g)
    E, k, d, inter = 64, 8, 2048, 768
    gate_up, down, gate_w = rnd(E, 2 * inter, d, scale=0.02), rnd(E, d, inter, scale=0.03), rnd(E, d, scale=0.02)
    ids = torch.randint(0, E, (64 * k,), device=dev, generator=g)
    counts_t = torch.bincount(ids, minlength=E)
    counts_l = counts_t.tolist()
    xg = rnd(64 * k, d)

    ops = {
        "linear 1x4096x4096": (lambda m: m.linear(x1, w4k), lambda: F.linear(x1, w4k)),
        "matmul 64x1024x1024": (lambda m: m.matmul(a64, w1k.t()), lambda: a64 @ w1k.t()),
        "linear 256x2048x6144": (lambda m: m.linear(x256, w6k), lambda: F.linear(x256, w6k)),
        "rmsnorm 64x2048": (lambda m: m.rmsnorm(h64, nw, 1e-6), lambda: torch.rms_norm(h64, (2048,), nw, 1e-6)),
        "swiglu 64x6144": (lambda m: m.swiglu(gate, up), lambda: F.silu(gate) * up),
        "rope 64x16x128": (lambda m: m.rope(q, cos, sin), lambda: q * cos[:, None].to(bf) + q * sin[:, None].to(bf)),
        "logprob 64x32000": (lambda m: m.log_softmax_gather(z, tok),
                             lambda: torch.log_softmax(z, -1).gather(-1, tok[:, None])[:, 0]),
        "moe_route 64x64 k8": (lambda m: m.moe_route(rl, 8, True), lambda: torch.topk(torch.softmax(rl, -1), 8, -1)),
        "moe_combine 64x8x2048": (lambda m: m.moe_combine(ys, wts), lambda: (ys * wts.to(bf)[..., None]).sum(1)),
        "grouped 512x2048->1536 E64 (host list)": (lambda m: m.grouped_linear(xg, gate_up, counts_l),
                                                    lambda: torch_default.grouped_linear(xg, gate_up, counts_l)),
    }
    rows = {}
    with torch.no_grad():
        for name, (tri, ref) in ops.items():
            try:
                fast(False)()
                dispatched = tri(tb)
                fast(True)()
                same = same_bits(dispatched, tri(tb))
                rows[name] = measure({"dispatch": (fast(False), lambda tri=tri: tri(tb)),
                                      "direct": (fast(True), lambda tri=tri: tri(tb)),
                                      "torch": (fast(True), ref)}, args.rounds, args.calls)
                rows[name]["same_bits_dispatch_direct"] = same
                rows[name]["direct_path_taken"] = takes_direct_path(lambda tri=tri: tri(tb))
            except Exception as e:  # noqa: BLE001 (one broken op must not lose the table)
                rows[name] = {"error": repr(e)[:300]}
                print(name, "ERROR", repr(e)[:300])
        # the grouped GEMM with counts on the device
        same = same_bits(tb.grouped_linear(xg, gate_up, counts_t), tb.grouped_linear(xg, gate_up, counts_l))
        rows["grouped 512x2048->1536 E64 (device counts)"] = measure(
            {"dispatch": (fast(False), lambda: tb.grouped_linear(xg, gate_up, counts_t)),
             "direct": (fast(True), lambda: tb.grouped_linear(xg, gate_up, counts_t))}, args.rounds, args.calls)
        rows["grouped 512x2048->1536 E64 (device counts)"]["same_bits_host_counts"] = same
        rows["grouped 512x2048->1536 E64 (device counts)"]["direct_path_taken"] = takes_direct_path(
            lambda: tb.grouped_linear(xg, gate_up, counts_t))

        # the MoE layer (bench-moe-large's shape): host counts (sync) vs device counts, and a CUDA graph
        moe = {}
        for T in (1, 64):
            x = rnd(T, d)
            ref_bits = moe_forward(tb, gate_w, gate_up, down, x, k, False)
            new_bits = moe_forward(tb, gate_w, gate_up, down, x, k, True)
            static_x = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                moe_forward(tb, gate_w, gate_up, down, static_x, k, True)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = moe_forward(tb, gate_w, gate_up, down, static_x, k, True)
            graph.replay()
            def layer(m, dc, x=x):
                return lambda: moe_forward(m, gate_w, gate_up, down, x, k, dc)
            variants = {
                "direct, host counts": (fast(True), layer(tb, False)),
                "direct, device counts": (fast(True), layer(tb, True)),
                "cuda graph replay": (fast(True), graph.replay),
                "torch default (host counts)": (fast(True), layer(_DefaultOps, False)),
            }
            moe[f"MoE layer T={T} d={d} E={E} k={k}"] = {
                **measure(variants, args.rounds, max(20, args.calls // 4)),
                "same_bits_host_device_counts": same_bits(ref_bits, new_bits),
                "same_bits_graph_replay": same_bits(static_y, new_bits)}

    result = {**environment(), "ops": rows, "moe_layer": moe,
              "notes": "host_us: enqueue time per call (one sync after all calls); wall_us: with that sync. "
                       "dispatch = every launch through triton's JIT dispatcher, direct = common.Launch; "
                       "bf16 unless named; torch.no_grad()."}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0).split()[-1].lower()
    (out / f"launch_overhead_{gpu}.json").write_text(json.dumps(result, indent=1) + "\n")

    print(f"\n{'op':44} {'variant':28} {'host us':>9} {'wall us':>9}")
    for table in (rows, moe):
        for name, r in table.items():
            for var, v in r.items():
                if isinstance(v, dict):
                    print(f"{name:44} {var:28} {v['host_us']:9.1f} {v['wall_us']:9.1f}")
            print(f"{name:44} {'checks': <28} {[f'{kk}={v}' for kk, v in r.items() if not isinstance(v, dict)]}")


if __name__ == "__main__":
    main()
