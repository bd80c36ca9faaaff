"""Multi-turn episodes against single-turn rollouts on the native engine, same prompts, model and engine:
policy tokens/s of --episodes episodes of --turns turns x --tokens-per-turn tokens (the engine's
continuation: rlalign.agent's EpisodeDriver runs a scripted environment in worker threads (an EnvPool per
side, kept across its calls as a generator rank keeps it across steps), each answer
after a latency drawn from --env-latency-ms, then an observation of --obs-tokens tokens is prefilled onto
the episode's KV pages) against single-turn rollouts of turns x tokens-per-turn tokens from the same prompts
each followed by the observations' (turns - 1) x obs-tokens tokens: as many tokens an episode, prompt,
observations and policy tokens, as issue 44 compares (the same prompts alone, fewer tokens in all, are the side
singleturn_same_prompts);
and every policy token's generator logprob against the trainer's rescoring of the whole episode
(rlalign.training.scoring.score_micro_batch), bit for bit: mismatched_tokens.

    python experiments/rollout/bench_multiturn.py --model tiny-moe --device cpu --threads 1 --calls 5
    python3 experiments/rollout/bench_multiturn.py --model bench-moe-large --device cuda --episodes 256 \\
        --tokens-per-turn 128 --out /root/out

Every turn runs to the per-turn limit (no EOS), so both sides sample the same number of policy tokens.
A third side, multiturn_instant_env, runs the same episodes with an environment that answers at once
(the continuation's own cost: observation prefills, the driver's threads). Each side is warmed up
once (compilations, graph captures), then --calls timed generate() calls per side, in turn; a side's
tokens/s is its fastest call's (timeit's rule: slower calls measure other load on the machine; every
call's seconds, steps, eager steps, graph captures and wait on environments are recorded: a slow call
says whether it captured graphs or waited). Where multi-turn time goes: the engine's time blocked on environments
(EpisodeDriver.wait_s: not overlapped with decoding), the environments' time summed over episodes, the
observation tokens prefilled, engine steps (episodes answered at different times continue in steps of
fewer rows), the steps that replayed CUDA graphs (NativeEngine.stats: graph_steps, and mixed_graph_steps
where observations or prompts were prefilled beside decode rows; the others ran eagerly) and seconds per step.
Writes results/multiturn_<model>_<machine>.json (or --name) with a top-level "summary".
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.agent import EnvPool, EpisodeDriver, EpisodeLimits, Step  # noqa: E402
from rlalign.config import EngineConfig, keys_of, load_config, model_args  # noqa: E402
from rlalign.model.build import model_from_config  # noqa: E402
from rlalign.rollout.native.engine import NativeEngine  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402
from rlalign.sequences import policy_mask  # noqa: E402
from rlalign.tasks import Example  # noqa: E402
from rlalign.training.scoring import score_micro_batch  # noqa: E402


class IdText:
    """The driver's tokenizer for random-token prompts: text is the token ids, space-separated; no chat
    template (observations are their ids as they are)."""

    chat = False

    def encode(self, text: str, where: str = "", template: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def scripted_env(latency_ms: tuple[float, float], obs_tokens: int, vocab_size: int) -> type:
    """An environment that answers every turn after a latency drawn from `latency_ms` (seeded by the
    episode) with `obs_tokens` random token ids; the driver ends the episode after task.max_turns."""

    class ScriptedEnv:
        def reset(self, example: Example, seed: int) -> None:
            self.rng = random.Random(seed)

        def step(self, action: str) -> Step:
            time.sleep(self.rng.uniform(*latency_ms) / 1000)
            return Step(" ".join(str(self.rng.randrange(2, vocab_size)) for _ in range(obs_tokens)))

    return ScriptedEnv


def _captures(eng: NativeEngine) -> int:
    graphs = eng.state.graphs if eng.state is not None else None
    return graphs.captures if graphs is not None else 0


def make_prompts(a: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The episodes' prompts (seeded random, --prompt-len tokens), and the same prompts each followed by
    (turns - 1) x obs-tokens more: single-turn episodes of those hold as many tokens as a multi-turn
    episode (prompt, observations, policy tokens)."""
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab_size, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(a.episodes)]
    extra = (a.turns - 1) * a.obs_tokens
    return prompts, [p + torch.randint(2, vocab_size, (extra,), generator=g).tolist() for p in prompts]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_call(eng: NativeEngine, prompts, params: SamplingParams, device: str, make_driver=None) -> dict:
    """One generate() call: its rollouts, seconds, engine stats and (episodes) the driver's numbers."""
    driver = make_driver() if make_driver else None
    captured = _captures(eng)
    sync(device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, list(range(len(prompts))), params, episodes=driver)
    sync(device)
    secs = time.perf_counter() - t0
    res = {"rollouts": driver.finish(outs) if driver else outs, "seconds": secs,
           "stats": {**eng.stats, "graph_captures": _captures(eng) - captured}}
    if driver:
        res.update(env_wait_s=driver.wait_s, env_s=sum(ep.env_s for ep in driver.episodes),
                   turns=[ep.turn for ep in driver.episodes])
    return res


