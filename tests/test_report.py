"""`rlalign report` plots, string metrics in W&B, and traces of resumed runs."""

import json
from pathlib import Path

import pytest

from rlalign.config import load_config


# --- string metrics reach W&B ----------------------------------------------------------------------------
def _metrics(step, **extra):
    return {"reward/mean": 0.5, "consistency/mismatched_tokens": 0, "consistency/tokens": 10,
            "consistency/logprob_abs_diff_max": 0.0, "consistency/abs_diff_hist": [10, 0], "time/step_s": 0.1,
            "sync/weights_fp": f"fp{step}", **extra}


def _logger_run(tmp_path, steps):
    pytest.importorskip("wandb")
    from rlalign.logger import RunLogger

    cfg = load_config([f"run.dir={tmp_path}", "logger=wandb", "logger.wandb.mode=offline", "logger.console=false"])
    log = RunLogger(cfg, tmp_path, 0, len(steps))
    try:
        for step, m in enumerate(steps):
            if "alert" in m:
                log.alert("generator/trainer mismatch", m.pop("alert"))
            log.log(step, m)
    finally:
        log.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    return run


@pytest.mark.parametrize("text", ["", "  \n", "ab/cd", "ab:cd", "\udcff"])
def test_a_damaged_wandb_id_is_named_before_wandb_starts(tmp_path, text):
    """A run dir's .wandb_id cut short, or holding what W&B refuses as a run id, is named as that file (they were
    wandb UsageError tracebacks, or a UnicodeDecodeError naming no file). The twin: an intact id is used as it is."""
    from rlalign.logger import _wandb_id

    f = tmp_path / ".wandb_id"
    f.write_bytes(b"\xff" if text == "\udcff" else text.encode())
    with pytest.raises(ValueError, match=rf"{f}: damaged \(the W&B run id of this run dir"):
        _wandb_id(tmp_path)
    f.write_text("3f9a0c1d2e4b\n")
    assert _wandb_id(tmp_path) == "3f9a0c1d2e4b"


@pytest.mark.parametrize("line, what", [('{"a": 1}', "a record without an integer step"),
                                        ("[1, 2]", "a record without an integer step"),
                                        ('{"step": "1"}', "a record without an integer step"),
                                        ("{garbage", "corrupt record")])
def test_a_damaged_metrics_line_is_named_when_a_resume_trims_the_file(tmp_path, line, what):
    """A resume keeps the records of the steps before its checkpoint: a line that is not a record is named by
    file and line (TypeError / KeyError tracebacks before) and the file is left as it was. The twin: a last line
    cut short by a killed writer goes, and the earlier steps stay."""
    from rlalign.logger import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s}) + "\n" for s in range(3)]
    path.write_text(good[0] + line + "\n" + good[1])
    with pytest.raises(ValueError, match=rf"{path}:2: {what}"):
        truncate_jsonl(path, 1)
    assert path.read_text() == good[0] + line + "\n" + good[1]
    path.write_text("".join(good) + '{"step": 3, "rew')
    truncate_jsonl(path, 2)
    assert path.read_text() == "".join(good[:2])


def test_a_wandb_project_name_wandb_refuses_is_named_at_config_time():
    """W&B refuses a project of more than 128 characters or holding / \\ # ? % : (a UsageError traceback once
    the actors were up); the config names it. The twin: 128 characters and dashes are taken."""
    from rlalign.config import ConfigError

    for bad in ("a/b", "'a#b'", "'a%b'", "x" * 129):
        with pytest.raises(ConfigError, match=r"logger.wandb.project='.*': must be a W&B project name"):
            load_config([f"logger.wandb.project={bad}"])
    assert load_config([f"logger.wandb.project={'x' * 126}-y"]).logger.wandb.project == "x" * 126 + "-y"


