"""`rlalign report RUN_DIR`: PNG plots and a markdown summary of a run.

    reward.png        reward mean per step, raw and as a moving average, and its min-max band
    mismatch.png      generator-vs-trainer mismatched tokens and max |d logprob| per step
    abs_diff_hist.png |d logprob| over all tokens of the run, in decades, token counts on a log
                      axis (a few differing tokens among thousands of identical ones stay visible)
    divergence.png    token rows differing per op (from divergence.jsonl; monitor.fingerprints=layers)
    training.png      per step: policy loss, KL (old || current, to the reference, generator || trainer),
                      entropy, response length and tokens/s per phase (TRAINING_PANELS)
    episodes.png      multi-turn runs only, per step: turns, environment calls and failures, how episodes
                      ended, tokens per side, environment time and the engine's wait (EPISODE_PANELS)
    summary.md        the numbers (the W&B run's: rollout stats, time and tokens/s per phase, episodes,
                      the worst tokens with their first divergent op) and the plots
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from rlalign.logger import written_text

# what every line of a run's metrics.jsonl holds that the report reads
METRIC_KEYS = ("step", "reward/mean", "consistency/tokens", "consistency/mismatched_tokens",
               "consistency/logprob_abs_diff_max", "time/step_s")


def _number_or_null(v) -> bool:
    """A metric's value as metrics.jsonl holds it: a number, or null for a non-finite one (logger.json_safe)."""
    return v is None or isinstance(v, int | float) and not isinstance(v, bool)


def _nan_for_null(v):
    return math.nan if v is None else v


def _max_line(values: list) -> str:
    """The greatest of a metric's values, and how many steps logged it non-finite (null)."""
    finite = [v for v in values if v is not None]
    nulls = len(values) - len(finite)
    text = f"{max(finite):.3g}" if finite else "none finite"
    return text + (f" (non-finite at {nulls} of {len(values)} steps)" if nulls else "")


def _rows(path: Path, keys: tuple[str, ...] = ()) -> list[dict]:
    """The JSON objects of a JSONL file, each holding a number (or null) at every one of `keys` ([] if there is
    no file)."""
    if not path.exists():
        return []
    out = []
    text = written_text(path)
    for no, ln in enumerate(text.splitlines(), 1):
        if ln.strip():
            try:
                row = json.loads(ln)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{no}: corrupt line ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{no}: a JSON {type(row).__name__}, not an object")
            lacks = [k for k in keys if k not in row or not _number_or_null(row[k])]
            if lacks:
                raise ValueError(f"{path}:{no}: not a line of an rlalign run's metrics (no number at {lacks})")
            out.append(row)
    return out


