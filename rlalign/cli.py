"""rlalign command line: `rlalign COMMAND [key=value ...] [--cfg [job|hydra|all]]`.

    rlalign train   [overrides]   the RL job (GRPO on Ray; embedded default: tiny MoE, CPU)
    rlalign agree   [overrides]   one batch generated and rescored; last line one JSON object
    rlalign gate repeatability|baseline|replay [overrides]   PASS/FAIL, and the first divergence
    rlalign compare TRACE_A TRACE_B   first differing fingerprint record (files or run dirs)
    rlalign report  RUN_DIR           plots and a summary of a run
    rlalign export  CHECKPOINT_DIR OUT_DIR   the checkpoint's model as a Hugging Face directory

`rlalign COMMAND --help` lists the config groups and common keys. An error prints one line,
`rlalign COMMAND: error: ...`, and exits 2 (RLALIGN_DEBUG=1 adds the traceback); Ctrl-C exits 130.
`rlalign train` stopped by one of run.stop_signals or Ctrl-C (after its checkpoint: rlalign.stop)
exits 128 + the signal's number (SIGTERM: 143, SIGINT: 130); its line, like that of an error once
the run has started, names the last complete checkpoint and the command that resumes from it.
"""

from __future__ import annotations

import os
import shlex
import sys
import traceback
from pathlib import Path

USAGE = __doc__

COMMANDS = {"agree": "rlalign.agree", "train": "rlalign.rl", "gate": "rlalign.gates"}
GATES = ("repeatability", "baseline", "replay")
CFG_KINDS = ("job", "hydra", "all")

_ABOUT = {
    "train": "The RL job: GRPO on Ray, a trainer group (EP n) and a generator group (EP m); each step's\n"
             "generator and trainer logprobs are compared token by token. Writes RUN_DIR/metrics.jsonl,\n"
             "checkpoints/ and traces/; the last stdout line is a JSON summary.",
    "agree": "One batch generated (generator.ep_size) and rescored by the trainer (trainer.ep_size, another\n"
             "batch composition); prints how the two sides' per-token logprobs compare, last line JSON.",
    "gate": "Two short runs compared record by record; PASS/FAIL and the first divergent op.\n"
            "  repeatability  the same run twice\n"
            "  baseline       the run vs the candidate overrides in gate.candidate\n"
            "  replay         uninterrupted vs resumed from a checkpoint after gate.replay_step",
}
_KEYS = {
    "common": [
        ("trainer.ep_size", "expert-parallel size of the trainer group (divides model.num_experts)"),
        ("generator.ep_size", "expert-parallel size of the generator group"),
        ("kernels.mode", "deterministic | default (same as the kernels group)"),
        ("kernels.backend", "torch | triton | auto"),
        ("seed", "seeds prompts, sampling and the model init"),
        ("device", "cpu | cuda"),
        ("model.path", "a local HF Qwen3-MoE directory (replaces the model group's sizes)"),
        ("model.dtype", "bfloat16 | float32"),
        ("generator.backend", "native | vllm (vLLM schedules, rlalign computes; pip install -e '.[vllm]')"),
    ],
    "train": [
        ("run.steps", "steps to run"),
        ("run.dir", "output directory (hydra.run.dir=DIR means the same); one holding another run is refused"),
        ("run.overwrite", "true: delete the run that run.dir holds, then start afresh"),
        ("task.num_prompts", "prompts per step"),
        ("task.samples_per_prompt", "GRPO group size"),
        ("task.max_new_tokens", "completion length (tokens; the task option's own, e.g. repeat 5)"),
        ("checkpoint.every", "steps between checkpoints (null: run.steps/10 rounded up, at most 50; 0: at the end "
                             "only)"),
        ("checkpoint.enabled", "false: no checkpoint at all, not even the last (e.g. a model too large for the disk)"),
        ("checkpoint.resume", "never | auto | a checkpoint directory"),
        ("checkpoint.bucket_mb", "file size of a checkpoint's buckets: a save holds 3-4 of them in host memory"),
        ("run.stop_signals", "signals that checkpoint the newest state, then stop (exit 128+N; Ctrl-C too)"),
        ("run.stop_grace_s", "seconds a stop signal leaves the step and its checkpoint, then abandons them"),
        ("checkpoint.export_hf", "also write each checkpoint's model as a Hugging Face directory (step_N/hf)"),
        ("task.reward_timeout_s", "time limit of one reward call (null: none); past it the run ends naming the sample"),
        ("task.reward_timeout_fallback", "the reward of a call past the limit instead (null: an error)"),
        ("task.reward_workers", "reward calls running at once (threads)"),
        ("trainer.lr", "learning rate"),
        ("monitor.on_mismatch", "raise | warn (deterministic mode)"),
        ("monitor.fingerprints", "off | default | layers: what the per-step traces fingerprint"),
        ("monitor.optim_every", "traces hold the AdamW moments at steps 0, N, 2N, ... (1: every step)"),
        ("placement.num_cpus", "CPUs of the private Ray cluster (ignored with RAY_ADDRESS)"),
        ("placement.colocate", "trainer and generator ranks share the GPUs"),
        ("trainer.shard_dense", "dense fp32 masters + AdamW state split over the trainer ranks (same bits)"),
        ("generator.keep_state", "keep the engine's KV cache and graphs between steps (false: free them)"),
    ],
    "agree": [
        ("agree.num_prompts", "prompts in the batch"),
        ("agree.max_new_tokens", "completion length (tokens)"),
        ("agree.replay", "a mismatch dump (RUN_DIR/mismatch-stepN) to replay"),
    ],
    "gate": [
        ("run.steps", "steps of each run"),
        ("run.dir", "the runs go to RUN_DIR/gate-KIND/{a,b}"),
        ("gate.candidate", "baseline: the candidate's overrides, e.g. '[generator.ep_size=2]'"),
        ("gate.replay_step", "replay: resume after this step (default: run.steps // 2 - 1)"),
    ],
}


