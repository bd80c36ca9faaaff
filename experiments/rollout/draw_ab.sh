#!/usr/bin/env bash
# One device call (after `source .gpu/activate`): where the real-vocabulary top-p rollout's step time goes with the
# product's full draw and with the pruned draw (experiments/kernels/draw_pruned.py) in its place, then the draw alone
# (probe_draw_prune.py: 512 lanes with and without the prefetch, 1,024 with it). The variant goes in as
# kernels/triton/sampling.py on this copy of the tree only (its imports of the product's noise point at the
# product's file kept beside it) and the product's file comes back before the last probe. Results under $OUT.
set -uo pipefail
out=${OUT:-/tmp/draw_ab}
mkdir -p "$out"
probe() {
  timeout 200 python3 experiments/rollout/probe_rollout_steps.py --model qwen3-30b-a3b-rehearsal --cases 1024x256 \
    --top-p 0.95 --temperature 0.8 --out "$out" --name "$1" 2>&1 | grep -v Warning | tail -n 40
}
probe probe_rollout_steps_topp_full_h100
cp kernels/triton/sampling.py kernels/triton/sampling_full.py
sed 's/^from \.sampling import/from .sampling_full import/' experiments/kernels/draw_pruned.py > kernels/triton/sampling.py
grep -n "^from .sampling_full import\|^DRAW_PREFETCH" kernels/triton/sampling.py
probe probe_rollout_steps_topp_pruned_h100
cp kernels/triton/sampling_full.py kernels/triton/sampling.py && rm kernels/triton/sampling_full.py
timeout 150 python3 experiments/kernels/probe_draw_prune.py --out "$out" 2>&1 | grep -v Warning | tail -n 20