def moving_average(xs: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def smoothing_window(n: int) -> int:
    return max(2, min(10, n // 4))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_above(fig, ax, title: str, handles=None, ncol: int = 2) -> None:
    """The title, then the legend in a row above the axes, where it covers no data."""
    fig.suptitle(title)
    kw = {"handles": handles} if handles is not None else {}
    ax.legend(**kw, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=ncol, fontsize=8, frameon=False)


def reward_figure(rows: list[dict]):
    """Raw mean reward, its moving average and the per-step min-max band, with a legend."""
    from matplotlib.ticker import MaxNLocator

    steps, reward = [r["step"] for r in rows], [r["reward/mean"] for r in rows]
    w = smoothing_window(len(rows))
    fig, ax = _plt().subplots(figsize=(6, 3.5))
    ax.fill_between(steps, [r.get("reward/min", 0) for r in rows], [r.get("reward/max", 0) for r in rows],
                    alpha=0.15, color="tab:blue", label="min-max over samples")
    ax.plot(steps, reward, color="tab:blue", alpha=0.45, lw=1, marker=".", label="mean (raw)")
    ax.plot(steps, moving_average(reward, w), color="tab:orange", lw=2, label=f"mean, moving average ({w} steps)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="step", ylabel="reward")
    _legend_above(fig, ax, "reward", ncol=3)
    return fig


def mismatch_figure(rows: list[dict]):
    """Mismatched tokens per step (bars, integer axis) and max |d logprob| (line, right axis)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    steps = [r["step"] for r in rows]
    mism = [r["consistency/mismatched_tokens"] for r in rows]
    dmax = [_nan_for_null(r["consistency/logprob_abs_diff_max"]) for r in rows]
    fig, ax = _plt().subplots(figsize=(6, 3.5))
    bars = ax.bar(steps, mism, color="tab:red", alpha=0.7, label="mismatched tokens (left axis)")
    ax.set(xlabel="step", ylabel="mismatched tokens")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0, top=max(1, max(mism)) * 1.1)
    ax2 = ax.twinx()
    (line,) = ax2.plot(steps, dmax, color="k", marker=".", label="max |Δ logprob| (right axis)")
    if all(d > 0 for d in dmax):
        ax2.set_yscale("log")
    else:  # plain labels: an offset text ("1e-7") would sit under the legend
        ax2.set_ylim(bottom=0)
        ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
    ax2.set_ylabel("max |Δ logprob|")
    per_turn = [ax.plot(steps, [r.get(key, 0) for r in rows], marker=".", lw=1, label=f"turn {k} (left axis)")[0]
                for k, key in turn_keys(rows, "mismatched_tokens")]
    _legend_above(fig, ax, "generator vs trainer logprobs", [bars, line, *per_turn], ncol=2 + len(per_turn) // 2)
    return fig


def turn_keys(rows: list[dict], what: str) -> list[tuple[int, str]]:
    """(k, consistency/turn_{k}/<what>) of the turns any step logged (episodes), k ascending."""
    ks = {int(key.split("/")[1][len("turn_"):]) for r in rows for key in r
          if key.startswith("consistency/turn_") and key.endswith(f"/{what}")}
    return [(k, f"consistency/turn_{k}/{what}") for k in sorted(ks)]


def abs_diff_hist(rows: list[dict]) -> list[int]:
    from rlalign.monitor.consistency import HIST_EDGES

    n = len(HIST_EDGES) + 1
    return [sum(r.get("consistency/abs_diff_hist", [0] * n)[i] for r in rows) for i in range(n)]


def hist_figure(rows: list[dict]):
    """|d logprob| of every token of the run in decade bins: counts on a log axis, each bar labelled."""
    from matplotlib.patches import Patch

    from rlalign.monitor.consistency import HIST_EDGES

    hist = abs_diff_hist(rows)
    labels = ["0"] + [f"({lo:g}, {hi:g}]" for lo, hi in zip(HIST_EDGES, HIST_EDGES[1:])] + [f">{HIST_EDGES[-1]:g}"]
    fig, ax = _plt().subplots(figsize=(6.5, 4))
    bars = ax.bar(range(len(hist)), hist, color=["tab:green"] + ["tab:red"] * (len(hist) - 1))
    ax.bar_label(bars, labels=[str(c) if c else "" for c in hist], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5, top=max(1, max(hist)) * 4)  # a count of 1 still shows as a bar
    ax.set_xticks(range(len(hist)), labels, rotation=45, ha="right", fontsize=8)
    ax.set(xlabel="|Δ logprob| (trainer - generator), decade bins", ylabel="tokens (log scale)")
    _legend_above(fig, ax, f"|Δ logprob| over the run: {sum(hist[1:])} of {sum(hist)} tokens differ",
                  [Patch(color="tab:green", label="identical (|Δ| = 0)"), Patch(color="tab:red", label="differing")])
    return fig


def divergence_figure(by_op: dict[str, int]):
    from matplotlib.ticker import MaxNLocator

    fig, ax = _plt().subplots(figsize=(7, 3.5))
    ax.bar(range(len(by_op)), list(by_op.values()), color="tab:purple")
    ax.set_xticks(range(len(by_op)), list(by_op), rotation=75, fontsize=7)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="layer/op", ylabel="differing token rows", title="divergence by layer/op (whole run)")
    return fig


# panel title -> the metrics.jsonl keys it draws (a key no step logged is left out)
TRAINING_PANELS = {
    "policy loss": ["actor/pg_loss"],
    "KL per token": ["kl/old_new_k3", "kl/old_new_k1", "kl/ref_k3", "consistency/k3_kl"],
    "entropy per token (nats)": ["response/entropy", "actor/entropy"],
    "response length (tokens)": ["response/length_mean", "response/length_max"],
    "tokens/s": ["time/generate_tok_per_s", "time/train_tok_per_s", "time/step_tok_per_s", "time/reward_tok_per_s",
                 "time/compare_tok_per_s"],
    "GRPO signal": ["reward/std", "advantage/std", "reward/zero_std_group_frac"],
}


# multi-turn runs (metrics.jsonl's episode/* keys: rlalign.agent.metrics, rlalign.step.episode_tokens)
EPISODE_PANELS = {
    "turns per episode": ["episode/turns_mean", "episode/turns_max"],
    "environment calls (per step)": ["episode/tool_calls", "episode/tool_errors", "episode/env_errors",
                                     "episode/env_timeouts"],
    "episodes ended by (fraction)": ["episode/finish_done_frac", "episode/finish_turns_frac",
                                     "episode/finish_context_frac", "episode/finish_env_error_frac"],
    "tokens per step": ["episode/policy_tokens", "episode/observation_tokens"],
    "seconds per step": ["time/generate_s", "time/env_s", "time/env_wait_s"],
    "reward": ["reward/mean", "episode/env_reward_mean"],
}


def training_figure(rows: list[dict], panels: dict[str, list[str]] = TRAINING_PANELS):
    """One panel per `panels` entry (at most 6), each key a line over the steps."""
    fig, axes = _plt().subplots(2, 3, figsize=(13, 6.5))
    for ax, (title, keys) in zip(axes.flat, panels.items()):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker=".", lw=1, label=key)
        ax.set(title=title, xlabel="step")
        if ax.lines:
            ax.legend(fontsize=7)
    return fig


def mismatch_dumps(run_dir: Path) -> list[str]:
    """A line per mismatch dump (RUN_DIR/mismatch-stepN: where a deterministic run stopped at a mismatch,
    monitor.on_mismatch=raise): its step, counts, first divergent op and the replay command."""
    out = []
    for d in sorted(run_dir.glob("mismatch-step*")):
        recs = _rows(d / "batch.json")
        b = recs[0] if recs and isinstance(recs[0], dict) else {}
        c = b.get("consistency") or {}
        known = {"mismatched_tokens", "tokens", "logprob_abs_diff_max"} <= set(c)
        counts = (f"{c['mismatched_tokens']} of {c['tokens']} tokens differ, max |Δ logprob| "
                  f"{c['logprob_abs_diff_max']:.3g}" if known else "tokens differ")
        first = b.get("first_divergent_op") or "unknown (monitor.fingerprints=layers names it)"
        out.append(f"step {b.get('step', '?')}: {counts}, first divergence: {first}; replay: rlalign agree "
                   f"agree.replay={d}")
    return out


def make_report(run_dir: Path) -> Path:
    rows, dumps = _rows(run_dir / "metrics.jsonl", METRIC_KEYS), mismatch_dumps(run_dir)
    if not rows:
        why = f"the run stopped at a mismatch: {dumps[-1]}" if dumps else "not a run directory?"
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl: missing or empty ({why})")
    div = _rows(run_dir / "divergence.jsonl")
    steps = [r["step"] for r in rows]
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    plt = _plt()

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)

    save(reward_figure(rows), "reward.png")
    save(mismatch_figure(rows), "mismatch.png")
    save(hist_figure(rows), "abs_diff_hist.png")
    save(training_figure(rows), "training.png")
    episodes = any(k.startswith("episode/") for r in rows for k in r)
    if episodes:
        save(training_figure(rows, EPISODE_PANELS), "episodes.png")
    by_op: dict[str, int] = {}
    for d in div:
        for op, n in d.get("by_op", {}).items():
            by_op[op] = by_op.get(op, 0) + n
    if by_op:
        save(divergence_figure(by_op), "divergence.png")

    r = [x["reward/mean"] for x in rows]
    k = min(5, len(r))
    firsts = [d["first_divergent_op"] for d in div if d.get("first_divergent_op")]
    lines = [
        f"# rlalign run report: {run_dir.name}", "",
        "| what | value |", "| --- | --- |",
        f"| steps | {len(rows)} ({steps[0]}..{steps[-1]}) |",
        f"| reward, first {k} / last {k} steps | {sum(r[:k]) / k:.3f} / {sum(r[-k:]) / k:.3f} |",
        f"| tokens compared | {sum(x['consistency/tokens'] for x in rows)} |",
        f"| mismatched tokens | {sum(x['consistency/mismatched_tokens'] for x in rows)} |",
        f"| max abs logprob diff | {_max_line([x['consistency/logprob_abs_diff_max'] for x in rows])} |",
        f"| mean step time | {sum(x['time/step_s'] for x in rows) / len(rows):.2f} s |",
        f"| first divergent op | {firsts[0] if firsts else 'none'} |",
        *(f"| stopped at a mismatch (not in the rows above) | {d} |" for d in dumps),
        *_rollout_rows(rows), "", *_phase_table(rows), "", *_episode_table(rows),
        "![reward](reward.png)", "![mismatch](mismatch.png)", "![abs diff](abs_diff_hist.png)",
        "![training](training.png)", *(["![episodes](episodes.png)"] if episodes else []),
    ]
    if by_op:
        lines.append("![divergence](divergence.png)")
    lines += _worst_tokens(div)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return out


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return sum(vals) / len(vals) if vals else None


def _rollout_rows(rows: list[dict]) -> list[str]:
    """Table rows of the rollout stats (means over the run's steps), where the run logged them."""
    out = []
    lo, hi = [r.get("response/length_min") for r in rows], [r.get("response/length_max") for r in rows]
    if None not in lo + hi:
        out.append(f"| response length: mean (min..max over the run) | {_mean(rows, 'response/length_mean'):.1f} "
                   f"({min(lo)}..{max(hi)}) |")
    for key, what, fmt in (("response/clip_frac", "responses stopped by max_new_tokens", "{:.1%}"),
                           ("response/eos_frac", "responses ended by EOS", "{:.1%}"),
                           ("response/entropy", "entropy (mean -log p of the sampled tokens)", "{:.3f}"),
                           ("kl/old_new_k3", "KL(old policy, current policy) per token (k3)", "{:.3g}"),
                           ("kl/ref_k3", "KL(current policy, reference policy) per token (k3)", "{:.3g}"),
                           ("actor/clip_frac", "tokens clipped by the PPO ratio clip", "{:.1%}"),
                           ("actor/clip_high_frac", "tokens clipped above 1 + clip_high", "{:.1%}"),
                           ("actor/clip_low_frac", "tokens clipped below 1 - clip_low", "{:.1%}"),
                           ("actor/grad_norm", "gradient norm", "{:.3g}"),
                           ("actor/lr", "learning rate", "{:g}")):
        m = _mean(rows, key)
        if m is not None:
            out.append(f"| {what}, mean | {fmt.format(m)} |")
    by_turn = [f"turn {k}: {sum(r.get(key, 0) for r in rows)} of "
               f"{sum(r.get(f'consistency/turn_{k}/tokens', 0) for r in rows)}"
               for k, key in turn_keys(rows, "mismatched_tokens")]
    if by_turn:
        out.append(f"| mismatched policy tokens by turn | {', '.join(by_turn)} |")
    timeouts = [r["reward/timeouts"] for r in rows if "reward/timeouts" in r]
    if timeouts:
        out.append(f"| reward calls past task.reward_timeout_s | {sum(timeouts)} |")
    return out


def _total(rows: list[dict], key: str) -> int | float:
    return sum(r.get(key, 0) for r in rows)


def _episode_table(rows: list[dict]) -> list[str]:
    """The episodes of a multi-turn run (its episode/* keys; none: no lines): turns, environment calls
    and failures (run totals), how episodes and their turns ended (mean fraction per step), tokens per side, and
    environment time against the engine's wait on it (means per step)."""
    if not any(k.startswith("episode/") for r in rows for k in r):
        return []
    out = ["## episodes", "", "| what | value |", "| --- | --- |"]
    turns = _mean(rows, "episode/turns_mean")
    if turns is not None:
        out.append(f"| turns per episode: mean (max over the run) | {turns:.2f} "
                   f"({max(r.get('episode/turns_max', 0) for r in rows)}) |")
    if any("episode/tool_calls" in r for r in rows):
        out.append(f"| tool calls / tool errors (run total) | {_total(rows, 'episode/tool_calls')} / "
                   f"{_total(rows, 'episode/tool_errors')} |")
        out.append(f"| environment errors / timeouts (run total) | {_total(rows, 'episode/env_errors')} / "
                   f"{_total(rows, 'episode/env_timeouts')} |")
    ends = [key for key in dict.fromkeys(k for r in rows for k in r)
            if key.startswith("episode/finish_") and key.endswith("_frac")]
    if ends:
        out.append(f"| episodes ended by {' / '.join(k[len('episode/finish_'):-len('_frac')] for k in ends)}, "
                   f"mean | {' / '.join(f'{_mean(rows, k):.1%}' for k in ends)} |")
    turn_ends = [_mean(rows, k) for k in ("response/eos_frac", "episode/turn_stop_frac", "response/clip_frac")]
    if None not in turn_ends:
        out.append(f"| assistant turns ended by EOS / a stop string / the per-turn limit, mean | "
                   f"{' / '.join(f'{f:.1%}' for f in turn_ends)} |")
    if any("episode/policy_tokens" in r for r in rows):
        out.append(f"| episode tokens, policy / observation | {_total(rows, 'episode/policy_tokens')} / "
                   f"{_total(rows, 'episode/observation_tokens')} |")
    reward = _mean(rows, "episode/env_reward_mean")
    if reward is not None:
        out.append(f"| environment reward per episode, mean | {reward:.3f} |")
    env, wait, gen = _mean(rows, "time/env_s"), _mean(rows, "time/env_wait_s"), _mean(rows, "time/generate_s")
    if env is not None:
        out.append(f"| environment time (summed over episodes), mean per step | {env:.3f} s |")
    if wait is not None:
        share = f" = {wait / gen:.0%} of generate" if gen else ""
        out.append(f"| engine waiting on environments (not overlapped with decoding), mean per step | "
                   f"{wait:.3f} s{share} |")
    return [*out, ""]


PHASES = [("generate", "generate_tok_per_s"), ("reward", "reward_tok_per_s"), ("train", "train_tok_per_s"),
          ("compare", "compare_tok_per_s"), ("sync", None), ("checkpoint", None), ("step", "step_tok_per_s")]


def _phase_table(rows: list[dict]) -> list[str]:
    """Mean seconds per phase, its share of the step and its tokens/s (generate: response tokens;
    train: prompt + response tokens x PPO epochs; step: prompt + response tokens)."""
    step = _mean(rows, "time/step_s")
    if not step:
        return []
    out = ["| phase | mean s | share of the step | tokens/s |", "| --- | --- | --- | --- |"]
    for phase, rate in PHASES:
        t = _mean(rows, f"time/{phase}_s")
        if t is None:
            continue
        r = _mean(rows, f"time/{rate}") if rate else None
        out.append(f"| {phase} | {t:.3f} | {t / step:.0%} | {f'{r:,.0f}' if r is not None else ''} |")
    return out


def _worst_tokens(div: list[dict], n: int = 10) -> list[str]:
    """The run's n tokens with the largest |Δ logprob| (divergence.jsonl), with the op where each
    first diverged (monitor.fingerprints=layers)."""
    first = {(d["step"], t["sample_id"], t["position"]): t["first_op"] for d in div for t in d.get("tokens", [])}
    worst = sorted(((d["step"], w) for d in div for w in d.get("worst_tokens", [])), key=lambda sw: -sw[1]["abs_diff"])
    if not worst:
        return []
    turn = any("turn" in w for _, w in worst[:n])  # an episode's tokens: the assistant turn of each
    out = ["", f"## worst tokens of the run (|Δ logprob|, {min(n, len(worst))} of the steps' worst)", "",
           "| step | sample | position | token | text | generator | trainer | abs diff | first divergent op |"
           + (" turn |" if turn else ""), "| --- " * (10 if turn else 9) + "|"]
    for step, w in worst[:n]:
        op = first.get((step, w["sample_id"], w["position"] - 1)) or ""
        text = json.dumps(w.get("text", ""))[1:-1].replace("|", "\\|")  # escapes shown, a table cell kept
        out.append(f"| {step} | {w['sample_id']} | {w['position']} | {w['token']} | {f'`{text}`' if text else ''} | "
                   f"{w['generator']:.6g} | "
                   f"{w['trainer']:.6g} | {w['abs_diff']:.3g} | {op} |" + (f" {w.get('turn', '')} |" if turn else ""))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: rlalign report RUN_DIR", file=sys.stderr)
        return 2
    try:
        out = make_report(Path(argv[0]))
    except (ValueError, FileNotFoundError) as e:
        print(f"rlalign report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}/summary.md and its plots")
    return 0