def help_keys(cmd: str) -> list[str]:
    """The config keys `rlalign CMD --help` lists (tests/test_help_keys.py: each one CMD reads)."""
    return [k for k, _ in _KEYS["common"] + _KEYS[cmd]]


class UsageError(ValueError):
    pass


def _groups() -> list[tuple[str, list[str], str]]:
    """(group, options, default) from configs/<group>/*.yaml and config.yaml's defaults list."""
    from rlalign.config import CONFIG_DIR

    defaults = {}
    try:
        from omegaconf import OmegaConf

        for d in OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "config.yaml")).get("defaults", []):
            if isinstance(d, dict):
                defaults.update({str(k): str(v) for k, v in d.items()})
    except Exception:  # the help still lists the groups
        pass
    return [(g.name, sorted(p.stem for p in g.glob("*.yaml")), defaults.get(g.name, ""))
            for g in sorted(CONFIG_DIR.iterdir()) if g.is_dir()]


def _defaults(keys: list[str]) -> dict[str, str]:
    try:
        from omegaconf import OmegaConf

        from rlalign.config import load_config

        raw = OmegaConf.to_container(load_config([]), resolve=False)  # run.dir as ${now:...}
    except Exception:
        return {}
    out = {}
    for k in keys:
        node = raw
        for part in k.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if not isinstance(node, dict):
            out[k] = str(node)
    return out


def help_text(cmd: str) -> str:
    usage = {"gate": "rlalign gate repeatability|baseline|replay [KEY=VALUE ...] [GROUP=OPTION ...] [--cfg [job]]"}.get(
        cmd, f"rlalign {cmd} [KEY=VALUE ...] [GROUP=OPTION ...] [--cfg [job|hydra|all]]")
    keys = _KEYS["common"] + _KEYS[cmd]
    vals = _defaults([k for k, _ in keys])
    lines = [f"usage: {usage}", "", _ABOUT[cmd], "",
             "config groups (GROUP=OPTION; options are configs/GROUP/OPTION.yaml, * the default):"]
    for g, opts, default in _groups():
        lines.append(f"  {g:<10} " + ", ".join(o + ("*" if o == default else "") for o in opts))
    lines += ["", "common keys (KEY=VALUE; default in brackets; all keys: --cfg job prints the composed config):"]
    w = max(len(k) for k, _ in keys)
    for k, what in keys:
        v = f" [{vals[k]}]" if k in vals else ""
        lines.append(f"  {k:<{w}}  {what}{v}")
    lines += ["", "options:",
              "  --cfg [job|hydra|all]  print the composed config and exit (job and all: the config;",
              "                         hydra: rlalign runs no Hydra app, so there is none to print)",
              "  -h, --help             this text",
              "  not supported: -m/--multirun (run one command per setting, e.g. a shell loop over",
              "                 trainer.ep_size=1 and 2, or compare two settings with rlalign gate baseline);",
              "                 hydra.* keys other than hydra.run.dir (= run.dir)",
              "", "environment:",
              "  RAY_ADDRESS=HOST:PORT  run on that Ray cluster (its own CPUs/GPUs; it keeps running);",
              "                         `ray job submit -- rlalign ...` sets it. Unset: a private local",
              "                         cluster that ends with the command (also on kill -9)",
              "  RLALIGN_DEBUG=1        print the traceback of an error too",
              "", "exit status:"]
    if cmd == "gate":
        lines.append("  0 PASS, 1 FAIL, 2 error (one line: rlalign gate: error: ...), 130 interrupted")
    elif cmd == "train":
        lines += ["  0   done, or nothing to do (checkpoint.resume found the run complete: a retry of a finished job)",
                  "  2   error (one line: rlalign train: error: ...); also when another job holds run.dir",
                  "      (RUN_DIR/.rlalign.lock names it; a crashed job's lock does not count)",
                  "  130 stopped by Ctrl-C (SIGINT), as by SIGTERM:",
                  "  143 stopped by SIGTERM (128 + N for a signal N in run.stop_signals, e.g. 138 for SIGUSR1):",
                  "      at once when a checkpoint covers the steps done, else once the newest state is",
                  "      checkpointed (past run.stop_grace_s, or on a second signal: at once)",
                  "  The lines of 130, 143 and of an error after the run started name the last complete",
                  "  checkpoint and the command that resumes from it."]
    else:
        lines.append(f"  0 done, 2 error (one line: rlalign {cmd}: error: ...), 130 interrupted")
    return "\n".join(lines)


