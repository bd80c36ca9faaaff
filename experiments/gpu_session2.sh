#!/usr/bin/env bash
# Session-2 GPU run (one H200): Triton sweeps (small-M matmul, attention tiles), bitwise checks,
# speed against cuBLAS / SDPA / torch._grouped_mm, the two benchmark MoE steps, and a profile.
# Run from the repo root after `source .gpu/activate`; results land in $OUT.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
timeout 420 python3 experiments/bench_triton.py --only "${STEPS:-matmul_sweep,matmul,matmul_speed,grouped,attention_sweep,attention,attention_speed,attention_bwd,rows,moe,moe_large}" \
  --name "${NAME:-v6}" --out "$OUT" 2>&1 | grep -v Warning
timeout 120 python3 experiments/profile_moe.py --out "$OUT" --top 25 2>&1 | grep -v Warning
