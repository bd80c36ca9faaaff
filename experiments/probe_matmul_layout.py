"""Probe: Triton matmul time with an N-contiguous vs a K-contiguous B operand, against cuBLAS
(same bits either way). Run on a GPU: python experiments/probe_matmul_layout.py

It once found a 14-18x gap (experiments/README.md, History). The cause turned out to be the
where()-clamped tile indices hiding the contiguity of B's N dim; the kernel now reads either
layout in place with contiguity hints, so both columns should be close to cuBLAS."""

import torch
import triton.testing as tt

from rlalign.kernels import triton as tb


def median_ms(fn) -> float:
    return tt.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main() -> None:
    torch.manual_seed(0)
    for M, N, K in [(512, 1024, 1024), (4096, 1024, 8192), (1024, 1024, 512)]:
        a = torch.randn(M, K, device="cuda").bfloat16()
        b_nn = torch.randn(K, N, device="cuda").bfloat16()  # N-contiguous B (the backward GEMMs' layout)
        b_nt = b_nn.t().contiguous().t()  # K-contiguous B (the forward layout)
        times = {"NN": median_ms(lambda a=a, b=b_nn: tb.matmul(a, b)),
                 "NT": median_ms(lambda a=a, b=b_nt: tb.matmul(a, b)),
                 "cublas": median_ms(lambda a=a, b=b_nn: a @ b)}
        same = torch.equal(tb.matmul(a, b_nn), tb.matmul(a, b_nt))
        print(M, N, K, {k: round(v, 4) for k, v in times.items()}, "same bits NN/NT:", same)


if __name__ == "__main__":
    main()