def test_a_wandb_mode_wandb_refuses_in_the_environment_is_named_at_config_time(monkeypatch):
    """$WANDB_MODE=foo made wandb.init raise a pydantic validation error (even with logger.wandb.mode set) once the
    actors were up; the config names the variable when W&B is on. Twins: W&B's own modes are taken, and with W&B
    off the variable is not read."""
    from rlalign.config import ConfigError

    monkeypatch.setenv("WANDB_MODE", "foo")
    for over in ([], ["logger.wandb.mode=offline"]):
        with pytest.raises(ConfigError, match=r"\$WANDB_MODE=foo: must be unset or one of online, offline, disabled"):
            load_config(["logger.wandb.enabled=true", *over])
    assert not load_config([]).logger.wandb.enabled
    for mode in ("offline", "dryrun", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert load_config(["logger.wandb.enabled=true"]).logger.wandb.enabled


def test_string_metrics_reach_the_wandb_summary_and_a_table(tmp_path):
    from wandb_read import read_offline_run, read_offline_summary, read_offline_table

    run = _logger_run(tmp_path, [_metrics(0), _metrics(1, **{"consistency/first_divergent_op": "layers.1.attn",
                                                              "alert": "step 1: 3 of 10 tokens differ"}),
                                 _metrics(2)])
    s = read_offline_summary(run)
    assert s["sync/weights_fp"] == "fp2" and s["sync/weights_fp_step"] == 2
    assert s["consistency/first_divergent_op"] == "layers.1.attn" and s["consistency/first_divergent_op_step"] == 1
    assert s["alert/generator/trainer mismatch"] == "step 1: 3 of 10 tokens differ"
    cols, rows = read_offline_table(run, "text_metrics")
    assert cols == ["step", "key", "value"]
    assert [0, "sync/weights_fp", "fp0"] in rows and [1, "consistency/first_divergent_op", "layers.1.attn"] in rows
    assert [1, "alert/generator/trainer mismatch", "step 1: 3 of 10 tokens differ"] in rows
    assert len(rows) == 5
    history = read_offline_run(run)[0]
    assert [h["_step"] for h in history if "reward/mean" in h] == [0, 1, 2]
    assert all(isinstance(h.get("reward/mean", 0.0), float) for h in history)  # numbers stay in the history


def test_negative_twin_a_run_without_string_metrics_has_none_in_wandb(tmp_path):
    from wandb_read import read_offline_summary, read_offline_table

    plain = {k: v for k, v in _metrics(0).items() if not isinstance(v, str)}
    run = _logger_run(tmp_path, [plain, dict(plain)])
    s = read_offline_summary(run)
    assert not any(k.startswith(("sync/", "alert/")) or "first_divergent_op" in k for k in s)
    assert s["reward/mean"] == 0.5
    with pytest.raises(KeyError, match="no table logged under 'text_metrics'"):
        read_offline_table(run, "text_metrics")
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0


# --- report plots ----------------------------------------------------------------------------------------
def _run_dir(tmp_path, mismatched_steps=(7,), steps=20):
    """A run of `steps` steps of 5000 tokens each; one token differs (by ~3e-7) at each mismatched step."""
    rows = []
    for s in range(steps):
        bad = int(s in mismatched_steps)
        rows.append({"step": s, "reward/mean": 0.1 * (s % 3) + 0.01 * s, "reward/min": 0.0, "reward/max": 1.0,
                     "consistency/tokens": 5000, "consistency/mismatched_tokens": bad,
                     "consistency/logprob_abs_diff_max": 3e-7 * bad,
                     "consistency/abs_diff_hist": [5000 - bad, 0, bad, 0, 0, 0, 0, 0, 0], "time/step_s": 0.5})
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path, rows


def _legend_texts(fig):
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def _integer_ticks(ax):
    lo, hi = ax.get_ylim()
    return all(float(t).is_integer() for t in ax.get_yticks() if lo <= t <= hi)


def test_report_plots_a_log_histogram_legends_integer_counts_and_a_smoothed_reward(tmp_path):
    from rlalign.monitor.report import _plt, hist_figure, make_report, mismatch_figure, moving_average, reward_figure

    run, rows = _run_dir(tmp_path / "run", mismatched_steps=(7, 12))
    out = make_report(run)
    assert {p.name for p in out.iterdir()} == {"reward.png", "mismatch.png", "abs_diff_hist.png", "training.png",
                                               "summary.md"}
    assert "| mismatched tokens | 2 |" in (out / "summary.md").read_text()

    fig = hist_figure(rows)  # 2 differing tokens among 100000 identical ones stay visible
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] < 1
    assert [round(b.get_height()) for b in ax.patches if b.get_height() > 0] == [99998, 2]
    assert ax.get_xlabel().startswith("|Δ logprob|") and ax.get_ylabel() == "tokens (log scale)"
    assert _legend_texts(fig) == ["identical (|Δ| = 0)", "differing"]

    fig = mismatch_figure(rows)
    assert _legend_texts(fig) == ["mismatched tokens (left axis)", "max |Δ logprob| (right axis)"]
    assert _integer_ticks(fig.axes[0]) and fig.axes[0].get_ylabel() == "mismatched tokens"
    # negative twin: the same counts on a default axis get fractional ticks (0.25, 0.5, ...)
    f2, a2 = _plt().subplots()
    a2.bar([r["step"] for r in rows], [r["consistency/mismatched_tokens"] for r in rows])
    assert not _integer_ticks(a2)

    fig = reward_figure(rows)
    assert _legend_texts(fig) == ["min-max over samples", "mean (raw)", "mean, moving average (5 steps)"]
    raw, smooth = (line.get_ydata() for line in fig.axes[0].get_lines())
    reward = [r["reward/mean"] for r in rows]
    assert list(raw) == reward and list(smooth) == moving_average(reward, 5) and list(smooth) != reward
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    for f in (fig, f2):
        _plt().close(f)


