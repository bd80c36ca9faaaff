"""The config search path: rlalign's own configs/ first, then a user's directories (--config-dir DIR,
hydra.searchpath=[file://DIR]) in the order Hydra's own --config-dir puts them, and composing from it
with errors in one line.

A user's directory holds group options (model/my-moe.yaml, task/my-task.yaml) that compose with
rlalign's own, and primary configs (an experiment file selected with --config-name, whose defaults
list may start from rlalign's `config`). A user's file with the name of one of rlalign's is refused:
rlalign's comes first in the search path, so the user's would be ignored in silence.
"""

from __future__ import annotations

import difflib
import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # hydra and omegaconf load when a config is composed, not when the CLI starts
    import yaml
    from hydra.errors import MissingConfigException
    from omegaconf import DictConfig

PRIMARY = "config"  # rlalign's own primary config: configs/config.yaml


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ConfigSource:
    """What a command composes beyond rlalign's own configs/: a user's directory (--config-dir) and
    the primary config's name (--config-name)."""

    user_dir: str | None = None
    name: str = PRIMARY

    def argv(self) -> list[str]:
        """The options that select this source again (a resume command, a multirun job)."""
        out = ["--config-dir", self.user_dir] if self.user_dir else []
        return out + (["--config-name", self.name] if self.name != PRIMARY else [])


def search_dirs(own: Path, source: ConfigSource, overrides: list[str]) -> tuple[list[Path], list[str]]:
    """(the search path's directories: `own`, source.user_dir, hydra.searchpath's entries; the
    overrides without hydra.searchpath). A directory that does not exist, or a user's file that
    rlalign's own of the same name would hide, is a ConfigError."""
    dirs, rest = [own.resolve()], []
    if source.user_dir:
        dirs.append(_existing_dir(source.user_dir, f"--config-dir {source.user_dir}"))
    for o in overrides:
        if o.split("=", 1)[0].lstrip("+") == "hydra.searchpath":
            dirs += [_searchpath_dir(entry, o) for entry in _list_value(o)]
        else:
            rest.append(o)
    user = [d for d in dict.fromkeys(dirs[1:]) if d != dirs[0]]
    for d in user:
        _refuse_hidden_files(dirs[0], d)
    return [dirs[0], *user], rest


def _existing_dir(path: str, what: str) -> Path:
    d = Path(path).expanduser().resolve()
    if not d.is_dir():
        raise ConfigError(f"{what}: {'not a directory' if d.exists() else 'no such directory'} ({d})")
    return d