def side_numbers(calls: list[dict]) -> dict:
    """A side's fastest call: policy tokens, seconds, tokens/s, steps, seconds per step (and every call's seconds)."""
    med = min(calls, key=lambda c: c["seconds"])
    rs = med["rollouts"]
    policy = sum(int(policy_mask(r.turns, len(r.tokens)).sum()) for r in rs)
    steps = max(1, med["stats"]["steps"])
    rows = sum(len(r.prompt) + len(r.tokens) - 1 for r in rs)  # tokens the model read (a sampled one: next step)
    out = {"seconds": med["seconds"], "policy_tokens": policy, "observation_tokens": sum(len(r.tokens) for r in rs)
           - policy, "tokens_per_s": policy / med["seconds"], "engine_steps": med["stats"]["steps"],
           "rows_per_step": rows / steps, "graph_steps": med["stats"]["graph_steps"],
           "mixed_graph_steps": med["stats"]["mixed_graph_steps"],
           "graph_captures": med["stats"]["graph_captures"], "discarded_rows": med["stats"]["discarded_rows"],
           "seconds_per_step": med["seconds"] / steps,
           "calls_seconds": [c["seconds"] for c in calls],
           "calls": [{"seconds": c["seconds"], "engine_steps": c["stats"]["steps"],
                      "eager_steps": c["stats"]["steps"] - c["stats"]["graph_steps"],
                      "mixed_graph_steps": c["stats"]["mixed_graph_steps"],
                      "graph_captures": c["stats"]["graph_captures"], "env_wait_s": c.get("env_wait_s")}
                     for c in calls]}
    if "env_s" in med:
        busy = med["seconds"] - med["env_wait_s"]
        out.update(env_s=med["env_s"], env_wait_s=med["env_wait_s"], engine_busy_s=busy,
                   tokens_per_s_without_env_wait=policy / busy, turns_mean=statistics.fmean(med["turns"]),
                   seconds_per_step_without_env_wait=busy / steps)
    return out


