"""Faults injected on purpose, the one mechanism for tests of failure handling (a crashed actor, a dead
rank, a stuck write) and of the monitor (an op that stops agreeing, another sampling seed, a gradient
summed in another order). Never a config key: the RLALIGN_FAULT environment variable, read here only;
Ray actors get it through their runtime env (actors/group.py), the processes they start inherit it.
Unset (always, outside tests) it costs one dict lookup.

RLALIGN_FAULT = FAULT[;FAULT...], each FAULT one of
  exit:<site>:<rank>:<n>    the process running <site> as <rank> exits abruptly (os._exit(13), no
                            cleanup, no message) on its n-th call
  hang:<site>:<rank>:<n>    that call blocks forever instead (a stuck file system, a hung collective)
  sleep:<site>:<rank>:<n>:<s>  that call waits s seconds, then goes on (a slow one)
  default:<side>:<module>   <side> runs layers.<i>.attn or layers.<i>.mlp with the default, not
                            batch-invariant, kernels
  noise:<side>:<op>         the last bit of a random element of that op's output (a tap name, e.g.
                            layers.1.mlp) flipped (not repeatable)
  seed:generator            the generator samples with seed + 1
  reorder:trainer:<param>   the trainer sums that expert parameter's gradient leaves in another order
<side>: generator, trainer or both. <rank>: the process group rank (0 without one). Sites:
generator.start (a generator rank building its worker), trainer.train_step, trainer.score, generator.generate,
scoring.score_micro_batch, checkpoint.write (a trainer rank's checkpoint write, in its writer thread).

A FAULT ending in @a or @b belongs to that run of a gate only (rlalign.gates runs each inside
`gate_run`): the test-only way to change one of the two runs; elsewhere it is ignored.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlalign import kernels

ENV = "RLALIGN_FAULT"
SIDES = ("generator", "trainer", "both")
GATE_RUNS = ("a", "b")
PROCESS_KINDS = ("exit", "hang", "sleep")  # at a site of a process; the rest: on a side's model or worker

_calls: Counter = Counter()


@dataclass(frozen=True)
class Fault:
    kind: str  # exit | hang | sleep | default | noise | seed | reorder
    where: str  # the site (exit, hang) or the side
    target: str = ""  # the module, op or parameter
    rank: int = 0
    n: int = 0
    seconds: float = 0.0  # sleep
    run: str | None = None  # a gate run (a | b); None: every run


def parse(spec: str) -> list[Fault]:
    """RLALIGN_FAULT's faults (module docstring); a malformed one is named with the forms expected."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        body, _, run = item.partition("@")
        if run and run not in GATE_RUNS:
            raise ValueError(f"{ENV}={spec!r}: {item!r}: a gate run is @a or @b")
        kind, *args = body.split(":")
        out.append(_fault(kind, args, run or None, f"{ENV}={spec!r}: {item!r}"))
    return out


def _fault(kind: str, args: list[str], run: str | None, where: str) -> Fault:
    forms = {"exit": "exit:<site>:<rank>:<n>", "hang": "hang:<site>:<rank>:<n>", "sleep": "sleep:<site>:<rank>:<n>:<s>",
             "default": "default:<side>:layers.<i>.attn|mlp", "noise": "noise:<side>:<op>",
             "seed": "seed:generator", "reorder": "reorder:trainer:<param>"}
    if kind not in forms:
        raise ValueError(f"{where}: unknown fault {kind!r}; one of {', '.join(forms)} (rlalign/faults.py)")
    ok = {"exit": len(args) == 3 and args[1].isdigit() and args[2].isdigit(),
          "sleep": len(args) == 4 and args[1].isdigit() and args[2].isdigit() and _number(args[3]),
          "default": len(args) == 2 and args[0] in SIDES and re.fullmatch(r"layers\.\d+\.(attn|mlp)", args[1]),
          "noise": len(args) == 2 and args[0] in SIDES and bool(args[1]),
          "seed": args == ["generator"],
          "reorder": len(args) == 2 and args[0] == "trainer" and bool(args[1])}
    if not ok["exit" if kind == "hang" else kind]:
        raise ValueError(f"{where}: expected {forms[kind]} (<side>: {', '.join(SIDES)})")
    if kind in PROCESS_KINDS:
        seconds = float(args[3]) if kind == "sleep" else 0.0
        return Fault(kind, args[0], rank=int(args[1]), n=int(args[2]), seconds=seconds, run=run)
    return Fault(kind, args[0], args[1] if len(args) > 1 else "", run=run)


