#!/usr/bin/env bash
# One GPU call for issue 12 Builds 1 and 4: the MoE/no-sync and launch tests on CUDA, then
# experiments/bench_launch.py (table last). Run from the repo root after `source .gpu/activate`.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-experiments/results}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/gpu/test_moe_sync_free.py tests/test_moe_counts.py \
  tests/test_launch.py tests/gpu/test_triton_gpu.py tests/test_triton.py 2>&1 | tail -25
timeout ${BENCH_S:-170} python3 experiments/bench_launch.py --out "$OUT" --rounds ${ROUNDS:-7} 2>&1 | grep -v -i warn
