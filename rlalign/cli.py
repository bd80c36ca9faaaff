"""rlalign command line: `rlalign COMMAND [key=value ...] [--cfg [job|hydra|all]]`.

    rlalign train   [overrides]   the RL job (GRPO on Ray; embedded default: tiny MoE, CPU)
    rlalign agree   [overrides]   one batch generated and rescored; last line one JSON object
    rlalign gate repeatability|baseline|replay [overrides]   PASS/FAIL, and the first divergence
    rlalign compare TRACE_A TRACE_B   first differing fingerprint record (files or run dirs)
    rlalign report  RUN_DIR           plots and a summary of a run
    rlalign export  CHECKPOINT_DIR OUT_DIR   the checkpoint's model as a Hugging Face directory
    rlalign --version

Hydra's options: --config-dir DIR (-cd) adds your config directory (its GROUP/OPTION.yaml files and
experiment configs) after rlalign's own, --config-name NAME (-cn) picks the primary config,
-m/--multirun runs a command once per combination of comma-separated values (rlalign/sweep.py).
`rlalign COMMAND --help` lists the config groups and common keys. An error prints one line,
`rlalign COMMAND: error: ...`, and exits 2 (RLALIGN_DEBUG=1 adds the traceback); Ctrl-C exits 130.
`rlalign train` stopped by one of run.stop_signals or Ctrl-C (after its checkpoint: rlalign.stop)
exits 128 + the signal's number (SIGTERM: 143, SIGINT: 130); its line, like that of an error once
the run has started, names the last complete checkpoint and the command that resumes from it.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from rlalign.cluster import ClusterError
from rlalign.config_search import ConfigSource

USAGE = __doc__
# optional modules -> the extra of pyproject.toml that installs each
EXTRAS = {"wandb": "wandb", "matplotlib": "report", "triton": "triton"}

COMMANDS = {"agree": "rlalign.agree", "train": "rlalign.rl", "gate": "rlalign.gates"}
GATES = ("repeatability", "baseline", "replay")
CFG_KINDS = ("job", "hydra", "all")

_ABOUT = {
    "train": "The RL job: GRPO on Ray, a trainer group (EP n) and a generator group (EP m); each step's\n"
             "generator and trainer logprobs are compared token by token. Writes RUN_DIR/metrics.jsonl,\n"
             "checkpoints/ and traces/; the last stdout line is a JSON summary.",
    "agree": "One batch generated (generator.ep_size) and rescored by the trainer (trainer.ep_size, another\n"
             "batch composition); prints how the two sides' per-token logprobs compare, last line JSON.\n"
             "Exits 1 when any token differs in kernels.mode=deterministic, else 0.",
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
        ("task.env", "multi-turn episodes: a built-in environment (guess | calc) or 'pkg.module:Class'"),
        ("task.max_turns", "assistant turns per episode (each up to task.max_new_tokens)"),
        ("task.max_context_len", "an episode's tokens: prompt, turns and observations (null: the model's context)"),
        ("task.stop", "strings that end an assistant turn, e.g. a tool call's closing tag"),
        ("task.env_timeout_s", "time limit of one environment call (null: none); past it the run ends naming "
                               "the episode"),
        ("task.env_fallback_reward", "an episode whose environment failed ends with this reward (null: an error)"),
        ("task.env_workers", "environment calls running at once per generator rank (threads)"),
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


@dataclass
class Args:
    """One command's arguments."""

    overrides: list[str] = field(default_factory=list)
    show: str | None = None  # --cfg's kind
    want_help: bool = False
    multirun: bool = False
    source: ConfigSource = field(default_factory=ConfigSource)  # --config-dir, --config-name


