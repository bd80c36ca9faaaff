"""experiments/: the README's results table is the one generated from results/*.json, result files are named by
benchmark, model and machine (no run suffixes), and every result's script is in the tree or at its commit."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def _table_module():
    spec = importlib.util.spec_from_file_location("experiments_table", EXPERIMENTS / "table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


table = _table_module()


def test_readme_table_is_generated_from_the_results():
    readme = table.README.read_text()
    assert table.with_table(readme, table.table()) == readme, "run `python experiments/table.py --write`"


def test_a_changed_result_makes_the_table_stale(tmp_path):
    # negative twin: one result's text edited (or a result added) -> the README's table no longer matches
    results = tmp_path / "results"
    shutil.copytree(table.RESULTS, results)
    readme = table.README.read_text()
    first = sorted(results.glob("*.json"))[0]
    record = json.loads(first.read_text())
    record["what_it_shows"] += " (edited)"
    first.write_text(json.dumps(record))
    assert table.with_table(readme, table.table(results)) != readme
    (results / "bench_extra_cpu.json").write_text(json.dumps({"what_it_shows": "a new result"}))
    assert "bench_extra_cpu.json" in table.table(results)


def test_results_are_named_without_run_suffixes(tmp_path):
    for name in ("paged_attention_h200_explore.json", "triton_NVIDIA_H200_v10.json", "generate_x_H200_s12.json",
                 "generate_x_H200_final.json",
                 "train_profile_x_H200_old.json", "profile_x_H200_after.json", "paged_attention_h200_run2.json"):
        assert table.RUN_SUFFIX.search(name), name
    for name in ("agree_qwen3-30b-a3b-rehearsal_tep2_gep1_2xh200_default.json", "vllm_cpu_tokens_per_s_ep2.json",
                 "weight_sync_bench-moe_h200x2.json", "memory_qwen3_30b.json"):
        assert not table.RUN_SUFFIX.search(name), name
    (tmp_path / "generate_bench-moe-large_H200_before.json").write_text(json.dumps({"what_it_shows": "x"}))
    with pytest.raises(ValueError, match="run suffix"):
        table.table(tmp_path)


def test_every_result_says_what_it_shows(tmp_path):
    (tmp_path / "bench_x_cpu.json").write_text(json.dumps({"command": "python experiments/bench_x.py"}))
    with pytest.raises(ValueError, match="what_it_shows"):
        table.table(tmp_path)


def test_every_results_script_is_in_the_tree_or_at_its_commit(tmp_path):
    assert table.scripts_missing() == []
    if not table.git_succeeds("rev-parse", "--git-dir"):
        pytest.skip("not a git checkout: no history to look in")
    # negative twin: a script that never existed, at a commit that exists (the one table.py came in with)
    head = subprocess.run(["git", "log", "-1", "--format=%H", "--", "experiments/table.py"], cwd=EXPERIMENTS,
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / "bench_gone_cpu.json").write_text(json.dumps({"command": "python experiments/bench_gone.py",
                                                              "git_commit": head, "what_it_shows": "x"}))
    (tmp_path / "bench_moved_cpu.json").write_text(json.dumps({"command": "python experiments/table.py",
                                                               "git_commit": "", "what_it_shows": "x"}))
    assert [m.split(":")[0] for m in table.scripts_missing(tmp_path)] == ["experiments/results/bench_gone_cpu.json"]
