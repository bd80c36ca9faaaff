#!/usr/bin/env bash
# Issue 12: decode graphs kept across generate() calls + the one-launch MoE dispatch, in one device call:
#   1. tests/gpu/test_engine_gpu.py (graphs == eager bits, kept graphs replayed across calls and seeds, after an
#      in-place weight update they sample the new weights, a rebound parameter drops them (twin: stale graphs
#      differ), Triton dispatch == torch dispatch, engine bits independent of the dispatch kernel)
#   2. (T_DISP=seconds) experiments/bench_dispatch.py: the dispatch alone, inside CUDA graphs
#   3. experiments/bench_generate.py, bench-moe-large 256 x 256, same run: graphs+tdisp+nola (the engine before:
#      graphs captured in every call, torch dispatch, no lookahead), kept+tdisp+nola (+ graphs kept), kept+nola
#      (+ Triton dispatch), kept (+ lookahead); 2 timed calls each (seeds 7, 8), every call's tokens and logprob
#      bits compared across modes.
# Run: source .gpu/activate && RLALIGN_GIT_COMMIT=<sha> OUT=$OUT bash experiments/gpu_graph_cache.sh
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
t0=$(date +%s)
[ -f .gpu_graph_cache/attention.py ] && cp .gpu_graph_cache/attention.py kernels/triton/attention.py \
  && echo "kernels/triton/attention.py <- the committed one (.gpu_graph_cache/attention.py)"
# the dispatch kernel first: if it does not compile or differs, the rest runs on the torch dispatch
pre=$(timeout "${T_PRE:-30}" python3 -c "
import torch
from rlalign.kernels.triton.dispatch import moe_dispatch
from rlalign.model.model import dispatch_torch
f = torch.randint(0, 64, (2048,), device='cuda')
assert all(torch.equal(a, b) for a, b in zip(dispatch_torch(f, 64), moe_dispatch(f, 64)))
print('dispatch pre-check ok')" 2>&1); rc=$?
echo "$pre" | grep -v -i warn | tail -5
if [ $rc -ne 0 ]; then
  echo "== Triton dispatch FAILED: RLALIGN_TRITON_DISPATCH=0 from here"
  export RLALIGN_TRITON_DISPATCH=0
fi
timeout "${T_TEST:-100}" python3 -m pytest tests/gpu/test_engine_gpu.py -q -p no:cacheprovider -W ignore 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -30
echo "== tests done at $(( $(date +%s) - t0 )) s"
if [ "${T_DISP:-0}" -gt 0 ]; then
  timeout "$T_DISP" python3 experiments/bench_dispatch.py --out "$OUT" 2>&1 | grep -v -i warn
  echo "== dispatch bench done at $(( $(date +%s) - t0 )) s"
fi
timeout "${T_GEN:-100}" python3 experiments/bench_generate.py --modes "${MODES:-graphs+tdisp+nola,kept+tdisp+nola,kept+nola,kept}" \
  --calls 2 --no-score --tag graph_cache --out "$OUT" 2>&1 | grep -v -i warn | grep -v '^ '
echo "== all done at $(( $(date +%s) - t0 )) s"