def _groups(source: ConfigSource) -> list[tuple[str, list[str], str]]:
    """(group, options, the option the primary config picks) over the config search path."""
    from rlalign.config import CONFIG_DIR, chosen_options
    from rlalign.config_search import group_options, search_dirs

    try:
        dirs, _ = search_dirs(CONFIG_DIR, source, [])
        chosen = chosen_options(source)
    except Exception:  # the help still lists rlalign's own groups
        dirs, chosen = [CONFIG_DIR], {}
    return [(g, opts, chosen.get(g, "")) for g, opts in group_options(dirs).items()]


def _defaults(keys: list[str], source: ConfigSource) -> dict[str, str]:
    try:
        from omegaconf import OmegaConf

        from rlalign.config import load_config

        raw = OmegaConf.to_container(load_config([], source=source), resolve=False)  # run.dir as ${now:...}
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


_OPTIONS = """options:
  --cfg [job|hydra|all]  print the composed config and exit (job and all: the config; hydra: the
                         config search path; rlalign runs no Hydra app, so there is no hydra config)
  --resolve              accepted for Hydra's habit: --cfg prints the config resolved anyway
  --config-dir DIR, -cd DIR
                         add DIR to the config search path, after rlalign's own configs: your
                         DIR/model/NAME.yaml is model=NAME, DIR/task/NAME.yaml is task=NAME (a file
                         with the name of one of rlalign's is refused); hydra.searchpath=[file://DIR]
                         does the same
  --config-name NAME, -cn NAME
                         the primary config: DIR/NAME.yaml, e.g. an experiment whose defaults list
                         starts from rlalign's `config` (default: config, rlalign's configs/config.yaml)
  -m, --multirun         one job per combination of comma-separated values (trainer.lr=1e-4,3e-4),
                         one after another; job N in RUN_DIR/N; a table on stderr and a JSON line per
                         job on stdout at the end (also RUN_DIR/multirun.jsonl)
  hydra.run.dir=DIR      = run.dir=DIR (with --multirun, hydra.sweep.dir=DIR too); other hydra.* keys
                         are refused: rlalign runs no Hydra app
  --version              rlalign's version
  -h, --help             this text

environment:
  RAY_ADDRESS=HOST:PORT  run on that Ray cluster (its own CPUs/GPUs; it keeps running);
                         `ray job submit -- rlalign ...` sets it. Unset: a private local
                         cluster that ends with the command (also on kill -9)
  RLALIGN_DEBUG=1        print the traceback of an error too
"""


def help_text(cmd: str, source: ConfigSource | None = None) -> str:
    source = source or ConfigSource()
    usage = {"gate": "rlalign gate repeatability|baseline|replay [KEY=VALUE ...] [GROUP=OPTION ...] [--cfg [job]]"}.get(
        cmd, f"rlalign {cmd} [KEY=VALUE ...] [GROUP=OPTION ...] [--cfg [job|hydra|all]]")
    keys = _KEYS["common"] + _KEYS[cmd]
    vals = _defaults([k for k, _ in keys], source)
    lines = [f"usage: {usage}", "       [--config-dir DIR] [--config-name NAME] [-m]", "", _ABOUT[cmd], "",
             "config groups (GROUP=OPTION: rlalign's configs/GROUP/OPTION.yaml or yours in --config-dir;",
             "* the default):"]
    for g, opts, default in _groups(source):
        lines.append(f"  {g:<10} " + ", ".join(o + ("*" if o == default else "") for o in opts))
    lines += ["", "common keys (KEY=VALUE; default in brackets; all keys: --cfg job prints the composed config):"]
    w = max(len(k) for k, _ in keys)
    for k, what in keys:
        v = f" [{vals[k]}]" if k in vals else ""
        lines.append(f"  {k:<{w}}  {what}{v}")
    lines += ["", _OPTIONS, "exit status:"]
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
    lines.append("  --multirun: 0 when every job exited 0, else the largest status; Ctrl-C or a stop signal ends"
                 " the sweep")
    return "\n".join(lines)


_VALUED = {"--config-dir": "user_dir", "-cd": "user_dir", "--config-name": "name", "-cn": "name"}


