"""Every config key that `rlalign CMD --help` lists is in the schema and read by CMD's code, found
statically: in the modules CMD's module imports (at any depth, lazily too), other than the schema's
validation (rlalign.config) and the help itself (rlalign.cli), an attribute chain that ends in the
key (`cfg.task.max_new_tokens`), an alias of its section (`t = cfg.task` ... `t.max_new_tokens`),
`cfg[side].ep_size` with the section's name among the function's strings, or
`keys_of(SomeConfig, cfg.section)` where SomeConfig has the field, or `section.get("leaf")` on a
section passed in (any section with that leaf: the loosest rule). A name in a string (an error
message) does not count. Negative twins: keys whose readers the command does not import, and a key
that left the schema."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlalign import cli, config
from rlalign.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"rlalign": ROOT / "rlalign", "rlalign.kernels": ROOT / "kernels", "rlalign.actors": ROOT / "actors"}
COMMAND_MODULES = {"train": "rlalign.rl", "agree": "rlalign.agree", "gate": "rlalign.gates"}
NOT_READERS = {"rlalign.config", "rlalign.cli"}  # validation and help mention keys without using them


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _imported(name: str, tree: ast.AST, known: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        bases = []
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(name.split(".")[: -node.level] + ([node.module] if node.module else []))
            bases = [f"{base}.{a.name}" for a in node.names] + [base]
        for b in bases:
            while b and b not in known:
                b = b.rpartition(".")[0]
            if b:
                out.add(b)
    return out


def closure(root: str) -> dict[str, ast.AST]:
    """The parsed modules of ours that `root` imports, directly or not (root included)."""
    files = _modules()
    trees, todo = {}, [root]
    while todo:
        name = todo.pop()
        if name in trees:
            continue
        trees[name] = ast.parse(files[name].read_text())
        todo += sorted(_imported(name, trees[name], set(files)) - set(trees))
    return trees


def _chain(node: ast.AST) -> list[str]:
    """`cfg.task.kwargs` -> ['cfg', 'task', 'kwargs']; a subscript or call ends the chain with '[]'."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    out.append(node.id if isinstance(node, ast.Name) else "[]")
    return out[::-1]


def _config_fields(cls_name: str) -> set[str]:
    cls = getattr(config, cls_name, None)
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def reads(tree: ast.AST) -> set[str]:
    """The dotted key suffixes a module reads: 'task.max_new_tokens'; under a subscript, each string
    of the function as the section ('trainer.ep_size'); keys_of's fields; '*.leaf' for .get('leaf')."""
    out = set()
    for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]:
        aliases = {}  # t = cfg.task -> {'t': 'task'}
        strings = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and isinstance(node.value, ast.Attribute):
                aliases[node.targets[0].id] = ".".join(_chain(node.value)[1:])
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute):
                chain = _chain(node)
                if chain[0] in aliases:
                    chain = [chain[0], *aliases[chain[0]].split("."), *chain[1:]]
                out.add(".".join(chain[1:]))
                if chain[0] == "[]" and len(chain) == 2:
                    out |= {f"{s}.{chain[1]}" for s in strings}
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.add(f"*.{node.args[0].value}")  # node.get('leaf', default) on a section passed in
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "keys_of" and len(node.args) == 2:
                section = ".".join(_chain(node.args[1])[1:])
                out |= {f"{section}.{f}" for f in _config_fields(getattr(node.args[0], "id", ""))}
    return out


def unread_keys(cmd: str, keys: list[str]) -> list[str]:
    """The keys of `keys` that are not in the schema or that no module of `cmd` reads."""
    schema = OmegaConf.to_container(load_config([]), resolve=False)
    read = set().union(*(reads(t) for name, t in closure(COMMAND_MODULES[cmd]).items() if name not in NOT_READERS))
    bad = []
    for key in keys:
        node = schema
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        in_schema = node is not KeyError
        # a read is the key's chain or its tail from a section on (`self.cfg.run.steps` reads 'run.steps')
        leaf = "*." + key.rpartition(".")[2]
        if not in_schema or not (leaf in read or any(r == key or r.endswith("." + key) for r in read)):
            bad.append(key)
    return bad


@pytest.mark.parametrize("cmd", sorted(COMMAND_MODULES))
def test_every_key_the_help_lists_is_read_by_the_command(cmd):
    keys = cli.help_keys(cmd)
    assert keys and f"  {keys[0]} " in cli.help_text(cmd)
    assert unread_keys(cmd, keys) == []


def test_negative_twins_keys_only_another_command_reads_and_a_removed_key():
    assert unread_keys("agree", ["task.num_prompts", "run.overwrite", "checkpoint.every"]) == [
        "task.num_prompts", "run.overwrite", "checkpoint.every"]  # train's keys: agree reads none of them
    assert unread_keys("train", ["agree.max_new_tokens", "gate.candidate"]) == ["agree.max_new_tokens",
                                                                                 "gate.candidate"]
    assert unread_keys("agree", ["generator.max_new_tokens"]) == ["generator.max_new_tokens"]  # not in the schema
    assert unread_keys("agree", ["agree.max_new_tokens", "generator.top_p"]) == []  # twin: read (keys_of)


def test_the_completion_length_is_one_key_per_command_and_the_old_one_is_refused_naming_the_new():
    with pytest.raises(ConfigError) as e:
        load_config(["generator.max_new_tokens=8"])
    msg = str(e.value)
    assert msg.startswith("generator.max_new_tokens (in the command line) is no longer a config key: ")
    assert "task.max_new_tokens in `rlalign train`" in msg and "agree.max_new_tokens in `rlalign agree`" in msg
    cfg = load_config([])
    assert "max_new_tokens" not in cfg.generator and (cfg.task.max_new_tokens, cfg.agree.max_new_tokens) == (5, 48)
    assert load_config(["task=add"]).task.max_new_tokens == 8 and load_config(["task=jsonl", "task.path=x"]) \
        .task.max_new_tokens == 48
    assert "generator.max_new_tokens" not in cli.help_text("train") + cli.help_text("agree")
    assert "task.max_new_tokens" in cli.help_keys("train") and "agree.max_new_tokens" in cli.help_keys("agree")
    assert "task.max_new_tokens" not in cli.help_keys("agree") and "agree.max_new_tokens" not in cli.help_keys("train")
