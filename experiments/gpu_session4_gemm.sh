#!/usr/bin/env bash
# Issue 12 (GEMM at decode shapes) on one H200, two device calls; results land in $OUT.
#   PART=sweep: experiments/gemm_decode_sweep.py (candidate tiles vs the pinned ones: bits + speed)
#   PART=final: experiments/gemm_decode_check.py (old gemm.py vs new: bits at every M, decode-step
#               GEMM time), bench_generate.py on the old tree and on the new one (CUDA graphs; tokens
#               and logprob bits compared), the GPU tests of the GEMMs, the MoE and the engine, then
#               experiments/profile_generate.py (256 x 64) on the new tree.
# The old tree: this checkout with kernels/triton/gemm.py replaced by experiments/gpu_session4/gemm_old.py.
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${PART:-final}" = sweep ]; then
  timeout "${T_SWEEP:-200}" python3 experiments/gemm_decode_sweep.py --out "$OUT" 2>&1 | grep -v -i warn | tail -80
  exit 0
fi
timeout "${T_CHECK:-150}" python3 experiments/gemm_decode_check.py experiments/gpu_session4/gemm_old.py --out "$OUT" \
  2>&1 | grep -v -i warn | tail -16
rm -rf /tmp/oldtree && mkdir -p /tmp/oldtree /tmp/oldres && cp -a . /tmp/oldtree/ \
  && cp experiments/gpu_session4/gemm_old.py /tmp/oldtree/kernels/triton/gemm.py
(cd /tmp/oldtree && PYTHONPATH=/tmp/oldtree:${PYTHONPATH:-} python3 -c \
  "import rlalign.kernels.triton.gemm as g; print('old tree gemm:', g.__file__, hasattr(g, '_grouped_config'))" \
  && PYTHONPATH=/tmp/oldtree:${PYTHONPATH:-} timeout "${T_GEN:-150}" python3 experiments/bench_generate.py \
  --modes graphs --out /tmp/oldres --dump /tmp/gen_old.pt 2>&1 | grep -v -i warn | grep -E "^graphs|FAILED|Error" )
cp /tmp/oldres/*.json "$OUT/generate_bench-moe-large_NVIDIA_H200_before_session4.json" 2>/dev/null
timeout "${T_GEN:-150}" python3 experiments/bench_generate.py --modes graphs --out "$OUT" --dump /tmp/gen_new.pt 2>&1 \
  | grep -v -i warn | grep -E "^graphs|FAILED|Error"
python3 - <<'EOF'
import torch
o, n = torch.load("/tmp/gen_old.pt"), torch.load("/tmp/gen_new.pt")
same = all(a[0] == b[0] and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
           for a, b in zip(o["graphs"], n["graphs"])) and len(o["graphs"]) == len(n["graphs"])
print("end-to-end old vs new (graphs): same tokens and logprob bits:", same)
EOF
timeout "${T_TESTS:-170}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_gpu.py \
  tests/gpu/test_engine_gpu.py tests/gpu/test_moe_sync_free.py 2>&1 | grep -v -i warn | tail -8
timeout "${T_PROF:-100}" python3 experiments/profile_generate.py --out "$OUT" --new 64 --top 14 2>&1 \
  | grep -v -i warn | grep -E "^==|_gemm|_attn|wrote" | head -12