def parse(cmd: str, args: list[str]) -> Args:
    """One command's arguments; UsageError if refused."""
    out, source, i = Args(), {}, 0
    while i < len(args):
        a = args[i]
        i += 1
        flag, eq, value = a.partition("=")
        if a in ("-h", "--help"):
            out.want_help = True
        elif a in ("--cfg", "-c") or a.startswith("--cfg="):
            out.show = value if eq else "job"
            if not eq and i < len(args) and "=" not in args[i] and not args[i].startswith("-"):
                out.show, i = args[i], i + 1  # a bare word after --cfg is its kind (an override holds '=')
            if out.show not in CFG_KINDS:
                raise UsageError(f"--cfg {out.show}: expected one of {', '.join(CFG_KINDS)}")
        elif a == "--resolve":
            pass  # Hydra's flag for --cfg: the config --cfg prints is resolved already
        elif a in ("-m", "--multirun"):
            out.multirun = True
        elif flag in _VALUED:
            if not eq and (i == len(args) or args[i].startswith("-")):
                raise UsageError(f"{flag} needs a value ({flag} {'DIR' if _VALUED[flag] == 'user_dir' else 'NAME'})")
            source[_VALUED[flag]] = value if eq else args[i]
            i += 0 if eq else 1
        elif flag in ("--config-path", "-cp"):
            raise UsageError(f"{flag}: rlalign's own configs are part of the package; add yours with "
                             "--config-dir DIR (and pick a primary config there with --config-name NAME)")
        elif a.startswith("-"):
            raise UsageError(f"unknown option {a!r} (overrides are KEY=VALUE; see rlalign {cmd} --help)")
        else:
            out.overrides.append(_hydra_key(a))
    sweep_dir = next((a for a in args if a.lstrip("+").startswith("hydra.sweep.dir=")), None)
    if sweep_dir and not out.multirun:
        raise UsageError(f"{sweep_dir}: hydra.sweep.dir is the --multirun sweep's directory (= run.dir with -m); "
                         "without -m the output directory is run.dir (hydra.run.dir=DIR is accepted as run.dir=DIR)")
    out.source = ConfigSource(**source)
    return out


def _hydra_key(a: str) -> str:
    """An override of a hydra.* key as rlalign reads it: hydra.run.dir (and --multirun's hydra.sweep.dir)
    is run.dir; hydra.searchpath adds config directories; any other is refused."""
    key, eq, value = a.partition("=")
    key = key.lstrip("+~")
    if key in ("hydra.run.dir", "hydra.sweep.dir") and eq:
        return "run.dir=" + value
    if key == "hydra.searchpath" and eq:
        return a
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        raise UsageError(f"{a}: rlalign runs no Hydra app, so hydra.* settings have no effect; the output "
                         "directory is run.dir (hydra.run.dir=DIR is accepted as run.dir=DIR), config "
                         "directories are added with --config-dir DIR or hydra.searchpath=[file://DIR]")
    return a


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


def _interrupted(cmd: str, st: dict) -> str:
    if cmd != "train" or st.get("cfg") is None:
        return f"rlalign {cmd}: interrupted"
    return f"rlalign train: interrupted; {_resume_hint(st)}"


def _resume_hint(st: dict) -> str:
    from rlalign.rundir import resume_hint  # torch and the checkpoint code load only where a hint is said

    return resume_hint(st)


