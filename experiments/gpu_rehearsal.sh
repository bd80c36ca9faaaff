#!/usr/bin/env bash
# The scale proof as one script whose numbers scale: `rlalign agree` (trainer EP $TEP vs each
# generator EP in $GEPS, deterministic Triton kernels; default kernels as the twin) and a 5-step
# `rlalign train` (trainer EP $TEP with dense sharding, each generator EP in $GEP_TRAIN colocated), summarised
# into results JSON (mismatches, median phase breakdown, peak GPU memory per role).
#   2xH200 rehearsal (default):  bash experiments/gpu_rehearsal.sh
#   8xH200 (when lent):          MODEL=qwen3-30b-a3b-shape TEP=8 GEPS="4 8" TAG=8xh200 bash experiments/gpu_rehearsal.sh
#   AGREE=0 skips the agree runs.
#   CPU (tiny, the same path):   MODEL=tiny-moe DEVICE=cpu BACKEND=torch PROMPTS=4 NEW=8 TRAIN_PROMPTS=2 \
#                                TAG=cpu bash experiments/gpu_rehearsal.sh
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
MODEL=${MODEL:-qwen3-30b-a3b-rehearsal}; TEP=${TEP:-2}; GEPS=${GEPS:-"1 2"}; GEP_TRAIN=${GEP_TRAIN:-1}
DEVICE=${DEVICE:-cuda}; BACKEND=${BACKEND:-triton}; TAG=${TAG:-2xh200}
PROMPTS=${PROMPTS:-64}; NEW=${NEW:-256}          # agree: >= 16k generated tokens at the defaults
TRAIN_PROMPTS=${TRAIN_PROMPTS:-16}; SPP=${SPP:-8}; STEPS=${STEPS:-5}
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common="model=$MODEL device=$DEVICE kernels.backend=$BACKEND trainer.ep_size=$TEP"
agree() {  # $1 name, rest: overrides
  local name=$1; shift
  local cmd="rlalign agree $common agree.num_prompts=$PROMPTS agree.max_new_tokens=$NEW $*"
  echo "== $cmd"
  timeout "${T_AGREE:-300}" python3 -m rlalign.cli agree $common agree.num_prompts=$PROMPTS \
    agree.max_new_tokens=$NEW "$@" 2>/tmp/agree_$name.err | tail -1 \
    | python3 experiments/record.py "$name" --out "$OUT" --command "$cmd" || tail -5 /tmp/agree_$name.err
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["result"]
except (OSError, ValueError, KeyError):
    sys.exit(0)
keys = ("tokens", "mismatched_tokens", "max_abs_diff", "kernels", "trainer_ep", "generator_ep", "generate_s", "score_s")
print({k: r.get(k) for k in keys})
PY
}
if [ "${AGREE:-1}" = 1 ]; then
  for g in $GEPS; do
    agree "agree_${MODEL}_tep${TEP}_gep${g}_${TAG}" generator.ep_size=$g
  done
  set -- $GEPS
  agree "agree_${MODEL}_tep${TEP}_gep$1_${TAG}_default" generator.ep_size=$1 kernels.mode=default
fi

for gep in $GEP_TRAIN; do  # one train run per generator EP size listed
  run=/tmp/rehearsal_train_gep$gep
  rm -rf $run
  cmd="rlalign train $common generator.ep_size=$gep placement.colocate=true trainer.shard_dense=true \
run.steps=$STEPS task.num_prompts=$TRAIN_PROMPTS task.samples_per_prompt=$SPP task.max_new_tokens=$NEW \
checkpoint.every=0 monitor.on_mismatch=warn run.dir=$run"
  echo "== $cmd"
  timeout "${T_TRAIN:-600}" python3 -m rlalign.cli train $common generator.ep_size=$gep placement.colocate=true \
    trainer.shard_dense=true run.steps=$STEPS task.num_prompts=$TRAIN_PROMPTS task.samples_per_prompt=$SPP \
    task.max_new_tokens=$NEW checkpoint.every=0 monitor.on_mismatch=warn run.dir=$run 2>&1 \
    | grep -E "^step|Error|error" | tail -8
  python3 experiments/rl/gpu_rl_summary.py $run "train_${MODEL}_tep${TEP}_gep${gep}_${TAG}" --out "$OUT" \
    --warmup 1 --command "$cmd"
done