def parse(cmd: str, args: list[str]) -> tuple[list[str], str | None, bool]:
    """(overrides, --cfg kind or None, help?) of one command's arguments; UsageError if refused."""
    overrides, show, want_help, i = [], None, False, 0
    while i < len(args):
        a = args[i]
        i += 1
        if a in ("-h", "--help"):
            want_help = True
        elif a in ("--cfg", "-c") or a.startswith("--cfg="):
            show = a.split("=", 1)[1] if "=" in a else "job"
            if "=" not in a and i < len(args) and args[i] in CFG_KINDS:
                show, i = args[i], i + 1
            if show not in CFG_KINDS:
                raise UsageError(f"--cfg {show}: expected one of {', '.join(CFG_KINDS)}")
        elif a in ("-m", "--multirun") or a.startswith("--multirun="):
            raise UsageError("multirun (-m/--multirun) is not supported: run one command per setting "
                             "(e.g. `for ep in 1 2; do rlalign train trainer.ep_size=$ep run.dir=runs/ep$ep; done`), "
                             "or compare two settings with `rlalign gate baseline gate.candidate=[...]`")
        elif a.startswith("-"):
            raise UsageError(f"unknown option {a!r} (overrides are KEY=VALUE; see rlalign {cmd} --help)")
        else:
            key = a.split("=", 1)[0].lstrip("+~")
            if key == "hydra.run.dir" and "=" in a:
                a = "run.dir=" + a.split("=", 1)[1]
            elif key == "hydra" or key.startswith(("hydra.", "hydra/")):
                raise UsageError(f"{a}: rlalign runs no Hydra app, so hydra.* settings have no effect; the "
                                 "output directory is run.dir (hydra.run.dir=DIR is accepted as run.dir=DIR)")
            overrides.append(a)
    return overrides, show, want_help


def _debug() -> bool:
    return os.environ.get("RLALIGN_DEBUG", "").strip() not in ("", "0", "false", "no")


def _expected(e: BaseException) -> bool:
    """Errors that are the input's or the environment's, not rlalign's bugs: one line, no traceback."""
    if isinstance(e, (NotImplementedError, RecursionError)):
        return False
    if isinstance(e, (ValueError, OSError, RuntimeError, ImportError)):
        return True
    ray = sys.modules.get("ray")
    return ray is not None and isinstance(e, ray.exceptions.RayError)


def _oneline(e: BaseException) -> str:
    text = "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    return text or type(e).__name__


def _interrupted(cmd: str, overrides: list[str], cfg) -> str:
    if cmd != "train" or cfg is None:
        return f"rlalign {cmd}: interrupted"
    return f"rlalign train: interrupted; {_resume_hint(overrides, cfg)}"


