#!/usr/bin/env bash
# A tree's checks on one CUDA GPU, in one device call (../shared/GPU.md; run after `source .gpu/activate`):
# tests/gpu, then `rlalign agree` (bench-moe, Triton kernels: 0 mismatched expected) and a 3-step
# colocated `rlalign train` on the GPU (0 mismatched every step). Each step under its own timeout;
# logs under $OUT; a table of verdicts last.
set -uo pipefail
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
declare -A rc

timeout 330 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1
rc[tests/gpu]=$?
tail -n 25 "$out/gpu_tests.log"

timeout 120 python3 -m rlalign.cli agree model=bench-moe device=cuda kernels.backend=triton agree.num_prompts=64 \
  generator.max_new_tokens=64 trainer.ep_size=1 > "$out/agree.log" 2>&1
rc[agree]=$?
tail -n 1 "$out/agree.log"

timeout 150 python3 -m rlalign.cli train device=cuda kernels.backend=triton trainer.ep_size=1 generator.ep_size=1 \
  placement.colocate=true run.steps=3 run.dir="$out/train_run" checkpoint.enabled=false > "$out/train.log" 2>&1
rc[train]=$?
tail -n 1 "$out/train.log"
grep -h -o '"consistency/mismatched_tokens": [0-9]*' "$out/train_run/metrics.jsonl" 2>/dev/null

printf '\n%-10s %s\n' check exit
for k in tests/gpu agree train; do printf '%-10s %s\n' "$k" "${rc[$k]}"; done
