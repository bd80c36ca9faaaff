import json
import subprocess
import sys

import pytest

from rlalign.agree import run_agree
from rlalign.config import load_config


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mb", [1, 3, 0])
def test_agree_deterministic_is_bitwise(dtype, mb):
    cfg = load_config([f"model.dtype={dtype}", f"trainer.micro_batch_size={mb}", "trainer.ep_size=1"])
    res, _ = run_agree(cfg)
    assert res["tokens"] >= 2000
    assert res["mismatched_tokens"] == 0 and res["max_abs_diff"] == 0.0 and res["mean_abs_diff"] == 0.0
    assert res["dtype"] == dtype and res["kernels"] == "deterministic"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_agree_default_mode_reports_the_mismatch(dtype):
    cfg = load_config(["kernels.mode=default", f"model.dtype={dtype}", "trainer.micro_batch_size=3",
                       "trainer.ep_size=1"])
    res, _ = run_agree(cfg)
    assert res["mismatched_tokens"] > 0 and res["max_abs_diff"] > 0


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rlalign.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_last_line_is_the_json_report():
    p = _cli("agree", "agree.num_prompts=6", "generator.max_new_tokens=5")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(res) >= {"tokens", "mismatched_tokens", "max_abs_diff", "mean_abs_diff", "kernels", "dtype",
                        "trainer_ep", "generator_ep"}
    assert res["mismatched_tokens"] == 0


def test_cli_rejects_bad_config_with_the_valid_keys():
    p = _cli("agree", "trainer.micro_batch=3")
    assert p.returncode == 2
    assert "unknown config key 'trainer.micro_batch'" in p.stderr and "micro_batch_size" in p.stderr
    p = _cli("agree", "generator.temperature=0")
    assert p.returncode == 2 and "temperature" in p.stderr
    p = _cli("agree", "--cfg", "job", "kernels.mode=default")
    assert p.returncode == 0 and "mode: default" in p.stdout
