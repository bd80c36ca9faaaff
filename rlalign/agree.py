"""`rlalign agree`: generate one batch, rescore it on the trainer side with another batch
composition, and report how the two sides' per-token logprobs compare.

Both sides run the worker classes of `rlalign train` (rlalign/workers.py): GeneratorWorker.generate
and TrainerWorker.score, on torch.multiprocessing ranks at EP > 1 (in this process at EP 1)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from rlalign.agent.recorded import RecordedEpisode, RecordedEpisodes, split_episode
from rlalign.config import model_args
from rlalign.config_search import ConfigError
from rlalign.generator_world import generator_world
from rlalign.logger import Phases, json_line
from rlalign.monitor.consistency import logprob_consistency
from rlalign.monitor.divergence import locate_mismatches, tap_order
from rlalign.parallel.launch import check_local_world, run_workers, shard_range
from rlalign.rollout.generator import check_generator
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout, Sample, policy_mask
from rlalign.workers import GeneratorWorker, TrainerWorker

# sections of which `rlalign agree` reads no key, and what to use instead (the task: unless it replays a dump)
UNREAD = {
    "run": "it writes no run directory: its result is the last stdout line, one JSON object, to redirect where "
           "you want it; agree.num_prompts sizes its one batch",
    "checkpoint": "it checks the weights of model.path, else the model's random init; a checkpoint's model: "
                  "`rlalign export CHECKPOINT_DIR OUT_DIR`, then `rlalign agree model.path=OUT_DIR`",
}


def refuse_unread_keys(overrides: list[str], cfg: DictConfig) -> None:
    """A key that `rlalign agree` would not read, given on its command line, is refused in one line naming it and
    what to use instead: run.* and checkpoint.* (UNREAD), and task.* unless agree.replay (agree samples
    random single-turn prompts, agree.*: the commands that run a task are named)."""

    def given(section: str) -> list[str]:
        return [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] == section]

    for section, instead in UNREAD.items():
        if given(section):
            raise ConfigError(f"{' '.join(given(section))}: rlalign agree reads no {section}.* key ({instead})")
    tasks = " ".join(given("task"))
    if tasks and not cfg.agree.replay:
        raise ConfigError(f"{tasks}: rlalign agree reads no task key (it checks one batch of agree.num_prompts "
                          f"random prompts, single-turn); the monitor of `rlalign train {tasks}` compares every "
                          f"policy token of the task's episodes each step, and `rlalign gate repeatability {tasks}` "
                          f"checks its runs")


def random_prompts(cfg: DictConfig, vocab_size: int, first_token: int = 2) -> list[list[int]]:
    """Seeded prompts of random tokens (ids below first_token are kept for pad/eos)."""
    a = cfg.agree
    if a.num_prompts < 1:
        raise ValueError(f"agree.num_prompts={a.num_prompts}: must be >= 1")
    if not 1 <= a.prompt_min_len <= a.prompt_max_len:
        raise ValueError(f"agree.prompt_min_len/max_len = {a.prompt_min_len}/{a.prompt_max_len}: need 1 <= min <= max")
    args = model_args(cfg)
    if args.context_overflow(a.prompt_max_len, a.max_new_tokens):
        room = args.max_position_embeddings - a.max_new_tokens
        raise ValueError(f"agree.prompt_max_len={a.prompt_max_len}: with agree.max_new_tokens={a.max_new_tokens} a "
                         f"prompt that long exceeds the model's context of {args.max_position_embeddings} positions; "
                         + (f"set agree.prompt_max_len<={room} or lower agree.max_new_tokens" if room >= 1 else
                          f"lower agree.max_new_tokens below {args.max_position_embeddings}"))
    g = torch.Generator().manual_seed(cfg.seed)
    out = []
    for _ in range(a.num_prompts):
        n = int(torch.randint(a.prompt_min_len, a.prompt_max_len + 1, (1,), generator=g))
        out.append(torch.randint(first_token, vocab_size, (n,), generator=g).tolist())
    return out


def trainer_order(cfg: DictConfig, n: int) -> list[int]:
    """The trainer sees the batch in another order (a seeded shuffle) and other micro-batches."""
    if not cfg.agree.shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + 1)).tolist()


def batch_params(cfg: DictConfig, seed: int) -> SamplingParams:
    """The sampling of a batch of `rlalign agree`: the generator.* keys, agree.max_new_tokens, the model's stop
    token, `seed`."""
    return SamplingParams.from_config(cfg, model_args(cfg).eos_token_id, seed, cfg.agree.max_new_tokens)


DUMP_KEYS = ("sampling", "prompts", "sample_ids", "responses", "generator_logprobs")  # what a replay reads


def load_replay(cfg: DictConfig) -> tuple[DictConfig, list[list[int]], list[int], SamplingParams, dict]:
    """A mismatch dump as (config with its weights, prompts, sample ids, the sampling the run drew
    them with, batch)."""
    d = Path(cfg.agree.replay)
    if not d.is_dir():
        raise FileNotFoundError(f"agree.replay={str(d)!r}: no such directory (a mismatch dump's directory)")
    if not (d / "batch.json").is_file() or not (d / "weights" / "config.json").is_file():
        raise FileNotFoundError(f"agree.replay={str(d)!r}: not a mismatch dump (needs batch.json and weights/)")
    where = d / "batch.json"
    try:
        batch = json.loads(where.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"agree.replay: {where}:{e.lineno}:{e.colno}: not JSON ({e.msg}): a damaged mismatch "
                         "dump") from None
    missing = [k for k in DUMP_KEYS if not isinstance(batch, dict) or k not in batch]
    if missing:
        raise ValueError(f"agree.replay: {where}: not a mismatch dump's batch (no {', '.join(missing)})")
    try:
        params = SamplingParams.from_dict(batch["sampling"])
        params.validate(where="sampling.")
    except (TypeError, ValueError) as e:
        raise ValueError(f"agree.replay: {where}: {e}") from None
    cfg = OmegaConf.merge(cfg, {"model": {"path": str(d / "weights")}})
    return cfg, batch["prompts"], batch["sample_ids"], params, batch


def recorded_episodes(batch: dict, where: str) -> list[RecordedEpisode] | None:
    """A dump's episodes (its `turns`: a multi-turn run's) split into turns and observations, or None
    (a single-turn run's dump)."""
    turns = batch.get("turns")
    if turns is None:
        return None
    responses, ids = batch["responses"], batch["sample_ids"]
    if not len(turns) == len(responses) == len(ids):
        raise ValueError(f"{where}: {len(turns)} turns, {len(responses)} responses, {len(ids)} sample ids; need one "
                         "of each per sample")
    return [split_episode(r, t, f"{where}, sample {sid}") for r, t, sid in zip(responses, turns, ids)]


def _generate_rank(rank: int, world: int, group, cfg_dict: dict, prompts, sample_ids, params: SamplingParams,
                   recorded: list[RecordedEpisode] | None) -> tuple[list[Rollout], dict]:
    worker = GeneratorWorker(cfg_dict, rank, world, group=group, local_gpu=rank if group is not None else None)
    if worker.cfg.monitor.fingerprints == "layers":
        worker.record_rows()
    part = shard_range(len(prompts), world, rank)
    mine = [prompts[i] for i in part]
    episodes = None if recorded is None else RecordedEpisodes([recorded[i] for i in part], [len(p) for p in mine])
    try:
        out = worker.generate(mine, [sample_ids[i] for i in part], params, episodes=episodes)
    finally:
        worker.generator.close()  # the engine's memory (a vLLM engine: its processes) back before the scoring
    return out.rollouts, out.rows


def _score_rank(rank: int, world: int, group, cfg_dict: dict, samples: list[Sample]) -> tuple[list[torch.Tensor], dict]:
    worker = TrainerWorker(cfg_dict, rank, world, group=group, local_gpu=rank if group is not None else None)
    if worker.cfg.monitor.fingerprints == "layers":
        worker.record_rows()
    return worker.score([samples[i] for i in shard_range(len(samples), world, rank)]), worker.pop_rows()


def _run_side(cfg: DictConfig, ep_size: int, what: str, fn, args) -> list:
    """fn on each rank of one side: spawned ranks over a process group, or this process at EP 1."""
    check_local_world(ep_size, cfg.device, what)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if ep_size == 1:
        return [fn(0, 1, None, cfg_dict, *args)]
    return run_workers(ep_size, fn, (cfg_dict, *args), cfg.device, cfg.dist.timeout_s)


def generate_batch(cfg: DictConfig, prompts, sample_ids, params: SamplingParams,
                   recorded: list[RecordedEpisode] | None = None, rows: dict | None = None) -> list[Rollout]:
    """The generator group's rollouts (generator.ep_size ranks), in sample order; with `recorded`,
    episodes that replay those turns and observations (params.max_new_tokens: per turn). `rows`: filled
    with the per-token row fingerprints (monitor.fingerprints=layers)."""
    parts = _run_side(cfg, check_generator(cfg).ranks, "generator.ep_size", _generate_rank,
                      (prompts, sample_ids, params, recorded))
    for _, table in parts if rows is not None else ():
        rows.update(table)
    return [r for part, _ in parts for r in part]


def score_batch(cfg: DictConfig, prompts, responses, params: SamplingParams, sample_ids=None,
                turns=None, rows: dict | None = None) -> list[torch.Tensor]:
    """The trainer group's logprobs (trainer.ep_size ranks), in order, of finished sequences whose
    responses were drawn with `params` (`turns`: episodes', as Sample.turns); `rows` as generate_batch's."""
    ids = sample_ids if sample_ids is not None else [None] * len(prompts)
    turns = turns if turns is not None else [None] * len(prompts)
    samples = [Sample(list(p), list(r), torch.zeros(len(r)), 0.0, i, params=params, turns=t)
               for p, r, i, t in zip(prompts, responses, ids, turns)]
    parts = _run_side(cfg, cfg.trainer.ep_size, "trainer.ep_size", _score_rank, (samples,))
    for _, table in parts if rows is not None else ():
        rows.update(table)
    return [lp for part, _ in parts for lp in part]


def first_divergent_op(cfg: DictConfig, rollouts: list[Rollout], train_lps: list[torch.Tensor], gen_rows: dict,
                       train_rows: dict) -> str | None:
    """The op where the earliest mismatched token's rows first differ (monitor.divergence), from both sides'
    row fingerprints; None when no token differs or no rows were recorded."""
    bad = []
    for r, t in zip(rollouts, train_lps):
        differ = (r.logprobs.view(torch.int32) != t.view(torch.int32)) & policy_mask(r.turns, len(r.tokens))
        bad += [(r.sample_id, len(r.prompt) + j - 1) for j in torch.nonzero(differ)[:, 0].tolist()]
    if not (bad and gen_rows and train_rows):
        return None
    return locate_mismatches(gen_rows, train_rows, bad, tap_order(model_args(cfg)))["first_divergent_op"]


def _where(ranks: int) -> str:
    return "in this process" if ranks == 1 else f"on {ranks} spawned ranks"


def run_agree(cfg: DictConfig, phase: Callable[[str], None] = lambda what: None) -> tuple[dict, list[Rollout]]:
    """The batch generated and rescored, compared token by token; `phase` hears each phase as it begins."""
    t0 = time.perf_counter()
    replay = recorded = None
    if cfg.agree.replay:
        cfg, prompts, ids, params, replay = load_replay(cfg)
        recorded = recorded_episodes(replay, f"agree.replay={cfg.agree.replay!r} (batch.json)")
    else:
        prompts, params = random_prompts(cfg, model_args(cfg).vocab_size), batch_params(cfg, cfg.seed)
        ids = list(range(len(prompts)))
    world = generator_world(cfg)
    what = (f"{len(prompts)} sequences of up to {params.max_new_tokens} tokens" if recorded is None else
            f"{len(prompts)} episodes of {sum(len(e.lengths) for e in recorded)} recorded turns in all")
    phase(f"generating {what} (generator EP {world.ranks}, {world.backend} engine, {_where(world.ranks)}; each rank "
          "builds the model first)")
    gen_rows, train_rows = {}, {}  # per-token row fingerprints (monitor.fingerprints=layers; else none)
    rollouts = generate_batch(cfg, prompts, ids, params, recorded, gen_rows)
    t1 = time.perf_counter()
    phase(f"scoring the {sum(len(r.tokens) for r in rollouts)} generated tokens on the trainer side (EP "
          f"{cfg.trainer.ep_size}, {_where(cfg.trainer.ep_size)}; another order and other micro-batches)")
    order = trainer_order(cfg, len(rollouts))
    shuffled = [rollouts[i] for i in order]
    train_lp = score_batch(cfg, [r.prompt for r in shuffled], [r.tokens for r in shuffled], params,
                           [r.sample_id for r in shuffled], [r.turns for r in shuffled], train_rows)
    t2 = time.perf_counter()
    back = [None] * len(rollouts)
    for j, i in enumerate(order):
        back[i] = train_lp[j]
    c = logprob_consistency([r.logprobs for r in rollouts], back, [r.turns for r in rollouts])
    result = {
        "tokens": c["tokens"],
        "mismatched_tokens": c["mismatched_tokens"],
        "max_abs_diff": c["logprob_abs_diff_max"],
        "mean_abs_diff": c["logprob_abs_diff_mean"],
        "kernels": cfg.kernels.mode,
        "backend": cfg.kernels.backend,
        "dtype": cfg.model.dtype,
        "trainer_ep": cfg.trainer.ep_size,
        "generator_ep": cfg.generator.ep_size,
        "generator_backend": generator_world(cfg).backend,
        "trainer_micro_batch_size": cfg.trainer.micro_batch_size,
        "trainer_layout": cfg.trainer.layout,
        "sequences": len(rollouts),
        "mismatch_seq_frac": c["mismatch_seq_frac"],
        "k3_kl": c["k3_kl"],
        "abs_diff_hist": c["abs_diff_hist"],
        "first_divergent_op": first_divergent_op(cfg, rollouts, back, gen_rows, train_rows),
        "device": cfg.device,
        "generate_s": round(t1 - t0, 3),
        "score_s": round(t2 - t1, 3),
    }
    if replay is not None:
        result.update(replay_checks(rollouts, replay))
    return result, rollouts


def replay_checks(rollouts: list[Rollout], replay: dict) -> dict:
    """Did the replay sample what the run sampled: the same tokens (an episode's: with the same turns and
    observations) and the same generator logprob bits at every token the policy sampled."""
    turns = replay.get("turns")
    turns = [None] * len(rollouts) if turns is None else [[0] * len(r) if t is None else t
                                                          for r, t in zip(replay["responses"], turns)]
    same = all(r.tokens == resp and r.turns == t for r, resp, t in zip(rollouts, replay["responses"], turns))

    def equal(r: Rollout, lp: list[float]) -> bool:
        if len(lp) != len(r.tokens):
            return False
        keep = policy_mask(r.turns, len(r.tokens))
        return torch.equal(r.logprobs.float()[keep].view(torch.int32),
                           torch.tensor(lp, dtype=torch.float32)[keep].view(torch.int32))

    lps = replay["generator_logprobs"]
    return {"replay_same_tokens": same and len(rollouts) == len(replay["responses"]),
            "replay_generator_logprobs_equal": all(equal(r, lp) for r, lp in zip(rollouts, lps))}


def print_report(result: dict, console=None) -> None:

    console = console or Console(stderr=True)
    ok = result["mismatched_tokens"] == 0
    t = Table(title="rlalign agree: generator vs trainer logprobs", show_header=False)
    t.add_column("what")
    t.add_column("value")
    rows = [
        ("kernels", f"{result['kernels']} ({result['backend']}), {result['dtype']}, {result['device']}"),
        ("expert parallel", f"generator EP {result['generator_ep']}, trainer EP {result['trainer_ep']}"),
        ("trainer batches",
         f"micro-batch {result['trainer_micro_batch_size'] or 'all'}, {result['trainer_layout']}, shuffled"),
        ("sequences / tokens", f"{result['sequences']} / {result['tokens']}"),
        ("mismatched tokens", f"{result['mismatched_tokens']} ({result['mismatch_seq_frac']:.1%} of sequences)"),
        ("max |Δ logprob|", f"{result['max_abs_diff']:.3g}"),
        ("mean |Δ logprob|", f"{result['mean_abs_diff']:.3g}"),
        ("k3 KL", f"{result['k3_kl']:.3g}"),
        *([("first divergence", result["first_divergent_op"])] if result.get("first_divergent_op") else []),
        ("time", f"generate {result['generate_s']:.2f}s, score {result['score_s']:.2f}s"),
    ]
    for r in rows:
        t.add_row(*r)
    console.print(t)
    console.print("[green]bitwise agreement[/green]" if ok else "[red]MISMATCH: generator and trainer disagree[/red]")
    print(f"rlalign agree: {verdict(result)}", file=sys.stderr, flush=True)  # unwrapped: a log's (or make demo's) line


def verdict(result: dict) -> str:
    """The comparison in one line: '304 of 306 tokens differ between the generator's and the trainer's
    logprobs (kernels.mode=default; max |Δ logprob| 0.0045)'."""
    n, of = result["mismatched_tokens"], result["tokens"]
    what = f"{n} of {of} tokens differ between the generator's and the trainer's logprobs"
    if n == 0:
        return f"{what}: bitwise agreement (kernels.mode={result['kernels']})"
    first = f"; first divergence: {result['first_divergent_op']}" if result.get("first_divergent_op") else ""
    return f"{what} (kernels.mode={result['kernels']}; max |Δ logprob| {result['max_abs_diff']:.2g}{first})"


def exit_code(result: dict) -> int:
    """1 when any token differs in deterministic mode (the promise is broken), else 0: in
    kernels.mode=default a mismatch is the expected, reported outcome."""
    return 1 if result["kernels"] == "deterministic" and result["mismatched_tokens"] else 0


def main(cfg: DictConfig) -> int:
    result, _ = run_agree(cfg, Phases("rlalign agree"))
    print_report(result)
    print(json_line(result), flush=True)
    return exit_code(result)
