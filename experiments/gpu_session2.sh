#!/usr/bin/env bash
# Session-2 GPU run (one H200): Triton sweeps (small-M matmul, attention tiles fwd and bwd), bitwise
# checks, speed against cuBLAS / SDPA / torch._grouped_mm, the two benchmark MoE steps, profiles.
# Run from the repo root after `source .gpu/activate`; results land in $OUT.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv
timeout 420 python3 experiments/bench_triton.py --only "${STEPS:-matmul_speed,matmul_sweep,matmul,grouped,attention_sweep,attention_bwd_sweep,attention,attention_speed,attention_bwd,rows,moe,moe_large}" \
  --name "${NAME:-v8}" --out "$OUT" 2>&1 | grep -v Warning
for m in ${PROFILE:-bench-moe bench-moe-large}; do
  timeout 100 python3 experiments/profile_moe.py --model "$m" --out "$OUT" --top 10 2>&1 | grep -v Warning
done
