#!/usr/bin/env bash
# Issue 12/13, session 5, the final check of main on one H200 (results in $OUT), most needed first:
#   the kept-graph engine at 256 x 256 rescored by the trainer; the issue's `rlalign agree` at 256 x 256;
#   the same engine on the tree of 3e28051 (OLD tar, session start: same tokens and logprob bits?);
#   GPU tests of the engine, the fused launches, linears and the paged kernel; the default kernels in
#   the same engine (one call, for the ratio); the decode step's kernel breakdown.
#   OLD=.gpu/old.tar bash experiments/gpu_session5_final.sh $OUT
set -u
export PYTHONUNBUFFERED=1
OUT=${1:-experiments/results}
mkdir -p "$OUT"
timeout "${T_GEN:-110}" python3 experiments/bench_generate.py --modes kept --calls 2 --tag s5_final \
  --dump /tmp/new.pt --out "$OUT" 2>&1 | grep -E "^kept|wrote"
cmd="rlalign agree model=bench-moe-large device=cuda kernels.backend=triton agree.num_prompts=256 generator.max_new_tokens=256 trainer.ep_size=1"
timeout "${T_AGREE:-120}" python3 -m rlalign.cli agree model=bench-moe-large device=cuda kernels.backend=triton \
  agree.num_prompts=256 generator.max_new_tokens=256 trainer.ep_size=1 2>/tmp/agree.err | tail -1 \
  | python3 experiments/_env.py agree_bench-moe-large_256x256_h200_s5 --out "$OUT" --command "$cmd" && \
  grep -o '"mismatched_tokens": [0-9]*\|"tokens": [0-9]*' "$OUT/agree_bench-moe-large_256x256_h200_s5.json" \
  || tail -5 /tmp/agree.err
if [ -n "${OLD:-}" ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf "$OLD" -C /tmp/old
  # its own rlalign first on the path (activate put this checkout's on PYTHONPATH)
  (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old timeout "${T_OLD:-80}" python3 experiments/bench_generate.py \
     --modes kept --calls 2 --no-score --tag s5_old --dump /tmp/old.pt --out "$OUT/old" 2>&1 | grep -E "^kept")
  python3 - <<'PY'
import torch
new, old = torch.load("/tmp/new.pt"), torch.load("/tmp/old.pt")
same = all(a[0] == b[0] and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
           for ca, cb in zip(new["kept"], old["kept"], strict=True) for a, b in zip(ca, cb, strict=True))
print("engine now vs the session's start: same tokens and logprob bits in every call:", same)
PY
fi
timeout "${T_TESTS:-130}" python3 -m pytest -q tests/gpu/test_engine_gpu.py tests/test_triton_fused.py \
  tests/gpu/test_linears_gpu.py 2>&1 | grep -v -i warn | tail -4
timeout "${T_DEF:-90}" python3 experiments/bench_generate.py --modes default --calls 1 --tag s5_final_default \
  --out "$OUT" 2>&1 | grep -E "^default|wrote"
timeout "${T_PROBE:-60}" python3 experiments/probe_decode_step.py --new 64 --tag s5_final --out "$OUT" > /tmp/probe.log 2>&1
grep -v -i warn /tmp/probe.log | head -24
