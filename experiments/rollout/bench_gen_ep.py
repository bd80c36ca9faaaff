"""Native generator tokens/s at generator EP 1 and EP N over the same prompts: deterministic kernels
(Triton on CUDA), graphs and lookahead; whether the EP-N rollouts equal EP 1's bit for bit; with
--score, the EP-N model's rescoring of them (the trainer's scoring over the same N ranks).

    python experiments/rollout/bench_gen_ep.py [--model qwen3-30b-a3b-rehearsal] [--ep 2] [--prompts 1024] [--new 128]

EP N runs N ranks (NCCL, one GPU each; gloo on CPU), each generating its share of the prompts through
the fixed-capacity all-to-all (rlalign/parallel/alltoall.py); tokens/s counts the slowest rank. EP 1
is the plain engine on rank 0 with every prompt. --ep 1 runs the EP path over a one-rank group (every
all-to-all to itself): what the EP machinery costs on one GPU. Each engine warms up (compiles, captures)
before its timed call. Writes experiments/results/gen_ep<N>_<model>_<device>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign.parallel.launch import run_workers, shard_range  # noqa: E402


def _timed(engine, prompts, ids, params, cuda: bool) -> tuple[list, float]:
    from dataclasses import replace

    from rlalign.sampling_params import SamplingParams

    engine.generate(prompts[:8], ids[:8], SamplingParams(max_new_tokens=8, seed=1))  # compile, small buckets
    engine.generate(prompts, ids, replace(params, max_new_tokens=2, seed=1))  # the full batch's prefill + bucket
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, ids, params)
    if cuda:
        torch.cuda.synchronize()
    return outs, time.perf_counter() - t0


def bench_rank(rank, world, group, a, prompts):
    from rlalign import kernels
    from rlalign.config import load_config, model_args
    from rlalign.model import build_model
    from rlalign.parallel.ep import ExpertParallel, moe_layers
    from rlalign.parallel.launch import Lockstep
    from rlalign.rollout.native.engine import NativeEngine
    from rlalign.rollout.types import EngineConfig
    from rlalign.sampling_params import SamplingParams
    from rlalign.training.scoring import score

    cuda = a.device == "cuda"
    args = model_args(load_config([f"model={a.model}"]))
    dev = f"cuda:{rank}" if cuda else "cpu"
    model = build_model(args, "bfloat16", seed=0, device=dev)
    params = SamplingParams(max_new_tokens=a.new, eos_token_id=args.eos_token_id, seed=7)
    engine_cfg = EngineConfig(max_num_batched_tokens=a.max_batched)
    out = {}
    lockstep = Lockstep(group)  # (the gloo group every rank builds together, before any timing)
    with kernels.use(mode="deterministic", backend="triton" if cuda else "torch"), torch.no_grad():
        if rank == 0:
            ids = list(range(len(prompts)))
            out["ep1"], out["ep1_s"] = _timed(NativeEngine(model, engine_cfg), prompts, ids, params, cuda)
        dist.barrier(group=lockstep.group)
        for moe in moe_layers(model):
            moe.experts = ExpertParallel(moe.experts, group, moe.top_k)
        mine = list(shard_range(len(prompts), world, rank))
        engine = NativeEngine(model, engine_cfg, lockstep)
        out["epn"], out["epn_s"] = _timed(engine, [prompts[i] for i in mine], mine, params, cuda)
        out["stats"] = dict(engine.stats)
        if a.score:
            lps = score(model, [r.prompt for r in out["epn"]], [r.tokens for r in out["epn"]],
                        params, micro_batch_size=a.score_micro_batch)
            diff = [(r.logprobs - lp.float().cpu()).abs() for r, lp in zip(out["epn"], lps)]
            out["scored_mismatched"] = int(sum(int((d != 0).sum()) for d in diff))
    return out


def _same(x, y) -> bool:
    return x.tokens == y.tokens and torch.equal(x.logprobs.view(torch.int32), y.logprobs.view(torch.int32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b-rehearsal")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--max-batched", type=int, default=8192, help="generator.max_num_batched_tokens")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--score", action="store_true", help="rescore the EP-N rollouts on the EP-N model")
    ap.add_argument("--score-micro-batch", type=int, default=16)
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    from rlalign.config import load_config, model_args

    vocab = model_args(load_config([f"model={a.model}"])).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (int(torch.randint(a.prompt_min, a.prompt_max + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(a.prompts)]
    res = run_workers(a.ep, bench_rank, (a, prompts), a.device, timeout_s=1800)
    ep1 = res[0]["ep1"]
    epn = [r for part in res for r in part["epn"]]
    tokens = sum(len(r.tokens) for r in ep1)
    epn_s = max(part["epn_s"] for part in res)
    summary = {
        "ep": a.ep, "tokens": tokens, "ep1_tok_s": tokens / res[0]["ep1_s"], "ep_n_tok_s": tokens / epn_s,
        "ep_over_ep1": res[0]["ep1_s"] / epn_s,
        "mismatched_vs_ep1": sum(not _same(x, y) for x, y in zip(epn, ep1, strict=True)),
        "fixed_capacity_steps": [part["stats"]["fixed_capacity_steps"] for part in res],
        "lookahead_steps": [part["stats"]["lookahead_steps"] for part in res],
    }
    if a.score:
        summary["mismatched_tokens_vs_scoring"] = sum(part["scored_mismatched"] for part in res)
    setup = {"model": a.model, "prompts": a.prompts, "new_tokens": a.new, "prompt_len": [a.prompt_min, a.prompt_max],
             "max_num_batched_tokens": a.max_batched, "device": a.device,
             "rank_seconds": [part["epn_s"] for part in res], "ep1_seconds": res[0]["ep1_s"]}
    print(f"{'case':<26} {'seconds':>9} {'tok/s':>10}")
    print(f"{'EP 1 (plain engine)':<26} {res[0]['ep1_s']:>9.3f} {summary['ep1_tok_s']:>10.0f}")
    print(f"{f'EP {a.ep} (EP path)':<26} {epn_s:>9.3f} {summary['ep_n_tok_s']:>10.0f}")
    print("summary", summary)
    what = (f"{a.model}, {a.prompts} prompts x {a.new} new tokens: the native generator at EP {a.ep} (fixed-capacity "
            f"all-to-all, graphs, lookahead) runs {summary['ep_over_ep1']:.2f}x EP 1's tokens/s; "
            f"{summary['mismatched_vs_ep1']} rollouts differ from EP 1's bits")
    if a.score:
        what += f"; {summary['mismatched_tokens_vs_scoring']} tokens differ from the EP-{a.ep} rescoring"
    where = "h200" if a.device == "cuda" and "H200" in torch.cuda.get_device_name(0) else a.device
    name = f"gen_ep{a.ep}_{a.model}_{where}" + (f"x{a.ep}" if a.ep > 1 and a.device == "cuda" else "")
    print("wrote", record.write(name, {"summary": summary, "setup": setup, "what_it_shows": what}, a.out))


if __name__ == "__main__":
    main()
