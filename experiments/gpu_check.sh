#!/usr/bin/env bash
# A tree's checks on one CUDA GPU, in one device call (../shared/GPU.md; run after `source .gpu/activate`):
# tests/gpu, then `rlalign agree` (bench-moe, Triton kernels: 0 mismatched expected) and a 3-step
# colocated `rlalign train` on the GPU (0 mismatched every step). Each step under its own timeout;
# logs under $OUT; a table of verdicts, then $OUT/$NAME.json (default gpu_check_h200: the verdicts, the
# agree and train results, what it shows) through experiments/record.py.
set -uo pipefail
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
declare -A rc

timeout 330 python3 -m pytest -q -ra -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1
rc[tests/gpu]=$?
tail -n 25 "$out/gpu_tests.log"

timeout 120 python3 -m rlalign.cli agree model=bench-moe device=cuda kernels.backend=triton agree.num_prompts=64 \
  agree.max_new_tokens=64 trainer.ep_size=1 > "$out/agree.log" 2>&1
rc[agree]=$?
tail -n 1 "$out/agree.log"

timeout 150 python3 -m rlalign.cli train device=cuda kernels.backend=triton trainer.ep_size=1 generator.ep_size=1 \
  placement.colocate=true run.steps=3 run.dir="$out/train_run" checkpoint.enabled=false > "$out/train.log" 2>&1
rc[train]=$?
tail -n 1 "$out/train.log"
grep -h -o '"consistency/mismatched_tokens": [0-9]*' "$out/train_run/metrics.jsonl" 2>/dev/null

printf '\n%-10s %s\n' check exit
for k in tests/gpu agree train; do printf '%-10s %s\n' "$k" "${rc[$k]}"; done

python3 - "$out" "${NAME:-gpu_check_h200}" "${rc[tests/gpu]}" "${rc[agree]}" "${rc[train]}" <<'PY'
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, "experiments")
from record import write  # noqa: E402

out, name, *codes = sys.argv[1:]


def last_json(path: Path):
    lines = [x for x in path.read_text().splitlines() if x.startswith("{")] if path.exists() else []
    return json.loads(lines[-1]) if lines else None


log = Path(out, "gpu_tests.log")
verdict = [x.strip("= ") for x in (log.read_text().splitlines() if log.exists() else []) if re.search(r"\d+ (passed|failed)", x)]
agree, train = last_json(Path(out, "agree.log")), last_json(Path(out, "train.log"))
commit = __import__("os").environ.get("RLALIGN_GIT_COMMIT", "")[:7]
summary = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "gpu_tests": verdict[-1] if verdict else None, "exit_codes": dict(zip(("tests/gpu", "agree", "train"), map(int, codes))),
           "agree_mismatched_tokens": agree and agree.get("mismatched_tokens"), "agree_tokens": agree and agree.get("tokens"),
           "train_steps": train and train.get("steps"), "train_mismatched_tokens": train and train.get("mismatched_tokens_total")}
what = (f"experiments/gpu_check.sh's checks at {commit} on one {summary['gpu']}: tests/gpu {summary['gpu_tests']}; rlalign agree "
        f"at bench-moe (Triton kernels) {summary['agree_mismatched_tokens']} of {summary['agree_tokens']} tokens mismatched; a "
        f"{summary['train_steps']}-step colocated rlalign train on the GPU: {summary['train_mismatched_tokens']} of "
        f"{train and train.get('tokens_total')} tokens mismatched.")
print("wrote", write(name, {"summary": summary, "agree": agree, "train": train, "what_it_shows": what}, out,
                     command="bash experiments/gpu_check.sh"))
PY