def test_report_of_a_run_without_mismatches(tmp_path):
    from rlalign.monitor.report import hist_figure, make_report, mismatch_figure

    run, rows = _run_dir(tmp_path / "run", mismatched_steps=())
    make_report(run)
    ax = hist_figure(rows).axes[0]
    assert [round(b.get_height()) for b in ax.patches if b.get_height() > 0] == [100000]
    assert "0 of 100000 tokens differ" in ax.figure.get_suptitle()
    ax = mismatch_figure(rows).axes[0]
    assert ax.get_ylim() == (0, 1.1) and _integer_ticks(ax)


def test_a_metrics_file_not_of_a_run_is_named_by_line(tmp_path):
    """`rlalign report` on a metrics.jsonl that is not a run's (another tool's object, a JSON list, a line
    without the reward) names the file and line. The twin: a run's line with a non-finite value (null) reports,
    saying so (it was a TypeError comparing None)."""
    from rlalign.monitor.report import make_report

    run, rows = _run_dir(tmp_path / "run", mismatched_steps=())
    good = (run / "metrics.jsonl").read_text().splitlines()
    for line, message in (('{"a": 1}', r"metrics.jsonl:2: not a line of an rlalign run's metrics \(no number at "
                                        r"\['step', 'reward/mean'"),
                          ("[1, 2]", r"metrics.jsonl:2: a JSON list, not an object"),
                          ('{"step": 1}', r"metrics.jsonl:2: not a line .*\['reward/mean'")):
        (run / "metrics.jsonl").write_text("\n".join([good[0], line, *good[2:]]) + "\n")
        with pytest.raises(ValueError, match=message):
            make_report(run)
    row = json.loads(good[1])
    row["consistency/logprob_abs_diff_max"], row["nonfinite"] = None, ["consistency/logprob_abs_diff_max"]
    (run / "metrics.jsonl").write_text("\n".join([good[0], json.dumps(row), *good[2:]]) + "\n")
    assert "| max abs logprob diff | 0 (non-finite at 1 of 20 steps) |" in (make_report(run) / "summary.md").read_text()


def test_metrics_jsonl_is_standard_json_with_non_finite_values_named():
    from rlalign.logger import json_safe

    row = json_safe({"reward/mean": 0.5, "actor/grad_norm": float("nan"), "x": float("inf")})
    assert json.loads(json.dumps(row, allow_nan=False)) == {"reward/mean": 0.5, "actor/grad_norm": None, "x": None,
                                                            "nonfinite": ["actor/grad_norm", "x"]}
    with pytest.raises(ValueError):  # negative twin: the raw row is not standard JSON
        json.dumps({"actor/grad_norm": float("nan")}, allow_nan=False)