def _list_value(override: str) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = OverridesParser.create().parse_override(override).value()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{override}: expected a list of directories, e.g. hydra.searchpath=[file:///abs/dir]")
    return value


def _searchpath_dir(entry: str, override: str) -> Path:
    scheme, sep, rest = entry.partition("://")
    if not sep:
        scheme, rest = "file", entry
    if scheme == "file":
        return _existing_dir(rest, f"{override}: {entry}")
    if scheme == "pkg":
        try:
            return _existing_dir(str(importlib.resources.files(rest.replace("/", "."))), f"{override}: {entry}")
        except ModuleNotFoundError:
            raise ConfigError(f"{override}: {entry}: no package {rest!r} is installed") from None
    raise ConfigError(f"{override}: {entry}: expected file://DIR or pkg://PACKAGE")


def _yaml_files(d: Path) -> list[Path]:
    """A config directory's files as Hydra names them: NAME.yaml (primary configs), GROUP/OPTION.yaml."""
    return sorted(p.relative_to(d) for p in [*d.glob("*.yaml"), *d.glob("*/*.yaml")] if p.is_file())


def _refuse_hidden_files(own: Path, user: Path) -> None:
    for rel in _yaml_files(user):
        if (own / rel).is_file():
            fix = (f"rename it (e.g. my-{rel.stem}.yaml) and pass --config-name my-{rel.stem}" if rel.parent == Path()
                   else f"rename it (e.g. {rel.parent}/my-{rel.stem}.yaml) and select {rel.parent}=my-{rel.stem}")
            raise ConfigError(f"{user / rel}: rlalign's own {rel} has this name and comes first in the search "
                              f"path, so yours would be ignored; {fix}")


def group_options(dirs: list[Path]) -> dict[str, list[str]]:
    """{group: its options} over the search path (e.g. {'model': ['my-moe', 'tiny-moe', ...]})."""
    out: dict[str, set[str]] = {}
    for d in dirs:
        for rel in _yaml_files(d):
            if rel.parent != Path():
                out.setdefault(str(rel.parent), set()).add(rel.stem)
    return {g: sorted(opts) for g, opts in sorted(out.items())}


def config_file(dirs: list[Path], name: str) -> Path | None:
    """The file Hydra loads for `name` ('config', 'model/tiny-moe'): the first on the search path."""
    return next((d / f"{name}.yaml" for d in dirs if (d / f"{name}.yaml").is_file()), None)


def closest_first(word: str, options: list[str]) -> list[str]:
    return sorted(options, key=lambda o: -difflib.SequenceMatcher(None, word, o).ratio())


def compose_from(dirs: list[Path], name: str, overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """Hydra's compose of the primary config `name` + overrides over the search path `dirs` (the first
    is Hydra's primary directory, the others follow it as Hydra's --config-dir does). A missing group
    option or primary config, and a YAML file that does not parse, raise ConfigError in one line.
    return_hydra_config: with Hydra's node (hydra.runtime.choices: the option of each group)."""
    import yaml
    from hydra import compose, version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    search = create_config_search_path(str(dirs[0]))
    for d in dirs[1:]:
        search.prepend("command-line", f"file://{d}", anchor=SearchPathQuery(provider="schema"))
    backup = get_gh_backup()
    version.setbase("1.3")
    GlobalHydra.instance().clear()
    try:
        Hydra.create_main_hydra2(task_name="rlalign", config_search_path=search)
        return compose(config_name=name, overrides=overrides, return_hydra_config=return_hydra_config)
    except MissingConfigException as e:
        raise missing_config_error(e, dirs, name, overrides) from None
    except yaml.YAMLError as e:
        raise yaml_error(e) from None
    finally:
        restore_gh_from_backup(backup)


def missing_config_error(e: MissingConfigException, dirs: list[Path], name: str, overrides: list[str]) -> ConfigError:
    """One line for Hydra's missing option or primary config (without its search-path dump): the
    options that exist, closest first."""
    text = str(e)
    missing = re.search(r"Could not find '([^']+)'", text)
    if missing and "/" in missing[1]:
        group, option = missing[1].rsplit("/", 1)
        by = re.match(r"In '([^']+)'", text)
        on_line = any(o.split("=", 1)[0].lstrip("+~") == group for o in overrides)
        source = by and (name if _default_overrides(config_file(dirs, name)).get(group) == option else by[1])
        where = "" if on_line or not by else f" (in the defaults list of {config_file(dirs, source) or source})"
        return ConfigError(_no_option(dirs, group, option, where))
    if "Cannot find primary config" in text:
        names = [str(r.stem) for d in dirs for r in _yaml_files(d) if r.parent == Path()]
        return ConfigError(f"--config-name {name}: no {name}.yaml in {_dirs(dirs)}; the configs there, closest "
                           f"first: {', '.join(closest_first(name, sorted(set(names))))}")
    return ConfigError(text.split("\n")[0])


def _default_overrides(path: Path | None) -> dict[str, str]:
    """{group: option} of a config file's `- override GROUP: OPTION` defaults (Hydra names the file whose
    default such a line replaces, not the file holding it)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) if path else None
    except yaml.YAMLError:
        return {}
    defaults = data.get("defaults") if isinstance(data, dict) else None
    return {k.split(None, 1)[1].strip(): str(v) for d in defaults or [] if isinstance(d, dict) for k, v in d.items()
            if isinstance(k, str) and k.startswith("override ") and len(k.split(None, 1)) == 2}


def check_experiment_defaults(dirs: list[Path], name: str) -> None:
    """An experiment file (--config-name) composes onto rlalign's primary config: its defaults list holds
    `- config`. Without it the schema's sections are missing, and Hydra's errors name neither the file nor
    the fix. (A file that is not YAML is left to the composition, which names its line.)"""
    import yaml

    path = config_file(dirs, name) if name != PRIMARY else None
    if path is None:
        return
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return
    defaults = data.get("defaults") if isinstance(data, dict) else None
    names = [str(d).strip().lstrip("/").split("@")[0] for d in defaults or [] if isinstance(d, str)]
    if PRIMARY not in names:
        raise ConfigError(f"{path}: its defaults list lacks `- {PRIMARY}` (rlalign's primary config, which an "
                          f"experiment file composes onto): start it with `- {PRIMARY}`, then `- override GROUP: "
                          "OPTION` lines and `- _self_`")


def check_group_overrides(dirs: list[Path], overrides: list[str]) -> None:
    """Every GROUP=OPTION of the command line names an option on the search path (all of them in one
    ConfigError, before Hydra stops at the first)."""
    groups = group_options(dirs)
    problems = [_no_option(dirs, key, value, "") for key, value in
                (o.lstrip("+").split("=", 1) for o in overrides if "=" in o and not o.startswith("~"))
                if key in groups and value not in groups[key] and value not in ("null", "")]
    if problems:
        raise ConfigError("; ".join(problems))


def _no_option(dirs: list[Path], group: str, option: str, where: str) -> str:
    groups = group_options(dirs)
    if group not in groups:
        return f"{group}={option}: no config group {group!r}; the groups: {', '.join(closest_first(group, [*groups]))}"
    return (f"{group}={option}{where}: no such {group} option; the options, closest first: "
            f"{', '.join(closest_first(option, groups[group]))} ({group}/OPTION.yaml in {_dirs(dirs)})")


def yaml_error(e: yaml.YAMLError) -> ConfigError:
    """FILE:LINE:COLUMN: what the YAML parser found (a file Hydra could not read)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return ConfigError(f"invalid YAML: {' '.join(str(e).split())}")
    what = getattr(e, "problem", None) or getattr(e, "context", None)
    context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and what != context:
        what += f" ({context}{f' at line {at.line + 1}' if at else ''})"
    return ConfigError(f"{mark.name}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {what}")


def _dirs(dirs: list[Path]) -> str:
    return ", ".join(str(d) for d in dirs)
