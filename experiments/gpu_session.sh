#!/usr/bin/env bash
# The GPU session: every GPU result of experiments/README.md, keyed by the code it measured.
# Run from the repo root (on the GPU machine after `source .gpu/activate`), ideally on a clean
# checkout; each result lands in $OUT (default experiments/results) as <benchmark>_<git describe>.json,
# where <git describe> is `git describe --always --dirty` (a "-dirty" suffix: uncommitted code).
# On 2 GPUs the agree runs use trainer EP 2 vs generator EP 1 (NCCL) and the Ray training run runs;
# on one GPU agree runs at EP 1/1 and the training run is skipped.
#   STEPS=a,b,...   bench_triton.py steps (default: all of them, sweeps included)
#   SKIP_TRAIN=1    skip the 20-step `rlalign train` on Ray
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-experiments/results}
DESC=$(git describe --always --dirty 2>/dev/null || echo unknown)
NGPU=$(nvidia-smi -L | wc -l)
EP=$(( NGPU >= 2 ? 2 : 1 ))
mkdir -p "$OUT"
echo "git describe: $DESC, $NGPU GPU(s), results in $OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader

# Triton: bitwise checks, accuracy vs fp64, speed vs cuBLAS / SDPA / torch._grouped_mm, the MoE steps
timeout 540 python3 experiments/bench_triton.py ${STEPS:+--only "$STEPS"} --name "$DESC" --out "$OUT" \
  2>&1 | grep -v -i warn
# where a benchmark MoE step spends its device and host time
for m in bench-moe bench-moe-large; do
  timeout 150 python3 experiments/profile_moe.py --model "$m" --top 10 --name "$DESC" --out "$OUT" 2>&1 | grep -v -i warn
done
# trainer vs generator logprobs, Triton backend
for m in tiny-moe bench-moe; do
  cmd="python3 -m rlalign.cli agree model=$m device=cuda kernels.backend=triton trainer.ep_size=$EP generator.ep_size=1 agree.num_prompts=32 generator.max_new_tokens=32"
  timeout 120 $cmd 2>/dev/null | tail -1 | python3 experiments/_env.py "agree_triton_${m}_${DESC}" --out "$OUT" --command "$cmd"
done
timeout 150 python3 -m pytest tests/gpu tests/test_triton.py -q 2>&1 | tail -4
timeout 60 python3 experiments/probe_launch_overhead.py 2>&1 | grep -v -i warn
if [ "${SKIP_TRAIN:-0}" != 1 ] && [ "$EP" = 2 ]; then
  rm -rf /tmp/rlalign_session_rl
  timeout 330 python3 -m rlalign.cli train model=bench-moe device=cuda kernels.backend=triton trainer.ep_size=2 \
    generator.ep_size=1 placement.colocate=true run.steps=20 run.dir=/tmp/rlalign_session_rl 2>&1 \
    | grep -E "^step|Error|error" | tail -25
  python3 experiments/gpu_rl_summary.py /tmp/rlalign_session_rl "rl_train_bench_moe_2xh200_${DESC}" --out "$OUT"
fi