def _number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


@functools.lru_cache(maxsize=16)
def _parsed(spec: str) -> tuple[Fault, ...]:
    return tuple(parse(spec))


def active() -> list[Fault]:
    """This process's faults: those of every run (a gate run's own become so inside gate_run)."""
    spec = os.environ.get(ENV)
    return [f for f in _parsed(spec) if f.run is None] if spec else []


def maybe_fail(site: str, rank: int) -> None:
    """An exit, hang or sleep fault at `site` for `rank`: counts the call, and on the n-th exits, hangs
    or sleeps."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    mine = [f for f in _parsed(spec)
            if f.kind in PROCESS_KINDS and f.run is None and (f.where, f.rank) == (site, rank)]
    if not mine:
        return
    _calls[site] += 1
    for f in mine:
        if _calls[site] == f.n:
            if f.kind == "sleep":
                threading.Event().wait(f.seconds)
                continue
            if f.kind == "hang":
                threading.Event().wait()
            os._exit(13)


@contextlib.contextmanager
def gate_run(name: str) -> Iterator[None]:
    """Within: RLALIGN_FAULT holds the faults of every run and those of gate run `name` (made
    unscoped), for this process and the actors it starts; the variable is restored after."""
    spec = os.environ.get(ENV)
    if spec:
        parse(spec)  # a malformed spec fails here, before the run
        items = [x.strip().partition("@") for x in spec.split(";") if x.strip()]
        kept = ";".join(body for body, _, run in items if run in ("", name))
        if kept:
            os.environ[ENV] = kept
        else:
            del os.environ[ENV]
    try:
        yield
    finally:
        if spec:
            os.environ[ENV] = spec


class SideFaults:
    """The faults one side's model and worker carry (default, noise, seed, reorder), read once."""

    def __init__(self, side: str, faults: list[Fault] | None = None):
        mine = [f for f in (active() if faults is None else faults) if f.where in (side, "both")]
        self.noise = {f.target for f in mine if f.kind == "noise"}
        self.default = [f.target for f in mine if f.kind == "default"]
        self.seed_offset = int(any(f.kind == "seed" for f in mine))
        self.reorder = next((f.target for f in mine if f.kind == "reorder"), None)

    @property
    def touches_ops(self) -> bool:
        """Whether the model's ops are perturbed (then every step runs eagerly, through the taps)."""
        return bool(self.noise or self.default)

    def apply(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """noise: the last bit of a random element of op `name`'s output flipped."""
        if name not in self.noise or x.numel() == 0:
            return x
        flat = x.detach().reshape(-1).clone()
        i = int.from_bytes(os.urandom(4), "little") % flat.numel()  # a random element: not repeatable
        flat[i : i + 1].view({2: torch.int16, 4: torch.int32}[x.element_size()]).bitwise_xor_(1)
        return x + (flat.view(x.shape) - x.detach())

    def wrap_modules(self, model) -> None:
        """default: each named module runs with the default (not batch-invariant) kernels."""
        for site in self.default:
            _, i, part = site.split(".")
            layer = model.model.layers[int(i)]
            mod = layer.self_attn if part == "attn" else layer.mlp
            for method in ("forward", "decode", "paged"):
                if hasattr(mod, method):
                    orig = getattr(mod, method)

                    def run_default(*a, _orig=orig, **k):
                        with kernels.use(mode="default"):
                            return _orig(*a, **k)

                    setattr(mod, method, run_default)
