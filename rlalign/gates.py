"""The three determinism gates and run comparison.

    repeatability  the same fixed environment twice -> every step's metrics and fingerprints equal
    baseline       the reference path vs a candidate path (gate.candidate overrides, e.g. another
                   generator EP size, the triton backend) -> equal
    replay         resume from the checkpoint after step k -> equal to the uninterrupted run from k+1

Each gate runs `rlalign train` twice into RUN_DIR/gate-<name>/{a,b} (per-op fingerprints on,
monitor.fingerprints=layers, so a failure names its op) and compares: first the fixed
environment of the two runs (refusing to compare if it differs beyond what the gate changes),
then metrics.jsonl (time/* and memory/* excluded: they measure the run, seconds and bytes, and a
resumed process allocates otherwise), then every per-rank trace stream record by record (without
the stale records of segments that did not have the stream's rank: rlalign.monitor.compare). In a
multi-turn run (task.env) the generator's per-step op records (gen.step.*) are left out: which rows
an engine step runs depends on when the environments answer; its per-token records (tokens,
logprobs) and the trainer's per-op records are compared.
A test changes one run only through a fault of that run (RLALIGN_FAULT='...@b': rlalign.faults).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlalign import faults
from rlalign.config import load_config
from rlalign.config_search import ConfigError, ConfigSource
from rlalign.monitor.compare import first_differing_state, run_streams, state_difference_line, trainer_state
from rlalign.monitor.trace import env_difference, first_differing_record
from rlalign.rl import MismatchError, train

GATES = ("repeatability", "baseline", "replay")
STEP_RECORDS = "gen.step."  # the generator's per-engine-step op records (rlalign.rollout.native.runner)


class GateRefused(ValueError):
    pass


MEASURED = ("time/", "memory/")  # metrics that measure the run (seconds, bytes), not what it computed


@dataclass
class Comparison:
    ok: bool = True
    lines: list[str] = field(default_factory=list)
    first_op: str | None = None


def _metrics(run: Path, from_step: int) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (did the run finish a step?)")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows if r["step"] >= from_step]


def compare_runs(a: Path, b: Path, from_step: int = 0, allowed_env: tuple[str, ...] = ()) -> Comparison:
    (sa, _), (sb, _) = run_streams(a), run_streams(b)
    if not sa or not sb:
        raise FileNotFoundError(f"no traces under {a}/traces or {b}/traces (monitor.fingerprints=off?)")
    # the fixed environment must match (beyond what the gate itself changes)
    ha = next(iter(sa.values()))[0]["env"]
    hb = next(iter(sb.values()))[0]["env"]
    diff = env_difference(ha, hb, allowed_env)
    if diff:
        fa, fb = _flat(ha), _flat(hb)
        raise GateRefused("the two runs' fixed environments differ, so bitwise equality is not promised: "
                          + "; ".join(f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in diff[:5]))
    res = Comparison()
    ma, mb = _metrics(a, from_step), _metrics(b, from_step)
    for ra, rb in zip(ma, mb):
        keys = [k for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)]
        if keys:
            res.ok = False
            res.lines.append(f"metrics: step {ra['step']} differs first in {keys[0]!r}: {ra.get(keys[0])!r} vs "
                             f"{rb.get(keys[0])!r} ({len(keys)} keys differ)")
            break
    if len(ma) != len(mb):
        res.ok = False
        res.lines.append(f"metrics: {len(ma)} vs {len(mb)} steps")
    firsts = {}
    # a role whose EP size differs splits its batch differently: its per-call records are not
    # comparable (its per-token results are, through the metrics and the other role's streams)
    skip = tuple(role for role in ("generator", "trainer") if f"topology.{role}_ep" in allowed_env)
    invariant = all(_flat(h).get("trainer.topology_invariant") for h in (ha, hb))
    trainer_step = None
    for name in sorted(n for n in set(sa) | set(sb) if n.startswith(skip)):
        if not (name.startswith("trainer") and invariant):
            res.lines.append(f"trace {name}: not compared ({name.split('-')[0]} EP size differs between the runs)")
    if "trainer" in skip and invariant:  # topology-invariant training: its state is comparable as a whole
        ta = trainer_state({n: r for n, (_, r) in sa.items()}, from_step)
        tb = trainer_state({n: r for n, (_, r) in sb.items()}, from_step)
        key = first_differing_state(ta, tb)
        if key is not None:
            res.ok = False
            res.lines.append(state_difference_line(key, ta, tb))
            trainer_step, res.first_op = key
        else:
            res.lines.append("trainer state (gradients, AdamW moments, weights per global expert): identical "
                             "across the trainer EP sizes")
    episodes = all(_flat(h).get("task.env") for h in (ha, hb))
    if episodes:
        res.lines.append(f"generator records {STEP_RECORDS}*: not compared (a multi-turn step's rows depend on when "
                         "the environments answer)")

    def compared(r: dict) -> bool:
        return r["step"] >= from_step and not (episodes and r["name"].startswith(STEP_RECORDS))

    for name in sorted(n for n in set(sa) & set(sb) if not n.startswith(skip)):
        ra, rb = [r for r in sa[name][1] if compared(r)], [r for r in sb[name][1] if compared(r)]
        d = first_differing_record(ra, rb)
        if d is not None:
            firsts[name] = d
    for name in sorted(n for n in set(sa) ^ set(sb) if not n.startswith(skip)):
        res.lines.append(f"trace {name}: only in {'a' if name in sa else 'b'} (compared the common streams)")
    if firsts:
        res.ok = False
        origin = _origin(firsts)
        for name, d in sorted(firsts.items(), key=lambda kv: (_step(kv[1]), kv[0])):
            rec = d["a"] or d["b"]
            tag = "  <- the first divergence" if name == origin else ""
            if d["step_first"]:
                inputs = "the step's first record: its inputs come from the previous step or the other group"
            else:
                inputs = f"its input, {d['previous']!r}, matched: the op itself diverged"
            res.lines.append(f"trace {name}: first difference at record {d['index']}: step {rec['step']} "
                             f"{rec['name']} {rec['dtype']}{rec['shape']} ({inputs}){tag}")
        rec = firsts[origin]["a"] or firsts[origin]["b"]
        # a trainer-state difference of the same step comes first unless the stream diverged
        # before the weight sync (the synced weights are downstream of the trainer's update)
        stage = 2 if rec["name"].startswith("weights/") else 0  # generation 0, training 1, weight sync 2
        if res.first_op is None or (rec["step"], stage) < (trainer_step, 1):
            res.first_op = rec["name"]
    return res


def _step(d: dict) -> int:
    return (d["a"] or d["b"])["step"]


def _origin(firsts: dict[str, dict]) -> str:
    """The stream where the divergence began: earliest step; within it the generator (whose
    output the trainer consumes) before the trainer."""
    return min(firsts, key=lambda n: (_step(firsts[n]), 0 if n.startswith("generator") else 1, n))


def _flat(d: dict, p: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{p}{k}.") if isinstance(v, dict) else {f"{p}{k}": v})
    return out


def _train(cfg: DictConfig, run_dir: Path, extra: list[str], source: ConfigSource | None) -> None:
    """One of the gate's runs, into run_dir (a or b): with the faults of every run and its own
    (rlalign.faults.gate_run: a test's way to change one run only)."""
    with faults.gate_run(run_dir.name):
        train(load_config([*extra, f"run.dir={run_dir}"], source=source))


def run_gate(kind: str, overrides: list[str], cfg: DictConfig,
             source: ConfigSource | None = None) -> tuple[bool, str]:
    """Run one gate (both runs on one Ray cluster: RAY_ADDRESS's, else a private one; each run's config
    composed from `source`, as cfg was); returns (passed, the report's text)."""
    from rlalign import cluster

    if kind not in GATES:
        raise ValueError(f"unknown gate {kind!r}; one of {', '.join(GATES)}")
    if kind == "replay":
        replay_resume_step(cfg)  # a refusal comes before Ray starts
    common, candidate = _gate_overrides(kind, overrides, cfg)
    if candidate:  # a candidate the config refuses is named before the reference run, not after it
        try:
            load_config([*common, *candidate], source=source)
        except ValueError as e:
            raise ConfigError(f"gate.candidate={candidate}: {e}") from None
    initialized = cluster.connect(cfg.placement.num_cpus)
    try:
        return _run_gate(kind, overrides, cfg, source)
    finally:
        cluster.disconnect(initialized)


def replay_resume_step(cfg: DictConfig) -> int:
    """The replay gate's first resumed step k: the second run resumes from the checkpoint of step k - 1
    (gate.replay_step, default run.steps // 2 - 1) and must equal the first from step k on."""
    steps, step = cfg.run.steps, cfg.gate.replay_step
    if step is None and steps < 2:
        raise ValueError(f"gate replay: run.steps={steps}: needs run.steps >= 2 (one step before the resume and one "
                         "after it to compare)")
    k = step + 1 if step is not None else steps // 2
    if not 0 < k < steps:
        raise ValueError(f"gate.replay_step={step}: must be in [0, run.steps-2] (run.steps={steps})")
    return k


def _run_gate(kind: str, overrides: list[str], cfg: DictConfig, source: ConfigSource | None) -> tuple[bool, str]:
    """The gate's runs and their comparison; a run that stops at a generator/trainer mismatch (deterministic
    kernels, monitor.on_mismatch=raise) is a FAIL naming it, as a divergence between the runs is."""
    try:
        return _gate_runs(kind, overrides, cfg, source)
    except MismatchError as e:
        base = Path(cfg.run.dir) / f"gate-{kind}"
        return False, (f"gate {kind}: FAIL (a run stopped: its generator and trainer disagree; {cfg.run.steps} steps; "
                       f"runs in {base})\n  {e}")


def _gate_overrides(kind: str, overrides: list[str], cfg: DictConfig) -> tuple[list[str], list[str]]:
    """Both runs' overrides (the command line's, less run.dir and gate.*, with every layer's fingerprints, no
    resume and the steps), and the candidate run's own (gate.candidate, for the baseline gate)."""
    common = [o for o in overrides if not o.startswith(("run.dir=", "gate."))]
    common += ["monitor.fingerprints=layers", "checkpoint.resume=never", f"run.steps={cfg.run.steps}"]
    return common, list(OmegaConf.to_container(cfg.gate.candidate)) if kind == "baseline" else []


def _gate_runs(kind: str, overrides: list[str], cfg: DictConfig, source: ConfigSource | None) -> tuple[bool, str]:
    base = Path(cfg.run.dir) / f"gate-{kind}"
    if base.exists():
        shutil.rmtree(base)
    a, b = base / "a", base / "b"
    common, candidate = _gate_overrides(kind, overrides, cfg)
    from_step, allowed = 0, ()
    if kind == "replay":
        k = replay_resume_step(cfg)
        _train(cfg, a, [*common, f"checkpoint.every={k}", "checkpoint.keep=0"], source)
        src = a / "checkpoints" / f"step_{k - 1:06d}"
        (b / "checkpoints").mkdir(parents=True)
        shutil.copytree(src, b / "checkpoints" / src.name)
        shutil.copy(a / "metrics.jsonl", b / "metrics.jsonl")
        shutil.copytree(a / "traces", b / "traces")
        _train(cfg, b, [*common, *candidate, "checkpoint.resume=auto", f"checkpoint.every={k}", "checkpoint.keep=0"],
               source)
        from_step = k
    else:
        _train(cfg, a, common, source)
        _train(cfg, b, [*common, *candidate], source)
        allowed = tuple(sorted({o.split("=", 1)[0].lstrip("+") for o in candidate}))
        allowed += tuple("topology." + t for t in ("trainer_ep", "generator_ep") if any(
            o.startswith(t.replace("_ep", ".ep_size")) for o in candidate))
    res = compare_runs(a, b, from_step, allowed)
    what = {"repeatability": "the same run twice",
            "baseline": f"reference vs candidate {candidate}",
            "replay": f"uninterrupted vs resumed after step {from_step - 1}"}[kind]
    head = f"gate {kind}: {'PASS' if res.ok else 'FAIL'} ({what}; {cfg.run.steps} steps; runs in {base})"
    body = res.lines if not res.ok else ["metrics and the compared trace streams identical"
                                         + (f" from step {from_step}" if from_step else "")] + res.lines
    if res.first_op:
        body.insert(0, f"first divergence: {res.first_op}")
    return res.ok, "\n".join([head, *("  " + ln for ln in body)])
