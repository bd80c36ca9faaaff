"""Probe: host time per call of the Triton ops against torch's (small shapes, so the host is the
bottleneck), synchronising only at the end. Run on a GPU: python experiments/probe_launch_overhead.py"""

import time

import torch

from rlalign.kernels import triton as tb


def per_call_us(fn, n: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / n


def main() -> None:
    a = torch.randn(64, 1024, device="cuda").bfloat16()
    w = torch.randn(1024, 1024, device="cuda").bfloat16()
    x = torch.randn(64, 8, 128, device="cuda").bfloat16()
    rows = {
        "matmul 64x1024x1024": (lambda: tb.matmul(a, w.t()), lambda: a @ w.t()),
        "rmsnorm 64x1024": (lambda: tb.rmsnorm(a, w[0], 1e-6), lambda: torch.rms_norm(a, (1024,), w[0], 1e-6)),
        "attention prefill 64 tok": (lambda: tb.attention_prefill(x, x, x, [0, 64], 0.1),
                                     lambda: torch.nn.functional.scaled_dot_product_attention(
                                         x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), is_causal=True)),
    }
    for name, (tri, ref) in rows.items():
        print(f"{name:28} host us/call: triton {per_call_us(tri):7.1f}   torch {per_call_us(ref):7.1f}")


if __name__ == "__main__":
    main()
