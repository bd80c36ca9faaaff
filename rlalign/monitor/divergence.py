"""Per-token divergence between the generator and the trainer, from per-row fingerprints.

Both sides fingerprint every op's output row keyed by (sample id, position). For a token whose
logprobs differ (predicted from the row at position p), the first divergence is the earliest op,
in model order, at which any row of that sequence at a position <= p differs between the two
sides: where the mismatch was born, before attention spread it to later positions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TypeVar

from rlalign.model.args import ModelArgs

Table = dict[tuple[int, int], dict[str, int]]
K = TypeVar("K")


def tap_order(args: ModelArgs) -> list[str]:
    names = ["embed"]
    for i in range(args.num_layers):
        names += [f"layers.{i}.attn_norm", f"layers.{i}.attn", f"layers.{i}.mlp_norm"]
        if args.is_moe_layer(i):
            names.append(f"layers.{i}.router")
        names += [f"layers.{i}.mlp", f"layers.{i}"]
    return names + ["norm", "logits"]


def first_divergence(keys: Iterable[K], differ: Callable[[K], bool]) -> K | None:
    """The first key, in the order given, at which the two sides differ: the one definition of a first
    divergence (trace records by index: trace.first_differing_record; trainer state by (step, name):
    compare.first_differing_state; a token's rows by (op, position): first_divergent_tap)."""
    return next((k for k in keys if differ(k)), None)


def first_divergent_tap(gen: Table, train: Table, sample_id: int, position: int,
                        taps: list[str]) -> tuple[str, int] | None:
    """(op, position) of the first differing row fingerprint for this token (ops in model order, then
    positions <= `position`; rows only one side computed do not count), or None."""

    def differ(key: tuple[str, int]) -> bool:
        tap, p = key
        g = gen.get((sample_id, p), {}).get(tap)
        t = train.get((sample_id, p), {}).get(tap)
        return g is not None and t is not None and g != t

    return first_divergence(((tap, p) for tap in taps for p in range(position + 1)), differ)


def divergence_by_op(gen: Table, train: Table, taps: list[str]) -> dict[str, int]:
    """How many token rows differ at each op (rows both sides computed)."""
    out = dict.fromkeys(taps, 0)
    for key, g in gen.items():
        t = train.get(key)
        if t is None:
            continue
        for tap in taps:
            if tap in g and tap in t and g[tap] != t[tap]:
                out[tap] += 1
    return out


def locate_mismatches(gen: Table, train: Table, mismatched: list[tuple[int, int]], taps: list[str]) -> dict:
    """Where each mismatched token's divergence began (its first divergent op), how many began at each
    op, and the differing rows per op. mismatched: (sample id, logits row position) of each token whose
    logprobs differ."""
    firsts = [first_divergent_tap(gen, train, s, p, taps) for s, p in mismatched]
    named = [f for f in firsts if f is not None]
    counts = Counter(op for op, _ in named)
    return {
        "first_divergent_op": min(named, key=lambda f: (taps.index(f[0]), f[1]))[0] if named else None,
        "first_op_counts": dict(counts),
        "tokens": [{"sample_id": s, "position": p, "first_op": f[0] if f else None, "at_position": f[1] if f else None}
                   for (s, p), f in zip(mismatched, firsts)],
        "by_op": divergence_by_op(gen, train, taps),
    }
