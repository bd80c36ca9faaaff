#!/usr/bin/env bash
# Issue 12, third GPU session, two device calls; results land in $OUT.
#   PART=A (one H200): GPU tests of the engine (graphs now include sampling), the fused sampler and
#     the sync-free MoE; bench_generate.py (bench-moe-large, 256 x 256: default / eager / graphs);
#     `rlalign agree` at those settings; a kernel-time profile of a 256 x 64 rollout.
#   PART=B (2xH200): weight sync of bench-moe-large (device path), then the RL step pair on bench-moe.
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${PART:-A}" = A ]; then
  timeout "${T_TESTS:-200}" python3 -m pytest -q -x tests/gpu/test_engine_gpu.py tests/gpu/test_sampling_gpu.py \
    tests/gpu/test_moe_sync_free.py 2>&1 | grep -v -i warn | tail -15
  timeout "${T_GEN:-240}" python3 experiments/bench_generate.py --out "$OUT" 2>&1 | grep -v -i warn | tail -12
  cmd="rlalign agree model=bench-moe-large device=cuda kernels.backend=triton agree.num_prompts=256 generator.max_new_tokens=256 trainer.ep_size=1"
  timeout "${T_AGREE:-200}" python3 -m rlalign.cli agree model=bench-moe-large device=cuda kernels.backend=triton \
    agree.num_prompts=256 generator.max_new_tokens=256 trainer.ep_size=1 2>/dev/null | tail -1 \
    | python3 experiments/_env.py agree_bench-moe-large_256x256_h200 --out "$OUT" --command "$cmd"
  cat "$OUT"/agree_bench-moe-large_256x256_h200.json 2>/dev/null | head -c 600; echo
  [ "${PROFILE:-1}" = 1 ] && timeout "${T_PROF:-150}" python3 experiments/profile_generate.py --out "$OUT" --new 64 \
    --top 12 2>&1 | grep -v -i warn | tail -32
else
  timeout "${T_SYNC:-240}" python3 experiments/bench_weight_sync.py --models bench-moe-large --old-reps 0 --reps 3 \
    --budget-s 200 --out "$OUT" 2>&1 | grep -v -i warn | tail -20
  for mode in deterministic default; do
    rm -rf /tmp/rl_$mode
    timeout "${T_RL:-150}" python3 -m rlalign.cli train model=bench-moe device=cuda kernels.backend=triton \
      kernels.mode=$mode trainer.ep_size=2 generator.ep_size=1 placement.colocate=true run.steps=${RL_STEPS:-3} \
      task.num_prompts=16 task.samples_per_prompt=8 task.max_new_tokens=256 monitor.on_mismatch=warn \
      run.dir=/tmp/rl_$mode 2>&1 | grep -E "^step|Error|error" | tail -6
    python3 experiments/gpu_rl_summary.py /tmp/rl_$mode "rl_step_bench-moe_${mode}_2xh200" --out "$OUT" --warmup 1
  done
fi
