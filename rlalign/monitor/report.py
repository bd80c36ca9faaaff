"""`rlalign report RUN_DIR`: PNG plots and a markdown summary of a run.

    reward.png        reward mean/min/max per step
    mismatch.png      generator-vs-trainer mismatched tokens and max |d logprob| per step
    abs_diff_hist.png |d logprob| over all tokens of the run, in decades
    divergence.png    token rows differing per op (from divergence.jsonl; monitor.fingerprints=layers)
    summary.md        the numbers and the plots
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for no, ln in enumerate(path.read_text().splitlines(), 1):
        if ln.strip():
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{no}: corrupt line ({e.msg})") from None
    return out


def make_report(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlalign.monitor.consistency import HIST_EDGES

    rows = _rows(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl: missing or empty (not a run directory?)")
    div = _rows(run_dir / "divergence.jsonl")
    steps = [r["step"] for r in rows]
    out = run_dir / "report"
    out.mkdir(exist_ok=True)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward/mean"] for r in rows], label="mean")
    ax.fill_between(steps, [r.get("reward/min", 0) for r in rows], [r.get("reward/max", 0) for r in rows],
                    alpha=0.2, label="min-max")
    ax.set(xlabel="step", ylabel="reward", title="reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(steps, [r["consistency/mismatched_tokens"] for r in rows], color="tab:red", label="mismatched tokens")
    ax.set(xlabel="step", ylabel="mismatched tokens", title="generator vs trainer")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["consistency/logprob_abs_diff_max"] for r in rows], color="k", marker=".", label="max |d|")
    ax2.set_ylabel("max |d logprob|")
    fig.tight_layout()
    fig.savefig(out / "mismatch.png", dpi=100)
    plt.close(fig)

    hist = [sum(r.get("consistency/abs_diff_hist", [0] * (len(HIST_EDGES) + 1))[i] for r in rows)
            for i in range(len(HIST_EDGES) + 1)]
    labels = ["0"] + [f"<={e:g}" for e in HIST_EDGES[1:]] + [f">{HIST_EDGES[-1]:g}"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(len(hist)), hist)
    ax.set_xticks(range(len(hist)), labels, rotation=45)
    ax.set(ylabel="tokens", title="|d logprob| over the run")
    fig.tight_layout()
    fig.savefig(out / "abs_diff_hist.png", dpi=100)
    plt.close(fig)

    by_op: dict[str, int] = {}
    for d in div:
        for op, n in d.get("by_op", {}).items():
            by_op[op] = by_op.get(op, 0) + n
    if by_op:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(range(len(by_op)), list(by_op.values()), color="tab:purple")
        ax.set_xticks(range(len(by_op)), list(by_op), rotation=75, fontsize=7)
        ax.set(ylabel="differing token rows", title="divergence by layer/op")
        fig.tight_layout()
        fig.savefig(out / "divergence.png", dpi=100)
        plt.close(fig)

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
        f"| max abs logprob diff | {max(x['consistency/logprob_abs_diff_max'] for x in rows):.3g} |",
        f"| mean step time | {sum(x['time/step_s'] for x in rows) / len(rows):.2f} s |",
        f"| first divergent op | {firsts[0] if firsts else 'none'} |", "",
        "![reward](reward.png)", "![mismatch](mismatch.png)", "![abs diff](abs_diff_hist.png)",
    ]
    if by_op:
        lines.append("![divergence](divergence.png)")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
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
