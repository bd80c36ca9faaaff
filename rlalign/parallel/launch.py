"""Process groups without Ray: run a function on `world` ranks (torch.multiprocessing, gloo on
CPU, NCCL on GPU), plus the two sides of `rlalign agree` at any EP size.

A rank that raises or dies makes the launcher stop the others at once and raise an error naming
that rank; collectives carry a timeout (dist.timeout_s) so nothing waits forever.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from rlalign.generation import Rollout, generate
from rlalign.parallel.ep import apply_ep
from rlalign.training.scoring import micro_batches, score_micro_batch


class WorkerError(RuntimeError):
    pass


def shard_range(n: int, world: int, rank: int) -> range:
    """Contiguous, near-equal split of n items; the first n % world ranks get one more."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (1 if rank < extra else 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_world(world: int, device: str, what: str) -> None:
    if world < 1:
        raise ValueError(f"{what}={world}: must be >= 1")
    if device.startswith("cuda"):
        n = torch.cuda.device_count()
        if world > n:
            raise ValueError(f"{what}={world} needs {world} GPUs (one rank each); this machine has {n}")


def init_group(device: str, rank: int, world: int, port: int, timeout_s: float, local_gpu: int) -> None:
    """Join a process group: gloo on CPU, NCCL on GPU (this process on GPU local_gpu), with a
    collective timeout so a dead peer fails the others instead of hanging them."""
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(local_gpu)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _entry(rank, world, port, device, timeout_s, threads, fn, args, q):
    status, payload = "error", ""
    try:
        torch.set_num_threads(threads)
        init_group(device, rank, world, port, timeout_s, local_gpu=rank)
        status, payload = "ok", fn(rank, world, dist.group.WORLD, *args)
        dist.destroy_process_group()
    except BaseException:
        payload = traceback.format_exc()
    q.put((rank, status, payload))
    q.close()
    q.join_thread()  # the message is out before the process ends
    sys.stdout.flush()
    os._exit(0 if status == "ok" else 1)


def _blame(world: int, procs, errors: dict[int, str]) -> WorkerError:
    """The root cause: a rank that died without a word (killed, crashed) before one that raised
    (its peers' errors are usually 'connection closed' echoes); else the first error."""
    silent = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, 1) and r not in errors]
    if silent:
        r = silent[0]
        others = "; ".join(f"rank {k}: {v.strip().splitlines()[-1]}" for k, v in sorted(errors.items()))
        return WorkerError(f"rank {r} of {world} died (exit code {procs[r].exitcode}) without a result"
                           + (f" (then {others})" if others else ""))
    r = next(iter(errors))
    return WorkerError(f"rank {r} of {world} failed: {errors[r].strip().splitlines()[-1]}\n{errors[r]}")


def run_workers(world: int, fn: Callable, args: tuple, device: str = "cpu", timeout_s: float = 60.0) -> list:
    """fn(rank, world, group, *args) on `world` spawned ranks; returns results in rank order.
    fn must be importable (module level) and return picklable plain data."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, device, timeout_s, threads, fn, args, q), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    failed_at = None
    try:
        while len(results) + len(errors) < world:
            if failed_at is not None and time.monotonic() - failed_at > 1.0:
                break  # waited long enough for the other ranks' last words
            try:
                rank, status, payload = q.get(timeout=0.1)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
                    failed_at = failed_at or time.monotonic()
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
                if dead and failed_at is None:
                    failed_at = time.monotonic()
        if errors or len(results) < world:
            raise _blame(world, procs, errors)
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world:
                p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# --- the two sides of `rlalign agree` -------------------------------------------------------------
def _setup(cfg_dict: dict, group, side: str):
    from rlalign.factory import apply_kernels, model_from_config
    from rlalign.monitor.taps import Injection, TapRecorder

    cfg = OmegaConf.create(cfg_dict)
    apply_kernels(cfg)
    if group is not None and cfg.device.startswith("cuda"):
        cfg.device = f"cuda:{dist.get_rank(group)}"
    model = model_from_config(cfg)
    if group is not None:
        apply_ep(model, group)
    injection = Injection(cfg.monitor.get("inject"), side)  # replaying a run's injected fault
    injection.wrap_modules(model)
    model.taps = TapRecorder(rows=False, trace=None, injection=injection) if injection.kind else None
    return cfg, model


def any_live_fn(group):
    """generate()'s any_live: whether any rank of the group still decodes (all-reduce MAX)."""

    def fn(local_live: bool) -> bool:
        t = torch.tensor([int(local_live)], device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())

    return fn