def version() -> str:
    import rlalign

    return f"rlalign {rlalign.__version__} ({Path(rlalign.__file__).parent}; Python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        if len(argv) > 1 and argv[0] == "help":
            return main([argv[1], "--help"])
        return _run("", lambda: _say(USAGE, 0 if argv else 2))
    if "--version" in argv[:2]:
        return _run("", lambda: _say(version(), 0))
    cmd, rest = argv[0], argv[1:]
    gone = _cwd_gone()
    if gone:
        print(f"rlalign {cmd}: error: {gone}", file=sys.stderr)
        return 2
    if cmd in ("compare", "report", "export"):
        return _run(cmd, lambda: _passthrough(cmd, rest))
    if cmd not in COMMANDS:
        known = ", ".join([*COMMANDS, "compare", "report", "export"])
        print(f"rlalign: error: unknown command {cmd!r}; one of: {known} "
              f"(rlalign --help)", file=sys.stderr)
        return 2
    state = {"overrides": [], "cfg": None}
    return _run(cmd, lambda: _command(cmd, rest, state), state)


def _cwd_gone() -> str | None:
    """Why the working directory cannot be used (every relative path resolves against it), or None."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return ("the working directory no longer exists (removed after this process entered it; under `ray job "
                "submit --working-dir`, Ray may remove a job's directory when another job replaces it): cd into "
                "an existing directory, or submit again")
    return None


def _say(text: str, status: int) -> int:
    print(text)
    return status


def _passthrough(cmd: str, rest: list[str]) -> int:
    if cmd == "export":
        from rlalign.export import main as export_main

        return export_main(rest)
    if any(a in ("-h", "--help") for a in rest):
        print({"compare": "usage: rlalign compare TRACE_A TRACE_B   (two trace files, or two run directories)\n"
                          "run directories: stream by stream, without the stale per-rank streams of earlier\n"
                          "segments (segments.jsonl); across trainer EP sizes the trainer state by step and name\n"
                          "exit status: 0 same, 1 differ, 2 error",
               "report": "usage: rlalign report RUN_DIR   (writes RUN_DIR/report/: summary.md and plots)"}[cmd])
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
    args = parse(cmd, rest)
    if args.want_help:
        print(help_text(cmd, args.source))
        return 0
    if cmd == "gate":
        if gate is None:
            raise UsageError("which gate? usage: rlalign gate repeatability|baseline|replay [overrides] "
                             "(rlalign gate --help)")
        if gate not in GATES:
            from rlalign.config_task import did_you_mean

            raise UsageError(f"unknown gate {gate!r}{did_you_mean(gate, GATES)}; one of: {', '.join(GATES)}")
    state.update(overrides=args.overrides, source=args.source)
    if args.show == "hydra":
        return _show_search_path(args)
    from rlalign.config import load_config

    if args.multirun:
        return _multirun(cmd, gate, args, state)
    cfg = state["cfg"] = load_config(args.overrides, source=args.source)
    if args.show is not None:
        return _show(cfg)
    return _execute(cmd, gate, args.overrides, state)


def _show(cfg, title: str | None = None) -> int:
    from omegaconf import OmegaConf

    print(*([f"# {title}"] if title else []), OmegaConf.to_yaml(cfg, resolve=True), sep="\n")
    return 0


def _show_search_path(args: Args) -> int:
    from rlalign.config import CONFIG_DIR
    from rlalign.config_search import search_dirs

    dirs, _ = search_dirs(CONFIG_DIR, args.source, args.overrides)
    print("# rlalign composes its configs with Hydra's compose API and runs no Hydra app: there is no hydra "
          "config. The output directory is run.dir; `--cfg job` prints the config.",
          f"# primary config: {args.source.name}; config search path, first match wins:",
          *(f"#   {d}" for d in dirs), sep="\n")
    return 0


def _execute(cmd: str, gate: str | None, overrides: list[str], state: dict) -> int:
    """Run one composed command (state['cfg']); its exit status."""
    cfg = state["cfg"]
    if gate is not None:
        from rlalign.gates import run_gate

        passed, text = run_gate(gate, overrides, cfg, state["source"])
        print(text, flush=True)
        return 0 if passed else 1
    import importlib

    module = importlib.import_module(COMMANDS[cmd])
    if cmd == "agree":
        module.refuse_unread_keys(overrides, cfg)
    return module.main(cfg, state) if cmd == "train" else module.main(cfg)


def _multirun(cmd: str, gate: str | None, args: Args, state: dict) -> int:
    """--multirun: every job's config composed first, then the jobs one after another on one Ray cluster
    (rlalign/sweep.py); a job's input error is its line and status 2, and the sweep goes on."""
    from rlalign import sweep
    from rlalign.config import load_config

    sweep_dir, jobs = sweep.plan(cmd, args.overrides, lambda overrides: load_config(overrides, source=args.source))
    if args.show is not None:
        for job in jobs:
            _show(job.cfg, f"multirun job {job.num}: {' '.join(job.overrides)}")
        return 0

    def run_one(job: sweep.Job) -> int:
        state.update(overrides=job.overrides, cfg=job.cfg, run_dir=None)
        try:
            return _execute(cmd, gate, job.overrides, state)
        except Exception as e:
            if isinstance(e, BrokenPipeError) and quiet_if_stdout_closed():
                return 0
            if not _expected(e):
                raise
            print(_error_line(cmd, e, state), file=sys.stderr, flush=True)
            return 2

    from rlalign import cluster

    # the jobs share one Ray cluster (RAY_ADDRESS's, else a private one), as a gate's two runs do
    initialized = cluster.connect(jobs[0].cfg.placement.num_cpus) if cmd in sweep.RUN_DIR_COMMANDS else False
    try:
        return sweep.run(cmd, sweep_dir, jobs, run_one)
    finally:
        cluster.disconnect(initialized)


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (`rlalign ... | head -1`)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poll.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def quiet_if_stdout_closed() -> bool:
    """When stdout's reader has gone, point stdout at /dev/null (what is still buffered and later
    prints go nowhere, as a shell pipeline's writer would end) and say so."""
    if not stdout_closed():
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return True


