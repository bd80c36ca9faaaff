#!/usr/bin/env bash
# Issue 12, session 5: the fused decode launches on one H200 — bits of each against what it replaces
# (check_fused_decode.py), the engine at 256 x 256 before (OLD: a tar of the previous commit's tree)
# and after in one run (same tokens and logprob bits; the new one rescored by the trainer: 0
# mismatched), the decode step's kernel breakdown, and the GPU engine tests.
#   OLD=.gpu/old.tar bash experiments/gpu_session5_fused.sh $OUT
set -euo pipefail
OUT=${1:-experiments/results}
mkdir -p "$OUT"
python3 experiments/check_fused_decode.py --out "$OUT"
python3 -m pytest -q tests/gpu/test_engine_gpu.py tests/test_triton_fused.py 2>&1 | tail -4 || true
python3 experiments/bench_generate.py --modes kept --calls 2 --tag s5_new --dump /tmp/new.pt --out "$OUT"
if [ -n "${OLD:-}" ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf "$OLD" -C /tmp/old
  # its own rlalign first on the path (activate put this checkout's on PYTHONPATH)
  (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old python3 experiments/bench_generate.py --modes kept --calls 2 --no-score --tag s5_old \
     --dump /tmp/old.pt --out "$OUT/old")
  python3 - <<'PY'
import torch
new, old = torch.load("/tmp/new.pt"), torch.load("/tmp/old.pt")
same = all(a[0] == b[0] and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
           for ca, cb in zip(new["kept"], old["kept"], strict=True) for a, b in zip(ca, cb, strict=True))
print("old vs new engine: same tokens and logprob bits in every call:", same)
PY
fi
python3 experiments/probe_decode_step.py --new 64 --tag s5_fused --out "$OUT"
