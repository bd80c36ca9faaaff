"""Probe: Triton matmul time with an N-contiguous vs a K-contiguous B operand, against cuBLAS."""
import torch, triton.testing as tt
from kernels import triton_backend as tb
torch.manual_seed(0)
for (M, N, K) in [(512, 1024, 1024), (4096, 1024, 8192), (1024, 1024, 512)]:
    a = torch.randn(M, K, device="cuda").bfloat16()
    bnn = torch.randn(K, N, device="cuda").bfloat16()          # N-contiguous B (backward layout)
    bnt = bnn.t().contiguous().t()                              # K-contiguous B (forward layout)
    f = lambda fn: tt.do_bench(fn, warmup=10, rep=50, return_mode="median")
    r = {"NN": f(lambda: tb.matmul(a, bnn)), "NT": f(lambda: tb.matmul(a, bnt)), "cublas": f(lambda: a @ bnn)}
    same = torch.equal(tb.matmul(a, bnn), tb.matmul(a, bnt))
    print(M, N, K, {k: round(v, 4) for k, v in r.items()}, "same bits NN/NT:", same)
