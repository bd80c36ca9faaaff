"""rlalign command line: `rlalign COMMAND [key=value ...] [--cfg job]`.

    rlalign train   [overrides]   the RL job (GRPO on Ray; embedded default: tiny MoE, CPU)
    rlalign agree   [overrides]   one batch generated and rescored; last line one JSON object
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
    show_cfg = "--cfg" in rest
    if show_cfg:
        i = rest.index("--cfg")
        rest = rest[:i] + rest[i + 2 :]
    from rlalign.config import ConfigError, load_config

    commands = {"agree": "rlalign.agree", "train": "rlalign.rl"}
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
        return importlib.import_module(commands[cmd]).main(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"rlalign {cmd}: error: {e}", file=sys.stderr)
        return 2



def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
