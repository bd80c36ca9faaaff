#!/usr/bin/env bash
# Issue 12, session 4, third call: end-to-end tok/s old tree vs new tree in one run, each run warmed on
# the full batch first (bench_generate.py's warm-up), graphs mode, no rescoring (the bits were checked
# in the call before: experiments/gpu_session4_gemm.sh). Old tree: gemm.py from experiments/gpu_session4/gemm_old.py.
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-experiments/results}
mkdir -p "$OUT" /tmp/oldres /tmp/oldtree && cp -a . /tmp/oldtree/ \
  && cp experiments/gpu_session4/gemm_old.py /tmp/oldtree/kernels/triton/gemm.py
for tree in old new; do
  if [ $tree = old ]; then dir=/tmp/oldtree; res=/tmp/oldres; else dir=$PWD; res=$OUT; fi
  (cd $dir && PYTHONPATH=$dir:${PYTHONPATH:-} timeout "${T_GEN:-75}" python3 experiments/bench_generate.py \
    --modes graphs --no-score --out $res 2>&1 | grep -v -i warn | grep -E "^graphs|FAILED|Error" | sed "s/^/$tree /")
done
cp /tmp/oldres/*.json "$OUT/generate_bench-moe-large_NVIDIA_H200_before_session4_e2e.json" 2>/dev/null