def test_report_draws_loss_kl_entropy_length_and_throughput_from_the_keys_logged(tmp_path):
    from rlalign.monitor.report import training_figure

    _, rows = _run_dir(tmp_path / "run", steps=4)
    for s, r in enumerate(rows):
        r.update({"actor/pg_loss": -0.1 * s, "kl/old_new_k3": 0.01 * s, "response/entropy": 2.0,
                  "response/length_mean": 7.5, "response/length_max": 9, "time/train_tok_per_s": 100.0 + s})
    fig = training_figure(rows)
    drawn = {ax.get_title(): [ln.get_label() for ln in ax.lines] for ax in fig.axes}
    assert drawn["policy loss"] == ["actor/pg_loss"] and drawn["KL per token"] == ["kl/old_new_k3"]
    assert drawn["entropy per token (nats)"] == ["response/entropy"]
    assert drawn["response length (tokens)"] == ["response/length_mean", "response/length_max"]
    assert drawn["tokens/s"] == ["time/train_tok_per_s"]
    assert drawn["GRPO signal"] == []  # negative twin: a key no step logged draws nothing


def _episode_run(tmp_path, episodes: bool):
    """_run_dir's 3 steps with the keys of a multi-turn step (episodes=True) or without them."""
    run, rows = _run_dir(tmp_path, steps=3)
    for s, r in enumerate(rows):
        r.update({"time/generate_s": 0.4, "response/eos_frac": 0.5, "response/clip_frac": 0.25})
        if episodes:
            r.update({"episode/turns_mean": 2.0 + s / 2, "episode/turns_max": 3 + s, "episode/env_reward_mean": 0.25,
                      "episode/tool_calls": 4, "episode/tool_errors": s, "episode/env_errors": 0,
                      "episode/env_timeouts": int(s == 2), "episode/finish_done_frac": 0.5,
                      "episode/finish_turns_frac": 0.5 - 0.25 * s, "episode/finish_context_frac": 0.0,
                      "episode/finish_env_error_frac": 0.25 * s, "episode/policy_tokens": 70,
                      "episode/observation_tokens": 30, "time/env_s": 0.3, "time/env_wait_s": 0.1,
                      "episode/turn_stop_frac": 0.25})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_report_summarises_episodes_and_draws_their_panels(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from rlalign.monitor.report import EPISODE_PANELS, make_report, training_figure

    # the figures are built, not rendered (rendering is the other tests'): a named empty file each
    monkeypatch.setattr(Figure, "tight_layout", lambda self: None)
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: Path(path).touch())

    out = make_report(_episode_run(tmp_path / "multi", episodes=True))
    assert "episodes.png" in {p.name for p in out.iterdir()}
    summary = (out / "summary.md").read_text()
    section = summary.split("## episodes\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section == [
        "| what | value |", "| --- | --- |",
        "| turns per episode: mean (max over the run) | 2.50 (5) |",
        "| tool calls / tool errors (run total) | 12 / 3 |",
        "| environment errors / timeouts (run total) | 0 / 1 |",
        "| episodes ended by done / turns / context / env_error, mean | 50.0% / 25.0% / 0.0% / 25.0% |",
        "| assistant turns ended by EOS / a stop string / the per-turn limit, mean | 50.0% / 25.0% / 25.0% |",
        "| episode tokens, policy / observation | 210 / 90 |",
        "| environment reward per episode, mean | 0.250 |",
        "| environment time (summed over episodes), mean per step | 0.300 s |",
        "| engine waiting on environments (not overlapped with decoding), mean per step | 0.100 s = 25% of generate |"]
    assert "![episodes](episodes.png)" in summary
    fig = training_figure(_rows_of(out.parent), EPISODE_PANELS)
    drawn = {ax.get_title(): [ln.get_label() for ln in ax.lines] for ax in fig.axes}
    assert drawn["seconds per step"] == ["time/generate_s", "time/env_s", "time/env_wait_s"]
    assert drawn["turns per episode"] == ["episode/turns_mean", "episode/turns_max"]
    # negative twin: the same run without its episode keys reports no episodes, and the rest of its
    # summary is the multi-turn one's, line for line
    single = make_report(_episode_run(tmp_path / "single", episodes=False))
    assert "episodes.png" not in {p.name for p in single.iterdir()}
    plain = (single / "summary.md").read_text()
    assert "episode" not in plain
    lines = summary.replace("multi", "single").splitlines()
    start = lines.index("## episodes")
    assert plain.splitlines() == [ln for ln in lines[:start] + lines[start + len(section) + 3:]
                                  if ln != "![episodes](episodes.png)"]


