"""Whether the product's Triton kernels compile for sm_90 with the GPU's Triton across the shapes a user's model
brings, not only the benchmarks' ones: attention prefill (forward and backward) and paged decode over head dims, GQA
ratios and dtypes, RMSNorm over hidden sizes, the linears and the experts' grouped GEMM over odd shapes, the
sampler's, logprob's and the cut's kernels over vocabulary sizes, the default mode's split-KV decode, and a MoE
layer's small kernels (router, dispatch, combine, qk-norm + rope into pages, rope, swiglu, embedding, AdamW). No
GPU: each call's launches are captured on CPU tensors and specialised as triton's JIT specialises them (sass.py),
then compiled to a cubin. Triton 3.6's passes carry LLVM assertions, so a kernel that a newer Triton compiles can
abort there (compile_topp_windows.py found one).

    PYTHONPATH=. python experiments/kernels/compile_sweep.py [--quick] [--out DIR]

Run it with the Triton the GPU machine has (3.6; see sass.py). Writes results/compile_sweep_sm90.json: per case and
launch "ok" or the error's last line. A host-side check that reads an output (never written: nothing runs) may
stop a call after its launches; those launches are compiled and the check's message kept as "host_check".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass import captured, cpu_tensor  # noqa: E402

from rlalign.kernels.triton import (  # noqa: E402
    attention,
    dispatch,
    elementwise,
    embed,
    gemm,
    logprob,
    moe,
    norm,
    optim,
    sampling,
    splitkv,
    topp,
)

BF16, F32 = torch.bfloat16, torch.float32


def _attention(D: int, H: int, HK: int, dtype, page: int):
    def run():
        lens = [1, 37, 300]  # a one-token sequence, ragged tails
        n = sum(lens)
        q = cpu_tensor(n, H, D, dtype=dtype).requires_grad_()
        k = cpu_tensor(n, HK, D, dtype=dtype).requires_grad_()
        v = cpu_tensor(n, HK, D, dtype=dtype).requires_grad_()
        cu = [0]
        for t in lens:
            cu.append(cu[-1] + t)
        o = attention.attention_prefill(q, k, v, cu, D**-0.5)
        o.backward(torch.empty_like(o))
        rows, keys = 24, 96
        pages = rows * keys // page
        kp, vp = cpu_tensor(pages, page, HK, D, dtype=dtype), cpu_tensor(pages, page, HK, D, dtype=dtype)
        table = torch.arange(pages, dtype=torch.int32).reshape(rows, keys // page)
        seq = torch.arange(rows, dtype=torch.int32)
        attention.attention_paged(cpu_tensor(rows, H, D, dtype=dtype), kp, vp, table, seq,
                                  torch.full((rows,), keys - 1, dtype=torch.int32), D**-0.5)
        # a prompt chunk of 16 rows of sequence 0 after 8 decode rows: the prefill tiles read through the table
        pos = torch.cat([torch.full((8,), keys - 1, dtype=torch.int32), torch.arange(16, dtype=torch.int32)])
        sidx = torch.cat([torch.arange(1, 9, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)])
        attention.attention_paged(cpu_tensor(rows, H, D, dtype=dtype), kp, vp, table, sidx, pos, D**-0.5,
                                  runs=[(8, 16, 0, 0)])
    return run


def _norm(D: int, dtype):
    def run():
        x = cpu_tensor(33, D, dtype=dtype).requires_grad_()
        w = cpu_tensor(D, dtype=dtype).requires_grad_()
        y = norm.rmsnorm(x, w, 1e-6)
        y.backward(torch.empty_like(y))
    return run


def _linear(M: int, N: int, K: int, dtype):
    def run():
        x = cpu_tensor(M, K, dtype=dtype).requires_grad_()
        w = cpu_tensor(N, K, dtype=dtype).requires_grad_()
        gemm.linear(x, w).backward(cpu_tensor(M, N, dtype=dtype))
    return run


def _grouped(E: int, per: int, N: int, K: int, dtype):
    def run():
        x = cpu_tensor(E * per, K, dtype=dtype).requires_grad_()
        w = cpu_tensor(E, N, K, dtype=dtype).requires_grad_()
        gemm.grouped_linear(x, w, [per] * E).backward(cpu_tensor(E * per, N, dtype=dtype))
    return run


def _sampler(V: int, dtype, op: str):
    def run():
        B = 8
        z = cpu_tensor(B, V, dtype=dtype)
        ids, pos = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
        tokens = torch.zeros(B, dtype=torch.long)
        if op == "draw":
            sampling.gumbel_argmax(z, 3, ids, pos, 1.25)
        elif op == "draw_cut":
            sampling.gumbel_argmax(z, 3, ids, pos, 1.25, torch.zeros(B, dtype=torch.long))
        elif op == "logprob":
            logprob.log_softmax_gather(z, tokens)
            logprob.tempered_logprobs(z, 1.25, tokens, torch.zeros(B, dtype=torch.long))
        elif op == "top_p":
            topp.filter_cut(z, 0, 0.95, 1.25)
        else:
            topp.filter_cut(z, 20, 0.9, 1.25)
    return run


def _decode_default(D: int, H: int, HK: int, dtype, page: int):
    """The default kernels' split-KV paged decode (kernels.mode=default's engine)."""
    def run():
        rows, keys = 24, 200
        pages = rows * -(-keys // page)
        kp, vp = cpu_tensor(pages, page, HK, D, dtype=dtype), cpu_tensor(pages, page, HK, D, dtype=dtype)
        table = torch.arange(pages, dtype=torch.int32).reshape(rows, -1)
        splitkv.paged_decode(cpu_tensor(rows, H, D, dtype=dtype), kp, vp, table, torch.arange(rows, dtype=torch.int32),
                             torch.full((rows,), keys - 1, dtype=torch.int32), D**-0.5)
    return run


def _layer_pieces(T: int, E: int, k: int, D: int, H: int, HK: int, HD: int, dtype):
    """A MoE layer's small kernels: the router, dispatch and combine, qk-norm + rope (into pages), rope with its
    backward, swiglu, the embedding's backward, AdamW and the gradient norm's sum of squares."""
    def run():
        logits = cpu_tensor(T, E, dtype=F32).requires_grad_()
        w, ids = moe.moe_route(logits, k, True)
        w.backward(torch.empty_like(w))
        moe.moe_route(cpu_tensor(T, E, dtype=F32), k, False)
        dispatch.moe_dispatch(torch.zeros(T * k, dtype=torch.long), E)
        y = cpu_tensor(T, k, D, dtype=dtype).requires_grad_()
        c = moe.moe_combine(y, cpu_tensor(T, k, dtype=F32).requires_grad_())
        c.backward(torch.empty_like(c))
        cos, sin = cpu_tensor(T, HD // 2, dtype=F32), cpu_tensor(T, HD // 2, dtype=F32)
        q, kk = cpu_tensor(T, H, HD, dtype=dtype), cpu_tensor(T, HK, HD, dtype=dtype)
        qw, kw = cpu_tensor(HD, dtype=dtype), cpu_tensor(HD, dtype=dtype)
        elementwise.qk_norm_rope(q, kk, qw, kw, 1e-6, cos, sin)
        kp, vp = cpu_tensor(T, 16, HK, HD, dtype=dtype), cpu_tensor(T, 16, HK, HD, dtype=dtype)
        slots = torch.arange(T, dtype=torch.long)
        elementwise.qk_norm_rope(q, kk, qw, kw, 1e-6, cos, sin, pages=(kp, vp, slots, cpu_tensor(T, HK, HD,
                                                                                                 dtype=dtype)))
        elementwise.paged_write(kp, vp, slots, kk, cpu_tensor(T, HK, HD, dtype=dtype))
        r = elementwise.rope(cpu_tensor(T, H, HD, dtype=dtype).requires_grad_(), cos, sin)
        r.backward(torch.empty_like(r))
        g, u = cpu_tensor(T, D, dtype=dtype).requires_grad_(), cpu_tensor(T, D, dtype=dtype).requires_grad_()
        s = elementwise.swiglu(g, u)
        s.backward(torch.empty_like(s))
        emb = cpu_tensor(1000, D, dtype=dtype).requires_grad_()
        e = embed.embedding(emb, torch.zeros(T, dtype=torch.long))
        e.backward(torch.empty_like(e))
        n = 1000 * D
        p, gr, m, v = (cpu_tensor(n, dtype=F32) for _ in range(4))
        optim.adamw_(p, gr, m, v, cpu_tensor(8, dtype=F32), out=cpu_tensor(n, dtype=dtype))
        optim.sum_of_squares(cpu_tensor(n, dtype=dtype))
    return run


def cases(quick: bool) -> dict:
    out = {}
    attn = [(128, 32, 8, BF16, 16), (64, 16, 16, BF16, 16), (128, 16, 2, BF16, 32), (256, 8, 8, BF16, 16),
            (128, 32, 8, F32, 16), (16, 4, 1, F32, 16)]
    for D, H, HK, dt, page in attn[:2] if quick else attn:
        out[f"attention D{D} H{H}/{HK} {str(dt)[6:]} page{page}"] = _attention(D, H, HK, dt, page)
    for D in (2048,) if quick else (64, 1000, 2048, 4096, 7168):
        out[f"rmsnorm D{D} bf16"] = _norm(D, BF16)
    lin = [(7, 768, 2048), (300, 2048, 768), (4096, 151936, 2048), (5, 100, 72), (1, 4096, 4096)]
    for M, N, K in lin[:2] if quick else lin:
        out[f"linear {M}x{K}->{N} bf16"] = _linear(M, N, K, BF16)
    if not quick:
        out["linear 33x72->100 fp32"] = _linear(33, 100, 72, F32)
    for E, per, N, K in [(8, 16, 768, 2048)] if quick else [(8, 16, 768, 2048), (128, 3, 1536, 4096),
                                                            (4, 5, 96, 64)]:
        out[f"grouped {E}x{per} {K}->{N} bf16"] = _grouped(E, per, N, K, BF16)
    for V, dt in [(32000, BF16)] if quick else [(1000, BF16), (4097, BF16), (32000, F32), (151936, BF16),
                                                (262144, BF16)]:
        for op in ("draw", "draw_cut", "logprob", "top_p", "top_k_top_p"):
            out[f"{op} V{V} {str(dt)[6:]}"] = _sampler(V, dt, op)
    for D, H, HK, dt, page in [(128, 32, 8, BF16, 16)] if quick else [(128, 32, 8, BF16, 16),
                                                                       (64, 16, 16, BF16, 32), (128, 8, 1, F32, 16)]:
        out[f"split-KV decode D{D} H{H}/{HK} {str(dt)[6:]} page{page}"] = _decode_default(D, H, HK, dt, page)
    pieces = [(77, 64, 8, 2048, 32, 4, 128, BF16), (5, 8, 2, 1000, 16, 16, 64, BF16), (33, 128, 8, 4096, 64, 4, 128,
                                                                                         BF16)]
    for T, E, k, D, H, HK, HD, dt in pieces[:1] if quick else pieces:
        out[f"layer pieces T{T} E{E} top{k} D{D} heads {H}/{HK}x{HD} {str(dt)[6:]}"] = _layer_pieces(
            T, E, k, D, H, HK, HD, dt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cases (a check of the script)")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    results, failed, n_launch, t0 = {}, [], 0, time.time()
    for name, run in cases(a.quick).items():
        seen, row = set(), {}
        try:
            with captured() as got:
                run()
        except Exception as e:  # noqa: BLE001 - a host check reading an output nothing wrote: what ran is kept
            row["host_check"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        if not got:
            failed.append(f"{name} (nothing captured)")
        for launch in got:
            key = (launch.name, repr(sorted((k, v) for k, v in launch.args.items() if not torch.is_tensor(v))),
                   repr(sorted(launch.options.items())))
            if key in seen:  # the same kernel, constants and options: the same compile
                continue
            seen.add(key)
            label = f"{len(seen) - 1}:{launch.name}"
            try:
                launch.compile()
                row[label] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded: which launch fails, and how
                row[label] = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
                failed.append(f"{name} {label}")
        n_launch += sum(k != "host_check" for k in row)
        results[name] = row
        print(f"{name}: {row} ({time.time() - t0:.0f} s)", flush=True)
    shows = (f"{len(results)} cases, {n_launch} distinct launches compiled for sm_90 by Triton {triton.__version__}: "
             + (f"{len(failed)} failed ({'; '.join(failed)})" if failed else "all compiled"))
    record.write("compile_sweep_sm90" + ("_quick" if a.quick else ""), {
        "triton": triton.__version__, "target": "sm_90", "cases": results, "failed": failed,
        "what_it_shows": shows}, a.out)


if __name__ == "__main__":
    main()
