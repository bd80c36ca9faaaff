"""`rlalign compare A B`: the first differing fingerprint record of two traces, or of two runs.

A trace resumed in its own run dir continues the interrupted run's stream and compares record by
record with the uninterrupted run's. One resumed into a new run dir (its header's start_step > 0)
lacks the earlier steps: the other stream is compared from that step on, plus the records of
earlier steps that the resumed run re-recorded (the checkpoint's weights), by step and name.

Two run directories are compared the way the baseline gate compares them, segment-aware:
- Streams are per rank, and a run resumed at another EP size leaves the streams of ranks its
  later segments do not have (segments.jsonl, rlalign.rundir): of such a stream only the records
  of the segments that had the rank count; the rest, written by an interrupted earlier segment,
  are stale and left out (named in a note).
- A role (trainer, generator) whose EP size differs between or within the runs splits its batch
  differently, so its per-call records are not comparable. With trainer.topology_invariant the
  trainer's state records (gradients, AdamW moments, weights per global expert) are, and are
  compared by (step, name) across all its ranks; the generator's results reach the comparison
  through the other role's streams.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlalign.generator_world import generator_world
from rlalign.monitor.divergence import first_divergence
from rlalign.monitor.trace import TraceError, align_resumed, env_difference, first_differing_record, flatten, read_trace
from rlalign.rundir import read_segments

ROLES = ("generator", "trainer")
Stream = tuple[dict, list[dict]]  # (header, records)


def _describe(rec: dict | None) -> str:
    if rec is None:
        return "(no record: the stream ended)"
    return f"step {rec['step']} rank {rec['rank']} {rec['name']} {rec['dtype']}{rec['shape']} fp {rec['fp']}"


def compare_files(a: Path, b: Path, out=None) -> bool:
    return compare_streams(read_trace(a), read_trace(b), a.name, out) is None


def compare_streams(sa: Stream, sb: Stream, label: str, out=None, allowed: tuple[str, ...] = ()) -> dict | None:
    """Print how two streams compare (the first difference, or 'identical'); the first
    divergence (trace.first_differing_record), None if identical. Environment keys under `allowed`
    may differ without a note."""
    (ha, ra), (hb, rb) = sa, sb
    if (ha.get("role"), ha.get("rank")) != (hb.get("role"), hb.get("rank")):
        print(f"note: different streams: {ha.get('role')} rank {ha.get('rank')} vs {hb.get('role')} rank "
              f"{hb.get('rank')}", file=out)
    diff = env_difference(ha["env"], hb["env"], allowed)
    if diff:
        fa, fb = flatten(ha["env"]), flatten(hb["env"])
        print("these traces come from different runs/configs, so they need not match: "
              + "; ".join(f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in diff[:5])
              + (f" (+{len(diff) - 5} more)" if len(diff) > 5 else ""), file=out)
    ra, rb, notes = align_resumed(ha, ra, hb, rb)
    for note in notes:
        print(f"note ({label}): {note}", file=out)
    d = first_differing_record(ra, rb)
    if d is None:
        print(f"identical: {len(ra)} records ({label})", file=out)
        return None
    print(f"first difference at record {d['index']} ({label}):", file=out)
    print(f"  A: {_describe(d['a'])}", file=out)
    print(f"  B: {_describe(d['b'])}", file=out)
    if d["step_first"]:
        print(f"  inputs: it is step {(d['a'] or d['b'])['step']}'s first record in this stream; its inputs come from "
              f"the previous step or the other group", file=out)
    else:
        prev = f"the previous record ({d['previous']}) matched" if d["previous"] else "it is the first record"
        print(f"  inputs matched: {'yes' if d['inputs_matched'] else 'no'} ({prev})", file=out)
    return d


# --- run directories --------------------------------------------------------------------------------
def world(config: dict, role: str) -> int:
    """The number of `role` ranks (trace streams) a run with this config has."""
    return generator_world(config).ranks if role == "generator" else int(config[role]["ep_size"])


def ep_sizes(run_dir: Path, role: str) -> set[int]:
    """The EP sizes `role` ran at over the run's segments (from the trace headers without
    segments.jsonl: a run from before it)."""
    segs = read_segments(run_dir)
    if segs:
        return {int(s["config"][role]["ep_size"]) for s in segs}
    heads = [read_trace(p)[0] for p in sorted((Path(run_dir) / "traces").glob(f"{role}-rank*.jsonl"))]
    return {int(h["env"]["topology"][f"{role}_ep"]) for h in heads if "topology" in h.get("env", {})}


def run_streams(run_dir: Path) -> tuple[dict[str, Stream], list[str]]:
    """Every trace stream of a run, each without the stale records of segments that did not have
    its rank, and a note per stream that lost records (module docstring)."""
    segs = read_segments(run_dir)
    streams, notes = {}, []
    for path in sorted((Path(run_dir) / "traces").glob("*.jsonl")):
        header, recs = read_trace(path)
        role, rank = header.get("role"), header.get("rank")
        if segs and role in ROLES and isinstance(rank, int):
            had = [(s["start_step"], rank < world(s["config"], role)) for s in segs]
            kept = [r for r in recs if _counted(r["step"], had)]
            if len(kept) < len(recs):
                stale = sorted({r["step"] for r in recs if not _counted(r["step"], had)})
                notes.append(f"{path.name} of {run_dir}: {len(recs) - len(kept)} stale record(s) of step(s) "
                             f"{stale[0]}..{stale[-1]} left out (written by a segment that the run's segments.jsonl "
                             f"does not count for {role} rank {rank})")
            if not kept:
                continue
            recs = kept
        streams[path.name] = (header, recs)
    return streams, notes


def _counted(step: int, had: list[tuple[int, bool]]) -> bool:
    """Whether a record of `step` belongs to a segment that had the stream's rank; `had`: (start
    step, has the rank) per segment, in order."""
    i = sum(start <= step for start, _ in had) - 1  # the segment that ran `step`
    if i < 0:
        return True  # before the first recorded segment: nothing known
    # a segment also re-records the step before its start (the checkpoint's weights)
    return had[i][1] or (i + 1 < len(had) and step == had[i + 1][0] - 1 and had[i + 1][1])


def trainer_state(streams: dict[str, list[dict]], from_step: int = 0) -> dict[tuple[int, str], dict]:
    """The 'state/' records of all trainer ranks by (step, name): with trainer.topology_invariant
    their names (per global expert) and values do not depend on the trainer EP size."""
    out = {}
    for name, recs in streams.items():
        if name.startswith("trainer"):
            for r in recs:
                if r["step"] >= from_step and r["name"].startswith("state/"):
                    out[(r["step"], r["name"])] = r
    return out


def first_differing_state(ta: dict, tb: dict) -> tuple[int, str] | None:
    """The first (step, name) whose trainer state record differs or is in one run only
    (divergence.first_divergence over the sorted keys)."""

    def differ(key: tuple[int, str]) -> bool:
        ra, rb = ta.get(key), tb.get(key)
        return ra is None or rb is None or (ra["fp"], ra["shape"], ra["dtype"]) != (rb["fp"], rb["shape"], rb["dtype"])

    return first_divergence(sorted(set(ta) | set(tb)), differ)


def state_difference_line(key: tuple[int, str], ta: dict, tb: dict) -> str:
    where = "only in a" if key not in tb else "only in b" if key not in ta else "fingerprints differ"
    return f"trainer state first differs at step {key[0]} {key[1]} ({where}; compared across trainer EP sizes)"


def _invariant(streams: dict[str, Stream]) -> bool:
    heads = [h for name, (h, _) in streams.items() if name.startswith("trainer")]
    return bool(heads) and all(flatten(h["env"]).get("trainer.topology_invariant") for h in heads)


def compare_runs(a: Path, b: Path, out=None) -> bool:
    """Print how two run directories compare, stream by stream (module docstring); True if equal."""
    (sa, na), (sb, nb) = run_streams(a), run_streams(b)
    if not sa or not sb:
        raise TraceError(f"no traces under {a}/traces or {b}/traces (monitor.fingerprints=off?)")
    for note in na + nb:
        print(f"note: {note}", file=out)
    split = {role for role in ROLES if len(ep_sizes(a, role) | ep_sizes(b, role)) > 1}
    allowed = tuple(k for role in sorted(split) for k in (f"{role}.ep_size", f"topology.{role}_ep"))
    firsts: list[tuple[int, int, str]] = []  # (step, stage, name) of each stream's first difference
    for name in sorted(set(sa) & set(sb)):
        if name.split("-")[0] not in split:
            d = compare_streams(sa[name], sb[name], name, out, allowed)
            if d is not None:
                rec = d["a"] or d["b"]
                firsts.append((rec["step"], _stage(name, rec["name"]), rec["name"]))
    for name in sorted(set(sa) ^ set(sb)):
        if name.split("-")[0] not in split:
            print(f"{name}: only in {'A' if name in sa else 'B'}", file=out)
    sizes = {role: f"EP {sorted(ep_sizes(a, role))} vs {sorted(ep_sizes(b, role))}" for role in split}
    if "trainer" in split:
        if _invariant(sa) and _invariant(sb):
            ta = trainer_state({k: r for k, (_, r) in sa.items()})
            tb = trainer_state({k: r for k, (_, r) in sb.items()})
            key = first_differing_state(ta, tb)
            if key is None:
                print(f"identical: trainer state (gradients, AdamW moments, weights per global expert) across the "
                      f"trainer EP sizes ({sizes['trainer']})", file=out)
            else:
                firsts.append((key[0], 1, key[1]))
                print(state_difference_line(key, ta, tb), file=out)
        else:
            print(f"trainer streams not compared: the trainer EP sizes differ ({sizes['trainer']}) and "
                  "trainer.topology_invariant is off, so the trainer's bits depend on them", file=out)
    if "generator" in split:
        print(f"generator streams not compared: the generator EP sizes differ ({sizes['generator']}); its tokens "
              f"and logprobs reach the trainer's streams", file=out)
    if firsts:
        print(f"first divergence: {min(firsts)[2]} (step {min(firsts)[0]})", file=out)
    return not firsts


def _stage(stream: str, name: str) -> int:
    """Order within a step: generation 0, training 1, the weight sync after it 2."""
    return 2 if name.startswith("weights/") else 0 if stream.startswith("generator") else 1


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: rlalign compare TRACE_A TRACE_B   (two trace files, or two run directories)", file=sys.stderr)
        return 2
    a, b = Path(argv[0]), Path(argv[1])
    for p in (a, b):
        if not p.exists():
            print(f"rlalign compare: {p}: no such run directory or trace file", file=sys.stderr)
            return 2
        if (p / "batch.json").is_file():
            print(f"rlalign compare: {p}: a mismatch dump, not a run directory: its run directory holds the traces "
                  f"({p.parent}); replay the dump with rlalign agree agree.replay={p}", file=sys.stderr)
            return 2
    if a.is_dir() != b.is_dir():
        print(f"rlalign compare: {a} and {b}: compare two run directories or two trace files, not one of each",
              file=sys.stderr)
        return 2
    try:
        if a.is_dir() and b.is_dir():
            return 0 if compare_runs(a, b) else 1
        return 0 if compare_files(a, b) else 1
    except (TraceError, ValueError) as e:
        print(f"rlalign compare: {e}", file=sys.stderr)
        return 2