def _rows_of(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def _dump(run, step, **batch):
    """A mismatch dump's batch.json as rlalign.step.dump_mismatch writes it (the fields the report reads)."""
    d = run / f"mismatch-step{step:06d}"
    d.mkdir(parents=True)
    (d / "batch.json").write_text(json.dumps({"step": step, **batch}) + "\n")
    return d


def test_report_names_the_mismatch_dump_where_a_run_stopped(tmp_path):
    """A run that stopped at a mismatch (monitor.on_mismatch=raise) logged no line for that step: the report
    names its dump, counts and first divergent op, as the error line did; at step 0, in its one line."""
    from rlalign.monitor.report import make_report

    counts = {"tokens": 20, "mismatched_tokens": 5, "logprob_abs_diff_max": 0.002}
    at0 = _dump(tmp_path / "r0", 0, consistency=counts, first_divergent_op="layers.1.mlp")
    line = (r"the run stopped at a mismatch: step 0: 5 of 20 tokens differ, max \|Δ logprob\| 0.002, first divergence: "
            rf"layers.1.mlp; replay: rlalign agree agree.replay={at0}\)")
    with pytest.raises(FileNotFoundError, match=line):
        make_report(tmp_path / "r0")
    run, _ = _run_dir(tmp_path / "r3", mismatched_steps=(), steps=3)
    _dump(run, 3, consistency=counts, first_divergent_op=None)
    summary = (make_report(run) / "summary.md").read_text()
    assert "| stopped at a mismatch (not in the rows above) | step 3: 5 of 20 tokens differ" in summary
    assert "first divergence: unknown (monitor.fingerprints=layers names it)" in summary


def test_negative_twin_a_run_without_a_dump_has_no_stop_line(tmp_path):
    from rlalign.monitor.report import make_report

    with pytest.raises(FileNotFoundError, match=r"metrics.jsonl: missing or empty \(not a run directory\?\)"):
        make_report(tmp_path)
    run, _ = _run_dir(tmp_path / "r", mismatched_steps=(), steps=3)
    assert "stopped at a mismatch" not in (make_report(run) / "summary.md").read_text()


def test_summary_has_kl_and_clip_fraction_rows_where_the_run_logged_them(tmp_path):
    """summary.md's table carries the run's mean KL and PPO clip fractions; twin: a run that logged
    none of them has none of those rows."""
    from rlalign.monitor.report import _rollout_rows

    _, rows = _run_dir(tmp_path / "run", steps=2)
    assert not [ln for ln in _rollout_rows(rows) if "KL" in ln or "clipped" in ln]  # twin
    for s, r in enumerate(rows):
        r.update({"kl/old_new_k3": 0.25 * s, "kl/ref_k3": 0.5, "actor/clip_frac": 0.25 * s,
                  "actor/clip_high_frac": 0.125, "actor/clip_low_frac": 0.0})
    assert _rollout_rows(rows) == [
        "| KL(old policy, current policy) per token (k3), mean | 0.125 |",
        "| KL(current policy, reference policy) per token (k3), mean | 0.5 |",
        "| tokens clipped by the PPO ratio clip, mean | 12.5% |",
        "| tokens clipped above 1 + clip_high, mean | 12.5% |",
        "| tokens clipped below 1 - clip_low, mean | 0.0% |"]
