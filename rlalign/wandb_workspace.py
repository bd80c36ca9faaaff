"""A W&B workspace laid out for `rlalign train` runs, the consistency panels first.

    pip install wandb-workspaces          # W&B's workspace API (not an rlalign dependency)
    python -m rlalign.wandb_workspace ENTITY PROJECT [NAME]

saves a workspace view NAME (default "rlalign") in ENTITY/PROJECT and prints its URL. LAYOUT is the
layout as data: per section, line plots of metrics (x = step) and panels that show the latest
logged table or histogram of a key (rlalign/logger.py says what each key holds). Every key in it
is one `rlalign train logger=wandb` logs (the tests read an offline run back and check).
"""

from __future__ import annotations

import sys

# (section, [("line", title, [metric keys]) | ("latest", key)])
LAYOUT: list[tuple[str, list[tuple]]] = [
    ("consistency (generator vs trainer logprobs)", [
        ("line", "mismatched tokens", ["consistency/mismatched_tokens"]),
        ("line", "|Δ logprob|: max and mean",
         ["consistency/logprob_abs_diff_max", "consistency/logprob_abs_diff_mean"]),
        ("line", "k3 KL(generator || trainer)", ["consistency/k3_kl"]),
        ("line", "identical tokens (|Δ| = 0)", ["consistency/identical_tokens"]),
        ("latest", "consistency/abs_diff_hist"),
        ("latest", "consistency/worst_tokens"),
        ("latest", "consistency/divergence_by_op"),
        ("latest", "text_metrics"),
    ]),
    ("reward", [
        ("line", "reward", ["reward/mean", "reward/min", "reward/max"]),
        ("line", "reward calls past task.reward_timeout_s", ["reward/timeouts"]),
        ("line", "reward and advantage std", ["reward/std", "advantage/std"]),
        ("line", "GRPO groups with one reward (no signal)", ["reward/zero_std_group_frac"]),
    ]),
    ("rollout", [
        ("line", "response length", ["response/length_mean", "response/length_min", "response/length_max"]),
        ("line", "stopped by max_new_tokens / by EOS", ["response/clip_frac", "response/eos_frac"]),
        ("line", "entropy: mean -log p of the sampled tokens, full vocabulary (trainer)",
         ["response/entropy", "actor/entropy"]),
        ("latest", "samples"),
    ]),
    ("actor", [
        ("line", "policy loss", ["actor/pg_loss"]),
        ("line", "gradient norm", ["actor/grad_norm"]),
        ("line", "PPO clip fraction, by side", ["actor/clip_frac", "actor/clip_high_frac", "actor/clip_low_frac"]),
        ("line", "KL(old || current policy)", ["kl/old_new_k1", "kl/old_new_k3"]),
        ("line", "importance ratio", ["actor/ratio_mean", "actor/ratio_min", "actor/ratio_max"]),
        ("line", "learning rate", ["actor/lr"]),
    ]),
    ("throughput and time", [
        ("line", "tokens/s", ["time/generate_tok_per_s", "time/train_tok_per_s", "time/step_tok_per_s",
                              "time/reward_tok_per_s", "time/compare_tok_per_s"]),
        ("line", "weight sync MB/s", ["time/sync_mb_per_s"]),
        ("line", "seconds per phase", ["time/generate_s", "time/reward_s", "time/train_s", "time/compare_s",
                                       "time/sync_s", "time/checkpoint_s", "time/step_s"]),
    ]),
]


def layout_keys() -> set[str]:
    return {k for _, panels in LAYOUT for p in panels for k in (p[2] if p[0] == "line" else [p[1]])}


def build(entity: str, project: str, name: str = "rlalign"):
    """The workspace (wandb_workspaces.workspaces.Workspace), not yet saved."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise ImportError("the W&B workspace API is not installed: pip install wandb-workspaces") from None

    def panel(p):
        if p[0] == "line":
            return wr.LinePlot(title=p[1], x="Step", y=list(p[2]))
        return wr.WeavePanelSummaryTable(table_name=p[1])

    sections = [ws.Section(name=title, panels=[panel(p) for p in panels], is_open=i == 0)
                for i, (title, panels) in enumerate(LAYOUT)]
    return ws.Workspace(name=name, entity=entity, project=project, sections=sections)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m rlalign.wandb_workspace ENTITY PROJECT [NAME]", file=sys.stderr)
        return 2
    try:
        workspace = build(*argv)
        workspace.save()
    except Exception as e:
        print(f"rlalign wandb_workspace: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(getattr(workspace, "url", f"saved workspace {workspace.name} in {argv[0]}/{argv[1]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