def mismatched(model, rollouts, params: SamplingParams, micro: int) -> tuple[int, int]:
    """(policy tokens whose generator logprob differs in any bit from the trainer's rescoring, policy tokens)."""
    bad = total = 0
    with torch.no_grad():
        for i in range(0, len(rollouts), micro):
            part = rollouts[i:i + micro]
            lps = score_micro_batch(model, [r.prompt for r in part], [r.tokens for r in part], params,
                                    sample_ids=[r.sample_id for r in part], turns=[r.turns for r in part])
            for r, lp in zip(part, lps):
                m = policy_mask(r.turns, len(r.tokens))
                bad += int((lp.float().cpu()[m].view(torch.int32) != r.logprobs[m].view(torch.int32)).sum())
                total += int(m.sum())
    return bad, total


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-moe", help="a configs/model name (bench-moe-large on the H200)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens-per-turn", type=int, default=16)
    ap.add_argument("--obs-tokens", type=int, default=8, help="tokens of each observation")
    ap.add_argument("--prompt-len", default="8,32", help="MIN,MAX prompt tokens (seeded random)")
    ap.add_argument("--env-latency-ms", default="5,50", help="MIN,MAX: each environment step sleeps a uniform draw")
    ap.add_argument("--env-workers", type=int, default=64, help="environment calls at once (task.env_workers)")
    ap.add_argument("--calls", type=int, default=3, help="timed generate() calls per side")
    ap.add_argument("--score-micro-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default; 1 on a shared CPU)")
    ap.add_argument("--name", default="", help="results file name (default multiturn_<model>_<machine>)")
    ap.add_argument("--out", default=str(record.RESULTS))
    ap.add_argument("overrides", nargs="*", help="config overrides (e.g. generator.max_num_seqs=64)")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    cfg = load_config([f"model={a.model}", f"device={a.device}", *(["kernels.backend=triton"] if cuda else []),
                       *a.overrides])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    args = model_args(cfg)
    model = model_from_config(cfg)
    prompts, longer = make_prompts(a, args.vocab_size)
    n = a.tokens_per_turn
    hi = int(a.prompt_len.split(",")[-1])
    single = SamplingParams(max_new_tokens=a.turns * n, eos_token_id=None, seed=7)
    per_turn = SamplingParams(max_new_tokens=n, eos_token_id=None, seed=7)
    context = hi + a.turns * n + (a.turns - 1) * a.obs_tokens + 1
    if context > args.max_position_embeddings:
        raise SystemExit(f"an episode takes up to {context} tokens: over {a.model}'s context of "
                         f"{args.max_position_embeddings}; lower --turns, --tokens-per-turn or --obs-tokens")
    latency = tuple(float(x) for x in a.env_latency_ms.split(","))
    env_cls = scripted_env((latency[0], latency[-1]), a.obs_tokens, args.vocab_size)
    limits = EpisodeLimits(max_turns=a.turns, max_context_len=context, workers=a.env_workers)
    examples = [Example(IdText().decode(p), "") for p in prompts]

    instant_cls = scripted_env((0.0, 0.0), a.obs_tokens, args.vocab_size)
    ids = list(range(len(prompts)))
    pools = [EnvPool(a.env_workers), EnvPool(a.env_workers)]  # per side, across its calls (as a generator rank's)
    sides = {"singleturn": (longer, single, None),
             "singleturn_same_prompts": (prompts, single, None),
             "multiturn": (prompts, per_turn, lambda: EpisodeDriver(env_cls, IdText(), examples, prompts, ids, 0,
                                                                    limits, pool=pools[0])),
             "multiturn_instant_env": (prompts, per_turn, lambda: EpisodeDriver(instant_cls, IdText(), examples,
                                                                                prompts, ids, 0, limits,
                                                                                pool=pools[1]))}
    eng = NativeEngine(model, keys_of(EngineConfig, cfg.generator))
    for side_prompts, params, make in sides.values():  # warm-up: compilations and graph captures of every shape
        timed_call(eng, side_prompts, params, a.device, make)
    calls = {side: [] for side in sides}
    for _ in range(a.calls):
        for side, (side_prompts, params, make) in sides.items():
            calls[side].append(timed_call(eng, side_prompts, params, a.device, make))
        print("  ".join(f"{side} {c[-1]['seconds']:.3f} s" for side, c in calls.items()),
              f"(engine waited {calls['multiturn'][-1]['env_wait_s']:.3f} s)", flush=True)
    res = {side: side_numbers(c) for side, c in calls.items()}
    bad, total = mismatched(model, calls["multiturn"][-1]["rollouts"], per_turn, a.score_micro_batch)
    s, m, z = res["singleturn"], res["multiturn"], res["multiturn_instant_env"]
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    summary = {"gpu": gpu, "multiturn_over_singleturn_tok_s": m["tokens_per_s"] / s["tokens_per_s"],
               "mismatched_tokens": bad, "policy_tokens_compared": total,
               "multiturn_over_singleturn_same_prompts_tok_s":
                   m["tokens_per_s"] / res["singleturn_same_prompts"]["tokens_per_s"],
               "singleturn_tok_s": s["tokens_per_s"], "multiturn_tok_s": m["tokens_per_s"],
               "turns_mean": m["turns_mean"], "env_s": m["env_s"], "env_wait_s": m["env_wait_s"],
               "env_wait_frac": m["env_wait_s"] / m["seconds"],
               "multiturn_over_singleturn_without_env_wait": m["tokens_per_s_without_env_wait"] / s["tokens_per_s"],
               "instant_env_over_singleturn_tok_s": z["tokens_per_s"] / s["tokens_per_s"],
               "engine_steps_multi_over_single": m["engine_steps"] / max(1, s["engine_steps"]),
               "eager_steps_single_multi": [x["engine_steps"] - x["graph_steps"] for x in (s, m)],
               "seconds_per_step_multi_over_single": m["seconds_per_step_without_env_wait"] / s["seconds_per_step"]}
    machine = "cpu" if not cuda else gpu.split()[-1].lower()
    name = a.name or f"multiturn_{a.model}_{machine}"
    shows = (f"{a.model} on {gpu}: {a.episodes} episodes x {a.turns} turns x {n} tokens (observations of "
             f"{a.obs_tokens} tokens, environment latency {a.env_latency_ms} ms, {a.env_workers} workers) vs "
             "single-turn episodes of the same total tokens (each prompt longer by the observations' tokens): "
             "{multiturn_over_singleturn_tok_s:.2f}x the tokens/s (the same prompts single-turn, "
             "{multiturn_over_singleturn_same_prompts_tok_s:.2f}x: fewer tokens in all) "
             "({multiturn_over_singleturn_without_env_wait:.2f}x without the engine's wait on environments, "
             "{env_wait_frac:.0%} of the call; {engine_steps_multi_over_single:.2f}x the engine steps at "
             "{seconds_per_step_multi_over_single:.2f}x the seconds a step; an instant environment "
             "{instant_env_over_singleturn_tok_s:.2f}x); {mismatched_tokens} of {policy_tokens_compared} policy "
             "tokens mismatched.").format(**summary)
    path = record.write(name, {"what_it_shows": shows, "summary": summary, "results": res, "config": {
        k: getattr(a, k) for k in ("model", "device", "episodes", "turns", "tokens_per_turn", "obs_tokens",
                                   "prompt_len", "env_latency_ms", "env_workers", "calls", "overrides")}}, a.out)
    print("summary", summary)
    print("wrote", path)


if __name__ == "__main__":
    main()
