"""The native engine's host work per step, multi-turn episodes against single-turn, under cProfile on CPU.

    python experiments/rollout/profile_multiturn_host.py --episodes 256 --turns 3 --tokens-per-turn 8

Same prompts and model as bench_multiturn.py (its scripted environment, here answering at once, and its
id tokenizer; the environment's calls in one EnvPool kept across the side's calls, as a generator rank keeps
it across steps): one warm-up call per side, then one generate() call per side under cProfile. Prints, per
side, the engine's steps, lookahead steps, steps launched from schedule() (the lookahead drained: the host
read a step back before enqueueing the next), steps that would run eagerly on CUDA (prompt chunks in a step
over ModelRunner.graph_rows rows), and
the host's seconds per step: in all, in the model's forward and sampling (on CPU the device work runs on
the host), the rest (bookkeeping: what a GPU step waits for when it exceeds the device time), and the top
functions of the rest by their own time, each as microseconds per engine step. The device-to-host reads
(Tensor.tolist / item / cpu) are counted per step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_multiturn beside this script
from bench_multiturn import IdText, scripted_env  # noqa: E402

from rlalign.agent import EnvPool, EpisodeDriver, EpisodeLimits  # noqa: E402
from rlalign.config import EngineConfig, keys_of, load_config, model_args  # noqa: E402
from rlalign.model.build import model_from_config  # noqa: E402
from rlalign.rollout.native.engine import NativeEngine  # noqa: E402
from rlalign.rollout.native.runner import ModelRunner  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402
from rlalign.tasks import Example  # noqa: E402

DEVICE_WORK = ("step", "sample_next")  # Transformer.step (the forward) and rlalign.rollout.sampling.sample_next
SYNCS = ("tolist", "item", "cpu")
# the engine's and the driver's steps, cumulative (Thread.start: the driver's environment calls' thread starts)
NAMED = ("postprocess", "lookahead", "schedule", "_meta", "resume", "poll", "ended", "stopped", "start")


def profiled(eng: NativeEngine, prompts, params, make_driver) -> tuple[pstats.Stats, list, float]:
    """One warm-up call, then one call under cProfile: its stats, its steps (rows, a graph's on CUDA, lookahead)
    and the driver's seconds blocked in poll(wait=True) (0.0 single-turn)."""
    eng.generate(prompts, list(range(len(prompts))), params, episodes=make_driver())
    kinds, run = [], ModelRunner.run

    def counted(self, step, *args, **kwargs):
        graph = len(step.sample_at) == len(step.rows) or len(step.rows) <= self.graph_rows
        kinds.append((len(step.rows), graph, step.follow is not None))
        return run(self, step, *args, **kwargs)

    driver, prof = make_driver(), cProfile.Profile()
    ModelRunner.run = counted
    try:
        prof.enable()
        eng.generate(prompts, list(range(len(prompts))), params, episodes=driver)
        prof.disable()
    finally:
        ModelRunner.run = run
    return pstats.Stats(prof), kinds, driver.wait_s if driver is not None else 0.0


def per_step(stats: pstats.Stats, steps: int, top: int) -> dict:
    """Host microseconds per engine step: total, device work (the forward and sampling), the rest, and
    the rest's top functions by own time; device-to-host reads per step."""
    rows = stats.stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    total = max(cum for (_, _, name), (_, _, _, cum, _) in rows.items() if name == "generate")
    device = sum(cum for (file, _, name), (_, _, _, cum, _) in rows.items()
                 if name in DEVICE_WORK and ("model" in file or "sampling" in file))
    roots = [k for k in rows if k[2] in DEVICE_WORK and ("model" in k[0] or "sampling" in k[0])]
    inside = _under(stats, roots)
    own = sorted(((_outside(v, inside, 2), _outside(v, inside, 1), key) for key, v in rows.items()
                  if key not in roots), reverse=True)
    syncs = {name: sum(_outside(v, inside, 1) for (_, _, n), v in rows.items() if n.startswith(f"<method '{name}'"))
             for name in SYNCS}
    us = 1e6 / steps
    named = {n: sum(v[3] for k, v in rows.items() if k[2] == n and ("rlalign" in k[0] or "threading" in k[0])) * us
             for n in NAMED}
    return {"named_us": named, "total_us": total * us, "device_work_us": device * us, "host_us": (total - device) * us,
            "syncs_per_step": {k: v / steps for k, v in syncs.items()},
            "top": [(f"{Path(k[0]).name}:{k[1]}({k[2]})", tt * us, nc / steps) for tt, nc, k in own[:top]]}


def _under(stats: pstats.Stats, roots: list) -> set:
    """Every function called (transitively) from one of `roots`, the roots included."""
    seen, changed = set(roots), True
    while changed:
        changed = False
        for key, v in stats.stats.items():
            if key not in seen and set(v[4]) & seen:
                seen.add(key)
                changed = True
    return seen


def _outside(v: tuple, inside: set, field: int) -> float:
    """A function's calls (field 1) or own seconds (field 2) from callers outside `inside` (all: no callers)."""
    callers = v[4]
    return sum(c[field] for k, c in callers.items() if k not in inside) if callers else v[field]


def report(side: str, stats: pstats.Stats, kinds: list, wait_s: float, top: int) -> None:
    steps = len(kinds)
    ahead = sum(k[2] for k in kinds)
    eager = sum(not k[1] for k in kinds)
    r = per_step(stats, steps, top)
    print(f"\n== {side}: {steps} steps, {ahead} lookahead, {steps - ahead} from schedule() (lookahead drained), "
          f"{eager} eager on CUDA (prompt chunks over graph_rows), {sum(k[0] for k in kinds) / steps:.1f} rows/step")
    print(f"   per step: {r['total_us']:.0f} us in all, {r['device_work_us']:.0f} us forward+sampling, "
          f"{r['host_us']:.0f} us the rest, of which {wait_s * 1e6 / steps:.0f} us blocked in poll(wait=True); "
          "reads to host per step: "
          + ", ".join(f"{k} {v:.2f}" for k, v in r["syncs_per_step"].items()))
    print("   cumulative us/step: " + ", ".join(f"{k} {v:.0f}" for k, v in r["named_us"].items()))
    for name, us, calls in r["top"]:
        print(f"   {us:8.1f} us/step  {calls:8.2f} calls/step  {name}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens-per-turn", type=int, default=8)
    ap.add_argument("--obs-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", default="8,32", help="MIN,MAX prompt tokens (seeded random)")
    ap.add_argument("--env-workers", type=int, default=256)
    ap.add_argument("--stop", default="", help="comma-separated stop strings (task.stop; default none)")
    ap.add_argument("--top", type=int, default=25)
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(1)
    cfg = load_config([f"model={a.model}", "device=cpu"])
    args, model = model_args(cfg), model_from_config(cfg)
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, args.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(a.episodes)]
    n = a.tokens_per_turn
    single = SamplingParams(max_new_tokens=a.turns * n, eos_token_id=None, seed=7)
    per_turn = SamplingParams(max_new_tokens=n, eos_token_id=None, seed=7)
    context = hi + a.turns * n + (a.turns - 1) * a.obs_tokens + 1
    stop = tuple(s for s in a.stop.split(",") if s)
    limits = EpisodeLimits(max_turns=a.turns, max_context_len=context, workers=a.env_workers, stop=stop)
    env_cls = scripted_env((0.0, 0.0), a.obs_tokens, args.vocab_size)
    examples = [Example(IdText().decode(p), "") for p in prompts]
    ids = list(range(len(prompts)))
    eng = NativeEngine(model, keys_of(EngineConfig, cfg.generator))
    pool = EnvPool(a.env_workers)  # across the side's calls, as a generator rank keeps it across steps
    sides = {"singleturn": (single, lambda: None),
             "multiturn (instant env)": (per_turn, lambda: EpisodeDriver(env_cls, IdText(), examples, prompts, ids,
                                                                          0, limits, pool=pool))}
    for side, (params, make) in sides.items():
        report(side, *profiled(eng, prompts, params, make), a.top)


if __name__ == "__main__":
    main()
