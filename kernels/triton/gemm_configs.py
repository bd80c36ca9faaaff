"""The GEMM kernel's pinned configs (kernels/triton/gemm.py), per dtype and M bucket. Scheduling only: every
config of a family reduces K through the same chain, so the bits are the main config's whatever the bucket.
The measurements that chose them (H200): experiments/README.md, History, "GEMM configs"."""

import torch

# The contract: one config per dtype (and one for the interpreter), never autotuned.
MATMUL_CONFIGS = {
    torch.bfloat16: dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_stages=3, num_warps=8, TMA=True),
    torch.float16: dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_stages=3, num_warps=8, TMA=True),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_stages=3, num_warps=4),
}
INTERPRET_MATMUL = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=4)
# Small M (decode, small batches: M <= 256 rows), for linear and linears alike: tiles 64 rows high, the
# narrowest of 16 / 32 / 64 / 128 columns whose tiles fit in one wave (<= one per SM); where none fits,
# the main config once its own tiles fill a wave, else 128 columns. No split-K: more, narrower tiles keep
# the SMs busy. FLATTEN (the next tile's loads under the current one): the 64-column member always, the
# 128-column one only where a program runs several tiles. A config may join only if every element still
# reduces K in the main config's order through the same chain of k16 MMAs into one fp32 accumulator
# (BLOCK_K 64, 128 or 256 cut that chain at other points, never reorder it), and its rows are bitwise equal
# to the main config's on the GPU (tests/gpu/test_triton_gpu.py: M = 1..299). At M <= 32 the rows past M
# are masked (MASK_M) instead of read from row 0: every program reading the same row is an L2 hot spot.
# Past 256 rows: the main config, except where its tiles would not fill half the SMs (a narrow weight's
# gradient; in decode the router [64, 2048] at 2,048 rows, 16 tiles): the 128-column member.
_SMALL_M = [dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=256, GROUP_M=8, num_stages=4, num_warps=4),
            dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_stages=6, num_warps=4),
            dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_stages=4, num_warps=4, FLATTEN=True),
            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_stages=4, num_warps=4, TMA=True)]
MATMUL_SMALL_M: dict = {torch.bfloat16: (256, 32, _SMALL_M), torch.float16: (256, 32, _SMALL_M)}
# Past 256 rows where the main tiles fill less than half a wave: the main tiles half as wide (one warpgroup,
# 4 stages) before the widest small-M member (64 x 128). On one H100 (sweep_gemm_tiles_h100.json) these ran
# 2,048 x 768 x 2,048 in 17.2 us (64 x 128: 19.4), 1,024 x 2,048 x 4,096 in 29.8 (35.6), 4,096 x 512 x 2,048
# in 17.2 (21.2); bits equal to the main config's in every case.
_HALF_MAIN = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_stages=4, num_warps=4, TMA=True)
MATMUL_PAST_SMALL_M: dict = {torch.bfloat16: (_HALF_MAIN,), torch.float16: (_HALF_MAIN,)}
# the interpreter's small-M bucket (shorter tiles, rows past M masked; BLOCK_K 16 as the main one: the
# interpreter rounds once per K chunk), so CPU tests cross a bucket boundary with the same bits
INTERPRET_SMALL_M = (8, dict(INTERPRET_MATMUL, BLOCK_M=16, MASK_M=True))
# The grouped (expert) GEMM forward / dX, keyed by rows per group (the host's guess R / groups in COUNTS mode):
# [(max rows, config)]; past the last, the main config. Decode at 256 rows puts ~32 rows on each of 64 experts, at
# 1,024 / 2,048 rows ~128 / 256 (bench-moe-large's gate_up [1536, 2048] and down [2048, 768]); past the table
# (prefill, training: one config there, so new token counts compile nothing), the main config. Up to 32 rows
# (decode up to 256 tokens) 64 x 128 tiles with two programs per SM (PER_SM: one program's tile changes under the
# other's loads). Up to 512 rows per expert (1,024-4,096 tokens: an expert's last tile often holds a few rows): the
# main tiles with a fourth stage, an expert's last tile of at most 64 rows run 64 rows high (HALF_TAIL: half the
# MMAs) and a program per tile (the hardware hands out tiles of two sizes). Bits equal to the main config's.
TILE_PER_PROGRAM = 1024  # PER_SM this high: the grid is the host's bound on the tiles, a program per tile
_GROUPED_SMALL = [(32, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_stages=4, num_warps=4, PER_SM=2,
                            TMA=True)),
                  (512, dict(MATMUL_CONFIGS[torch.bfloat16], num_stages=4, HALF_TAIL=True, PER_SM=TILE_PER_PROGRAM,
                             TMA=False))]
GROUPED_SMALL_M: dict = {torch.bfloat16: _GROUPED_SMALL, torch.float16: _GROUPED_SMALL}
# Short K (at most 768: <= 12 K chunks a tile, the experts' down [768 -> 2048]) past 128 rows per group, weights
# read K-contiguous (dX's N-contiguous weights ran flattened at half speed): the main tiles with the tile loop
# flattened (the next tile's loads under this one's epilogue). (max K, past rows per group, config)
_SHORT_K = (768, 128, dict(MATMUL_CONFIGS[torch.bfloat16], FLATTEN=True))  # TMA: the main config's
GROUPED_SHORT_K: dict = {torch.bfloat16: _SHORT_K, torch.float16: _SHORT_K}
# The grouped weight gradient (dW[e] = g_e^T x_e, K = the expert's rows): the main tiles with 4 stages and
# the tile loop flattened (the next tile's loads under this one's epilogue: ~20 K steps a tile at a training
# micro-batch's ~1,250 rows per expert). The forward and dX keep the main config (flattened: half its speed).
_WGRAD = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_stages=4, num_warps=8, FLATTEN=True)
GROUPED_WGRAD: dict = {torch.bfloat16: _WGRAD, torch.float16: _WGRAD}

# TMA (a config's key): A's and B's chunks reach shared memory through tensor descriptors (the copy engine) instead
# of pointer loads, where both operands allow it (K-contiguous, rows of a 16-byte multiple, offsets whole rows: the
# forward GEMMs, and the one-launch linears where their weights tile one address range; a weight gradient, dX,
# linears of weights apart, gathered rows and SWIGLU's [gate | up] columns keep pointers): the same K chunks into
# the same tl.dot, bits equal (tests/gpu/test_triton_gpu.py, test_linears_gpu.py). Decided per config, never by
# the batch (a new token count compiles nothing). A program makes its descriptors once, about a microsecond:
# where a program runs one tile each (the grouped bucket of <= 512 rows) the config keeps pointers.
