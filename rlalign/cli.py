"""rlalign command line: `rlalign COMMAND [key=value ...] [--cfg job]`.

    rlalign train   [overrides]   the RL job (GRPO on Ray; embedded default: tiny MoE, CPU)
    rlalign agree   [overrides]   one batch generated and rescored; last line one JSON object
    rlalign gate repeatability|baseline|replay [overrides]   PASS/FAIL, and the first divergence
    rlalign compare TRACE_A TRACE_B   first differing fingerprint record (files or run dirs)
    rlalign report  RUN_DIR           plots and a summary of a run
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "compare":
        from rlalign.monitor.compare import main as compare_main

        return compare_main(rest)
    if cmd == "report":
        from rlalign.monitor.report import main as report_main

        return report_main(rest)
    gate = None
    if cmd == "gate":
        if not rest or rest[0].startswith("-") or "=" in rest[0]:
            print("usage: rlalign gate repeatability|baseline|replay [overrides]", file=sys.stderr)
            return 2
        gate, rest = rest[0], rest[1:]
    show_cfg = "--cfg" in rest
    if show_cfg:
        i = rest.index("--cfg")
        rest = rest[:i] + rest[i + 2 :]
    from rlalign.config import ConfigError, load_config

    commands = {"agree": "rlalign.agree", "train": "rlalign.rl", "gate": "rlalign.monitor.gates"}
    if cmd not in commands:
        print(f"rlalign: unknown command {cmd!r}; one of: {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(rest)
    except ConfigError as e:
        print(f"rlalign {cmd}: {e}", file=sys.stderr)
        return 2
    if show_cfg:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return 0
    import importlib

    try:
        if gate is not None:
            from rlalign.monitor.gates import run_gate

            passed, text = run_gate(gate, rest, cfg)
            print(text, flush=True)
            return 0 if passed else 1
        return importlib.import_module(commands[cmd]).main(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"rlalign {cmd}: error: {e}", file=sys.stderr)
        return 2



def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