def generate_worker(rank, world, group, cfg_dict, prompts, sample_ids, seed):
    from rlalign.factory import sampling_params

    cfg, model = _setup(cfg_dict, group, "generator")
    part = shard_range(len(prompts), world, rank)
    seed += model.taps.injection.seed_offset if model.taps is not None else 0
    params = sampling_params(cfg, model.args.eos_token_id, seed)
    outs = generate(
        model,
        [prompts[i] for i in part],
        [sample_ids[i] for i in part],
        params,
        any_live=any_live_fn(group) if group is not None else None,
    )
    return [(r.sample_id, r.prompt, r.tokens, r.logprobs.tolist(), r.finish_reason) for r in outs]


def score_worker(rank, world, group, cfg_dict, prompts, responses):
    from rlalign.factory import sampling_params

    cfg, model = _setup(cfg_dict, group, "trainer")
    part = shard_range(len(prompts), world, rank)
    mbs = micro_batches(len(part), cfg.trainer.micro_batch_size)
    n_mb = len(mbs)
    if group is not None:  # every rank runs the same number of forwards (MoE collectives)
        t = torch.tensor([n_mb], device=model.lm_head.weight.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        n_mb = int(t.item())
    score_kw = sampling_params(cfg).logprob_kwargs()  # the generator's semantics
    out = []
    with torch.no_grad():
        for i in range(n_mb):
            idx = [part[j] for j in mbs[i]] if i < len(mbs) else []
            lps = score_micro_batch(
                model,
                [prompts[j] for j in idx],
                [responses[j] for j in idx],
                layout=cfg.trainer.layout,
                **score_kw,
            )
            out += [lp.tolist() for lp in lps]
    return out


def _run_side(cfg: DictConfig, ep_size: int, what: str, fn, args) -> list:
    check_world(ep_size, cfg.device, what)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if ep_size == 1:
        return [fn(0, 1, None, cfg_dict, *args)]
    return run_workers(ep_size, fn, (cfg_dict, *args), cfg.device, cfg.dist.timeout_s)


def generate_batch(cfg: DictConfig, prompts, sample_ids, seed: int) -> tuple[list[Rollout], dict]:
    per_rank = _run_side(cfg, cfg.generator.ep_size, "generator.ep_size", generate_worker, (prompts, sample_ids, seed))
    rollouts = [
        Rollout(sid, p, t, torch.tensor(lp, dtype=torch.float32), fr) for part in per_rank for sid, p, t, lp, fr in part
    ]
    return rollouts, {"dtype": cfg.model.dtype}


def score_batch(cfg: DictConfig, prompts, responses) -> tuple[list[torch.Tensor], dict]:
    per_rank = _run_side(cfg, cfg.trainer.ep_size, "trainer.ep_size", score_worker, (prompts, responses))
    return [torch.tensor(lp, dtype=torch.float32) for part in per_rank for lp in part], {}


def grads_worker(rank, world, group, cfg_dict, prompts, responses, gen_logprobs, steps):
    """`steps` optimizer steps of a plain policy-gradient loss (-mean logprob) on the trainer at
    this EP size; returns fingerprints of the full gradients of the first step and of the final
    weights, plus the first step's full gradients (rank 0) for inspection."""
    from omegaconf import OmegaConf

    from rlalign.monitor.fingerprint import state_fingerprints
    from rlalign.training.trainer import Sample, Trainer

    cfg = OmegaConf.create(cfg_dict)
    from rlalign.factory import apply_kernels

    apply_kernels(cfg)
    trainer = Trainer(cfg, group)
    part = shard_range(len(prompts), world, rank)
    samples = [Sample(prompts[i], responses[i], torch.tensor(gen_logprobs[i])) for i in part]
    total = sum(len(r) for r in responses)

    def loss_fn(lps, idx):
        lp = torch.cat(lps)
        return -lp.sum(), {"logprob_sum": lp.detach().sum()}

    first = None
    for _ in range(steps):
        trainer.forward_backward(samples, loss_fn, total)
        trainer.reduce_grads()
        if first is None:
            full = {}
            for n, gr in trainer.grads.items():
                if world > 1 and ".mlp.experts." in n:
                    parts = [torch.empty_like(gr) for _ in range(world)]
                    dist.all_gather(parts, gr.contiguous(), group=group)
                    gr = torch.cat(parts, 0)
                full[n] = gr
            first = full
        trainer.optimizer_step()
    weights = trainer.full_state_dict()
    return {
        "grad_fps": state_fingerprints(first),
        "weight_fps": state_fingerprints(weights),
        "grads": {k: v.tolist() for k, v in first.items()} if rank == 0 else None,
    }


def train_grads(cfg: DictConfig, prompts, responses, gen_logprobs, steps: int = 1) -> dict:
    per_rank = _run_side(cfg, cfg.trainer.ep_size, "trainer.ep_size", grads_worker,
                         (prompts, responses, gen_logprobs, steps))
    return per_rank[0]
