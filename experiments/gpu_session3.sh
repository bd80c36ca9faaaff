#!/usr/bin/env bash
# Session-2 final GPU run (2xH200): the Triton benchmark with the pinned configs (sweep for small M
# only), `rlalign agree` with the Triton backend (tiny and bench-moe, trainer EP 2 vs generator EP 1
# over NCCL), tests/gpu, and the host launch-overhead probe. Results land in $OUT.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
timeout 270 python3 experiments/bench_triton.py --only matmul_speed,matmul_sweep,matmul,grouped,attention,attention_speed,attention_bwd,rows,moe,moe_large \
  --name v9 --out "$OUT" 2>&1 | grep -v -i warn
for m in tiny-moe bench-moe; do
  timeout 75 python3 -m rlalign.cli agree model=$m device=cuda kernels.backend=triton trainer.ep_size=2 \
    generator.ep_size=1 agree.num_prompts=32 generator.max_new_tokens=32 2>/dev/null | tail -1 | tee "$OUT/agree_triton_${m}_2xh200_v9.json"
done
timeout 110 python3 -m pytest tests/gpu tests/test_triton.py -q 2>&1 | tail -4
timeout 40 python3 experiments/probe_launch_overhead.py 2>&1 | grep -v -i warn