def _resume_hint(overrides: list[str], cfg) -> str:
    """'last complete checkpoint: ...; resume with: rlalign train ...' of a train command."""
    from rlalign.checkpoint import list_complete

    run_dir = Path(str(cfg.run.dir))
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("run.dir", "checkpoint.resume")]
    resume = "rlalign train " + shlex.join([*kept, f"run.dir={run_dir}", "checkpoint.resume=auto"])
    done = list_complete(run_dir)
    if done:
        return f"last complete checkpoint: {done[-1]}; resume with: {resume}"
    return (f"no complete checkpoint in {run_dir} (checkpoint.every=N saves every N steps); start again with: "
            f"{resume}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        if len(argv) > 1 and argv[0] == "help":
            return main([argv[1], "--help"])
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("compare", "report", "export"):
        return _run(cmd, lambda: _passthrough(cmd, rest))
    if cmd not in COMMANDS:
        known = ", ".join([*COMMANDS, "compare", "report", "export"])
        print(f"rlalign: error: unknown command {cmd!r}; one of: {known} "
              f"(rlalign --help)", file=sys.stderr)
        return 2
    state = {"overrides": [], "cfg": None}
    return _run(cmd, lambda: _command(cmd, rest, state), state)


def _passthrough(cmd: str, rest: list[str]) -> int:
    if cmd == "export":
        from rlalign.export import main as export_main

        return export_main(rest)
    if any(a in ("-h", "--help") for a in rest):
        print({"compare": "usage: rlalign compare TRACE_A TRACE_B   (two trace files, or two run directories)\n"
                          "run directories: stream by stream, without the stale per-rank streams of earlier\n"
                          "segments (segments.jsonl); across trainer EP sizes the trainer state by step and name\n"
                          "exit status: 0 same, 1 differ, 2 error",
               "report": "usage: rlalign report RUN_DIR   (writes RUN_DIR/summary.md and plots)"}[cmd])
        return 0
    if cmd == "compare":
        from rlalign.monitor.compare import main as compare_main

        return compare_main(rest)
    from rlalign.monitor.report import main as report_main

    return report_main(rest)


def _command(cmd: str, rest: list[str], state: dict) -> int:
    gate = None
    if cmd == "gate" and rest and not rest[0].startswith("-") and "=" not in rest[0]:
        gate, rest = rest[0], rest[1:]
    overrides, show, want_help = parse(cmd, rest)
    if want_help:
        print(help_text(cmd))
        return 0
    if cmd == "gate":
        if gate is None:
            raise UsageError("which gate? usage: rlalign gate repeatability|baseline|replay [overrides] "
                             "(rlalign gate --help)")
        if gate not in GATES:
            raise UsageError(f"unknown gate {gate!r}; one of: {', '.join(GATES)}")
    state["overrides"] = overrides
    from omegaconf import OmegaConf

    from rlalign.config import load_config

    cfg = state["cfg"] = load_config(overrides)
    if show == "hydra":
        print("# rlalign composes configs/ with Hydra's compose API and runs no Hydra app: there is no hydra "
              "config. The output directory is run.dir; `--cfg job` prints the config.")
        return 0
    if show is not None:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return 0
    if gate is not None:
        from rlalign.gates import run_gate

        passed, text = run_gate(gate, overrides, cfg)
        print(text, flush=True)
        return 0 if passed else 1
    import importlib

    if cmd == "train":
        return importlib.import_module(COMMANDS[cmd]).main(cfg, state)
    return importlib.import_module(COMMANDS[cmd]).main(cfg)


def _run(cmd: str, body, state: dict | None = None) -> int:
    """body() with rlalign's error contract: expected errors one line + exit 2, Ctrl-C 130, a stop
    signal 128 + N (rlalign.stop); once a train run holds its directory (state['run_dir']) the
    line names the last complete checkpoint and the resume command."""
    from rlalign.stop import Stopped

    st = state or {}
    try:
        return body()
    except Stopped as e:
        if _debug():
            traceback.print_exc()
        hint = f"; {_resume_hint(st['overrides'], st['cfg'])}" if cmd == "train" else ""
        print(f"rlalign {cmd}: {e}{hint}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        if _debug():
            traceback.print_exc()
        try:
            line = _interrupted(cmd, st.get("overrides", []), st.get("cfg"))
        except Exception:
            line = f"rlalign {cmd}: interrupted"
        print(line, file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        if not _expected(e):
            raise
        if _debug():
            traceback.print_exc()
        line = f"rlalign {cmd}: error: {_oneline(e)}"
        if st.get("run_dir") is not None:
            try:
                line += f"; {_resume_hint(st['overrides'], st['cfg'])}"
            except Exception:  # the error line stands without the hint
                pass
        print(line, file=sys.stderr, flush=True)
        return 2


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
