#!/usr/bin/env bash
# Issue 12 on 2xH200, in two device calls (PART=A, PART=B); results land in $OUT.
#   A: GPU tests of the engine and the weight sync, then experiments/bench_generate.py
#      (bench-moe-large, 256 prompts x 256 new tokens: default / eager / CUDA-graph engine)
#   B: experiments/bench_weight_sync.py, then an RL step comparison (deterministic Triton vs default)
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${PART:-A}" = A ]; then
  [ "${SKIP_TESTS:-0}" = 1 ] || timeout "${T_TESTS:-170}" python3 -m pytest -q -x tests/gpu/test_engine_gpu.py \
    tests/gpu/test_weight_sync_gpu.py tests/gpu/test_moe_sync_free.py 2>&1 | grep -v -i warn | tail -25
  timeout "${T_GEN:-330}" python3 experiments/bench_generate.py --out "$OUT" 2>&1 | grep -v -i warn | tail -40
else
  timeout "${T_SYNC:-300}" python3 experiments/bench_weight_sync.py --old-reps 1 --reps 3 --budget-s 150 --out "$OUT" \
    2>&1 | grep -v -i warn | tail -30
  for mode in deterministic default; do
    rm -rf /tmp/rl_$mode
    timeout "${T_RL:-140}" python3 -m rlalign.cli train model=bench-moe device=cuda kernels.backend=triton \
      kernels.mode=$mode trainer.ep_size=2 generator.ep_size=1 placement.colocate=true run.steps=${RL_STEPS:-4} task.num_prompts=16 \
      task.samples_per_prompt=8 task.max_new_tokens=256 monitor.on_mismatch=warn run.dir=/tmp/rl_$mode 2>&1 \
      | grep -E "^step|Error|error" | tail -8
    python3 experiments/gpu_rl_summary.py /tmp/rl_$mode "rl_step_bench-moe_${mode}_2xh200" --out "$OUT" --warmup 1
  done
fi
