"""The decode step's fused launches (issue 12) on the GPU: bits against what each replaces, at the
engine's shapes, and their time from CUDA graphs in the same run.

  dispatch   kernels/triton/dispatch.py (one program per expert) vs the torch counting sort
  swiglu     the halves of the gate_up output read in place vs .contiguous() copies + the flat kernel
  combine    moe_combine(y_sorted, w, rows=dest) vs index_select + moe_combine
  kv write   kernels.paged_write (one launch) vs two index_copy_

    python experiments/check_fused_decode.py [--out DIR]

Writes results/check_fused_decode_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import RESULTS, write  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.kernels import triton as tb  # noqa: E402
from rlalign.kernels.triton import dispatch as fused_dispatch  # noqa: E402
from rlalign.model.model import dispatch_torch  # noqa: E402


def graph_time(fn, reps: int = 50) -> float:
    """Mean seconds of fn() replayed from a CUDA graph of `reps` calls (launch cost as in
    the engine's decode graphs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 1e3 / (5 * reps)


def bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.view(-1).view(torch.uint8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    res: dict = {}
    E, k = 64, 8
    for n_tok in (1, 37, 256, 4096, 8192):
        N = n_tok * k
        for skew in (False, True):
            ids = torch.randint(0, E, (N,), device=dev, generator=g)
            if skew:
                ids = torch.where(torch.rand(N, device=dev, generator=g) < 0.9, ids % 2, ids)
            want = dispatch_torch(ids, E)
            got = fused_dispatch.moe_dispatch(ids, E)
            ok = all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
            row = {"equal": ok}
            if not skew:
                row["torch_s"] = graph_time(lambda ids=ids: dispatch_torch(ids, E))
                row["triton_s"] = graph_time(lambda ids=ids: fused_dispatch.moe_dispatch(ids, E))
                row["speedup"] = row["torch_s"] / row["triton_s"]
            res[f"dispatch_rows{N}{'_skew' if skew else ''}"] = row
    for R in (2048, 32768):  # a decode step's expert rows; a prefill chunk's
        h = torch.randn(R, 2 * 768, device=dev, generator=g).to(torch.bfloat16)
        gate, up = h.chunk(2, dim=-1)
        want = tb.swiglu(gate.contiguous(), up.contiguous())
        res[f"swiglu_rows{R}"] = {
            "equal": bits(tb.swiglu(gate, up), want),
            "copies_s": graph_time(lambda gate=gate, up=up: tb.swiglu(gate.contiguous(), up.contiguous())),
            "in_place_s": graph_time(lambda gate=gate, up=up: tb.swiglu(gate, up))}
    for T in (256, 4096):
        y_sorted = torch.randn(T * k, 2048, device=dev, generator=g).to(torch.bfloat16)
        w = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1)
        dest = torch.randperm(T * k, device=dev, generator=g)
        with kernels.use(mode="deterministic", backend="triton"):
            want = kernels.moe_combine(y_sorted.index_select(0, dest).view(T, k, 2048), w)
            got = kernels.moe_combine(y_sorted, w, rows=dest)
            res[f"combine_tokens{T}"] = {
                "equal": bits(got, want),
                "gather_s": graph_time(lambda y=y_sorted, w=w, d=dest, T=T: kernels.moe_combine(
                    y.index_select(0, d).view(T, k, 2048), w)),
                "rows_s": graph_time(lambda y=y_sorted, w=w, d=dest: kernels.moe_combine(y, w, rows=d))}
    P, ps, hk, d = 4096, 16, 4, 128
    for n in (256, 4096):
        kp = torch.zeros(P, ps, hk, d, dtype=torch.bfloat16, device=dev)
        vp = torch.zeros_like(kp)
        kk = torch.randn(n, hk, d, device=dev, generator=g).to(torch.bfloat16)
        vv = torch.randn(n, hk * d, device=dev, generator=g).to(torch.bfloat16).view(n, hk, d)
        slots = torch.randperm(P * ps, device=dev, generator=g)[:n]
        wk, wv = kp.clone(), vp.clone()
        wk.flatten(0, 1).index_copy_(0, slots, kk)
        wv.flatten(0, 1).index_copy_(0, slots, vv)
        tb.paged_write(kp, vp, slots, kk, vv)

        def two(kp=kp, vp=vp, slots=slots, kk=kk, vv=vv):
            kp.flatten(0, 1).index_copy_(0, slots, kk)
            vp.flatten(0, 1).index_copy_(0, slots, vv)

        res[f"kv_write_rows{n}"] = {
            "equal": bits(kp, wk) and bits(vp, wv),
            "index_copy_s": graph_time(two),
            "one_launch_s": graph_time(lambda kp=kp, vp=vp, slots=slots, kk=kk, vv=vv: tb.paged_write(
                kp, vp, slots, kk, vv))}
    for name, row in res.items():
        print(f"{name:26s} " + "  ".join(f"{k}={v * 1e6:.2f}us" if k.endswith("_s") else f"{k}={v}"
                                          for k, v in row.items()))
    res["all_equal"] = all(r["equal"] for r in res.values())
    print("all equal:", res["all_equal"])
    print("wrote", write(f"check_fused_decode_{torch.cuda.get_device_name(0).replace(' ', '_')}", res, a.out))


if __name__ == "__main__":
    main()
