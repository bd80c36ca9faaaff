#!/usr/bin/env bash
# Session-2 last check (one H200): plain matmuls through the table-free path (SINGLE) with the pinned
# small-M tiles: speed, bitwise rows over M = 1..8192, grouped GEMM, the MoE steps, and agree.
set -u
export PYTHONUNBUFFERED=1
timeout 200 python3 experiments/bench_triton.py --only matmul_speed,matmul,grouped,moe,moe_large --name v10 \
  --out "$OUT" 2>&1 | grep -v -i warn
timeout 60 python3 -m rlalign.cli agree model=bench-moe device=cuda kernels.backend=triton trainer.ep_size=1 \
  generator.ep_size=1 agree.num_prompts=32 generator.max_new_tokens=32 2>/dev/null | tail -1
