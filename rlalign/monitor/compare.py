"""`rlalign compare A B`: the first differing fingerprint record of two traces (or run dirs).

A trace resumed in its own run dir continues the interrupted run's stream and compares record by
record with the uninterrupted run's. One resumed into a new run dir (its header's start_step > 0)
lacks the earlier steps: the other stream is compared from that step on, plus the records of
earlier steps that the resumed run re-recorded (the checkpoint's weights), by step and name.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlalign.monitor.trace import TraceError, align_resumed, env_difference, first_divergence, flatten, read_trace


def _describe(rec: dict | None) -> str:
    if rec is None:
        return "(no record: the stream ended)"
    return f"step {rec['step']} rank {rec['rank']} {rec['name']} {rec['dtype']}{rec['shape']} fp {rec['fp']}"


def compare_files(a: Path, b: Path, out=sys.stdout) -> bool:
    ha, ra = read_trace(a)
    hb, rb = read_trace(b)
    same = True
    if (ha.get("role"), ha.get("rank")) != (hb.get("role"), hb.get("rank")):
        print(f"note: different streams: {ha.get('role')} rank {ha.get('rank')} vs {hb.get('role')} rank "
              f"{hb.get('rank')}", file=out)
    diff = env_difference(ha["env"], hb["env"])
    if diff:
        fa, fb = flatten(ha["env"]), flatten(hb["env"])
        print("these traces come from different runs/configs, so they need not match: "
              + "; ".join(f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in diff[:5])
              + (f" (+{len(diff) - 5} more)" if len(diff) > 5 else ""), file=out)
    ra, rb, notes = align_resumed(ha, ra, hb, rb)
    for note in notes:
        print(f"note ({a.name}): {note}", file=out)
    d = first_divergence(ra, rb)
    if d is None:
        print(f"identical: {len(ra)} records ({a.name})", file=out)
        return same
    print(f"first difference at record {d['index']} ({a.name}):", file=out)
    print(f"  A: {_describe(d['a'])}", file=out)
    print(f"  B: {_describe(d['b'])}", file=out)
    if d["step_first"]:
        print(f"  inputs: it is step {(d['a'] or d['b'])['step']}'s first record in this stream; its inputs come from "
              f"the previous step or the other group", file=out)
    else:
        prev = f"the previous record ({d['previous']}) matched" if d["previous"] else "it is the first record"
        print(f"  inputs matched: {'yes' if d['inputs_matched'] else 'no'} ({prev})", file=out)
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: rlalign compare TRACE_A TRACE_B   (two trace files, or two run directories)", file=sys.stderr)
        return 2
    a, b = Path(argv[0]), Path(argv[1])
    try:
        if a.is_dir() and b.is_dir():
            sa = {p.name: p for p in (a / "traces").glob("*.jsonl")}
            sb = {p.name: p for p in (b / "traces").glob("*.jsonl")}
            if not sa or not sb:
                print(f"rlalign compare: no traces under {a}/traces or {b}/traces", file=sys.stderr)
                return 2
            ok = True
            for name in sorted(set(sa) & set(sb)):
                ok = compare_files(sa[name], sb[name]) and ok
            for name in sorted(set(sa) ^ set(sb)):
                print(f"{name}: only in {'A' if name in sa else 'B'}")
            return 0 if ok else 1
        return 0 if compare_files(a, b) else 1
    except TraceError as e:
        print(f"rlalign compare: {e}", file=sys.stderr)
        return 2