def _error_line(cmd: str, e: BaseException, st: dict) -> str:
    """The error's one line; a missing optional module names its extra; once a train run holds its
    directory, the last complete checkpoint and the resume command, unless the cluster refused the run
    before any rank started (a rerun of the same command meets the same refusal)."""
    line = f"rlalign{f' {cmd}' if cmd else ''}: error: {_oneline(e)}"
    extra = EXTRAS.get((e.name or "").split(".")[0]) if isinstance(e, ModuleNotFoundError) else None
    if extra:
        line += f" (an optional dependency: pip install 'rlalign[{extra}]')"
    if st.get("run_dir") is not None and not isinstance(e, ClusterError):
        try:
            line += f"; {_resume_hint(st)}"
        except Exception:  # the error line stands without the hint
            pass
    return line


def _run(cmd: str, body, state: dict | None = None) -> int:
    """body() with rlalign's error contract: expected errors one line + exit 2, Ctrl-C 130, a stop
    signal 128 + N (rlalign.stop), stdout's reader gone 0; once a train run holds its directory
    (state['run_dir']) the line names the last complete checkpoint and the resume command."""
    from rlalign.stop import Stopped

    st = state or {}
    name = f"rlalign {cmd}" if cmd else "rlalign"
    try:
        return body()
    except Stopped as e:
        if _debug():
            traceback.print_exc()
        hint = f"; {_resume_hint(st)}" if cmd == "train" else ""
        print(f"{name}: {e}{hint}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        if _debug():
            traceback.print_exc()
        try:
            line = _interrupted(cmd, st)
        except Exception:
            line = f"{name}: interrupted"
        print(line, file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        if isinstance(e, BrokenPipeError) and quiet_if_stdout_closed():
            return 0
        if not _expected(e):
            raise
        if _debug():
            traceback.print_exc()
        print(_error_line(cmd, e, st), file=sys.stderr, flush=True)
        return 2


def main_entry() -> None:
    rc = main()
    try:
        sys.stdout.flush()  # what is still buffered: a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        quiet_if_stdout_closed()
    sys.exit(rc)


if __name__ == "__main__":
    main_entry()
