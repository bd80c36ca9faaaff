#!/usr/bin/env bash
# One GPU session on the 2xH200 machine (run from the repo root after `source .gpu/activate`):
# Triton attention sweep + MoE step benchmark, `rlalign agree` on GPU with the Triton backend
# (tiny and bench-moe, trainer EP 2 vs generator EP 1), and `rlalign train` on Ray (bench-moe,
# trainer EP 2, generator EP 1 colocated, 20 steps). Results land in $OUT.
set -u
export PYTHONUNBUFFERED=1
timeout 200 python3 experiments/bench_triton.py --only attention_sweep,attention_speed,moe --name v2 --out "$OUT" \
  2>&1 | grep -v Warning
for m in tiny-moe bench-moe; do
  timeout 120 python3 -m rlalign.cli agree model=$m device=cuda kernels.backend=triton trainer.ep_size=2 \
    generator.ep_size=1 agree.num_prompts=32 generator.max_new_tokens=32 2>/dev/null | tail -1 | tee "$OUT/agree_$m.json"
done
timeout 330 python3 -m rlalign.cli train model=bench-moe device=cuda kernels.backend=triton trainer.ep_size=2 \
  generator.ep_size=1 placement.colocate=true run.steps=20 run.dir=/tmp/rl 2>&1 | grep -E "^step|Error|error" | tail -25
python3 experiments/gpu_rl_summary.py /tmp/rl rl_train_bench_moe_2xh200 --out "$OUT"
