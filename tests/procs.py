"""Processes as /proc shows them (Linux): a process tree, which of it is alive, a command line. The tests' views of
what a run or a cluster left running."""

from __future__ import annotations

import os
from pathlib import Path


def proc_stat(pid):
    """(state, parent pid) of a process from /proc, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[1])  # state, ppid
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    """Every process below `root` (children, their children, ...), from /proc."""
    children = {}
    for p in os.listdir("/proc"):
        if p.isdigit() and (s := proc_stat(p)):
            children.setdefault(s[1], []).append(int(p))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pids) -> list[int]:
    return [p for p in pids if (s := proc_stat(p)) and s[0] != "Z"]


def cmdline(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"
