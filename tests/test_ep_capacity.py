"""The fixed-capacity all-to-all of expert-parallel decode (rlalign.parallel.alltoall) on gloo ranks:
the same bits as the host-sized path and as EP 1, with no value of a tensor read on the host, and
the native engine's EP decode steps through it (with lookahead) sampling exactly what EP 1 samples
and what the trainer rescores (test_ep runs generator EP 2 and 4 against trainer EP 1, 2 and 4 on the
same path). Twins: the host-sized path trips the host-read guard; a combine in arrival order (the
home rank's experts first) changes bits between EP sizes; a rows bound too small is flagged."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, same_bits
from omegaconf import OmegaConf

from rlalign.agree import random_prompts, score_batch
from rlalign.config import load_config
from rlalign.monitor.consistency import logprob_consistency
from rlalign.parallel import launch

pytestmark = pytest.mark.slow


class HostRead(AssertionError):
    pass


_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads():
    """Fails on every read of a tensor's values by the host (what a device sync would be on a GPU)
    and on an all-to-all with split sizes from the host. kernels.grouped_linear is let through: the
    torch backends read group sizes on the host by design, the Triton one never does (its capture
    is checked in tests/gpu)."""
    from rlalign import kernels

    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    a2a, grouped = dist.all_to_all_single, kernels.grouped_linear
    active = [True]

    def refuse(name):
        def read(t, *args, **kwargs):
            if active[0]:
                raise HostRead(f"host read of a tensor: Tensor.{name} on {tuple(t.shape)}")
            return saved[name](t, *args, **kwargs)
        return read

    def a2a_fixed(out, x, output_split_sizes=None, input_split_sizes=None, **kwargs):
        if active[0] and (output_split_sizes is not None or input_split_sizes is not None):
            raise HostRead("all_to_all_single with split sizes from the host")
        return a2a(out, x, output_split_sizes, input_split_sizes, **kwargs)

    def grouped_allowed(*args):
        active[0] = False
        try:
            return grouped(*args)
        finally:
            active[0] = True

    for name in _READS:
        setattr(torch.Tensor, name, refuse(name))
    dist.all_to_all_single, kernels.grouped_linear = a2a_fixed, grouped_allowed
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        dist.all_to_all_single, kernels.grouped_linear = a2a, grouped


def _arrival_order_combine():
    """Patches MoE.forward (returns the original) with the twin: each token's expert outputs summed in
    the order they come back, the home rank's own experts first, then the other ranks' (slot order
    within a rank), instead of in top-k slot order. At EP 1 that is slot order."""
    from rlalign import kernels
    from rlalign.model.model import MoE

    def forward(self, x, tap=None):
        k = self.top_k
        weights, ids = kernels.moe_route(kernels.linear(x, self.gate.weight), k, self.norm_topk_prob)
        order, dest, counts = kernels.moe_dispatch(ids.reshape(-1), self.num_experts)
        y_sorted = self.experts(kernels.moe_slot_rows(x, order, dest, k), counts)
        world, rank = getattr(self.experts, "world", 1), getattr(self.experts, "rank", 0)
        owner = ids // (self.num_experts // world)
        key = ((owner - rank) % world) * k + torch.arange(k)  # [T, k]: home rank first
        perm = torch.argsort(key, 1)
        return kernels.moe_combine(y_sorted, weights.gather(1, perm), rows=dest.view(-1, k).gather(1, perm).view(-1))

    original, MoE.forward = MoE.forward, forward
    return original


def _layer_rank(rank, world, group, rows_per_rank):
    """One MoE layer, EP over `group`, a batch of its own size on each rank (rank 1: none): the
    unsharded layer, the host-sized path, the fixed-capacity path under the guard (at the agreed
    bound), a bound too small for the batch, and the arrival-order twin."""
    from rlalign import kernels
    from rlalign.model import ModelArgs, build_model
    from rlalign.model.model import MoE
    from rlalign.parallel.ep import apply_ep, capacity_overflowed, set_step_rows

    with kernels.use(mode="deterministic", backend="torch"), torch.no_grad():
        model = build_model(ModelArgs(**{**TINY, "num_experts": 8, "top_k": 4}), "float32", seed=3)
        moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
        T = rows_per_rank[rank]
        x = torch.randn(T, TINY["hidden_size"], generator=torch.Generator().manual_seed(rank))
        full = moe(x)
        apply_ep(model, group)
        host = moe(x)
        with pytest.raises(HostRead):  # twin: the host-sized path reads sizes on the host
            with no_host_reads():
                moe(x)
        set_step_rows(model, max(rows_per_rank))
        with no_host_reads():
            fixed = moe(x)
        clean = not capacity_overflowed(model)
        original = _arrival_order_combine()
        try:
            twin = moe(x)
        finally:
            MoE.forward = original
        set_step_rows(model, 1)  # a bound below the batch: flagged, never silent
        small = moe(x)
        over = capacity_overflowed(model)
    return {"full": full, "host": host, "fixed": fixed, "clean": clean, "twin": twin, "over": over, "small": small}


def test_fixed_capacity_all_to_all_keeps_the_bits_and_reads_nothing_on_the_host():
    rows = [13, 0, 7, 30]
    out = launch.run_workers(4, _layer_rank, (rows,), timeout_s=60)
    for r, o in enumerate(out):
        assert same_bits(o["fixed"], o["host"]) and same_bits(o["fixed"], o["full"]), r
        assert o["clean"], r
    # the twin's order depends on the EP size: some token of some rank sums differently than at EP 1
    assert not all(same_bits(o["twin"], o["full"]) for o in out)
    # top_k 4 over 2 experts per rank: a bound of 1 row cannot hold 13 tokens' rows for one rank
    assert out[0]["over"] and not same_bits(out[0]["small"], out[0]["fixed"])


def _generate_rank(rank, world, group, cfg_dict, prompts):
    from rlalign.sampling_params import SamplingParams
    from rlalign.workers import GeneratorWorker

    worker = GeneratorWorker(cfg_dict, rank, world, group=group)
    part = launch.shard_range(len(prompts), world, rank)
    params = SamplingParams.from_config(worker.cfg, worker.model.args.eos_token_id, 0, worker.cfg.agree.max_new_tokens)
    outs = worker.generate([prompts[i] for i in part], list(part), params).rollouts
    return outs, dict(worker.generator.stats)


def test_generator_ep2_decode_through_fixed_capacity_equals_ep1_and_the_trainer():
    """Lookahead on, top_k 4 (sums of more than two terms: their order shows in the bits)."""
    cfg = load_config(["model.dtype=float32", "model.top_k=4", "agree.num_prompts=12", "agree.max_new_tokens=24",
                       "generator.lookahead=true", "trainer.ep_size=1", "trainer.micro_batch_size=5"])
    prompts = random_prompts(cfg, cfg.model.vocab_size)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    one = _generate_rank(0, 1, None, cfg_dict, prompts)[0]
    two = launch.run_workers(2, _generate_rank, (cfg_dict, prompts), timeout_s=120)
    for _, stats in two:  # every rank's decode steps went through the fixed capacity, with lookahead steps
        assert stats["fixed_capacity_steps"] > 0 and stats["lookahead_steps"] > 0, stats
    two = [r for rollouts, _ in two for r in rollouts]
    assert all(a.tokens == b.tokens and same_bits(a.logprobs, b.logprobs) for a, b in zip(one, two))
    assert sum(len(r.tokens) for r in two) >= 150
    scored = score_batch(cfg, [r.prompt for r in two], [r.tokens for r in two], two[0].params)
    c = logprob_consistency([r.logprobs for r in two], scored)
    assert c["mismatched_tokens"] == 0 and c["logprob_abs_diff_max"] == 0.0


def _launch_rank(rank, world, group, cases):
    """NativeEngine._launch on each rank's side of `cases` (rows, decode-only, has the graph), with a
    runner that records how it was asked to run."""
    from types import SimpleNamespace

    from rlalign.parallel.launch import Lockstep
    from rlalign.rollout.native.engine import NativeEngine
    from rlalign.rollout.native.scheduler import Step

    engine = SimpleNamespace(lockstep=Lockstep(group), model=torch.nn.Module(), stats={"fixed_capacity_steps": 0})
    seen = []
    for case in cases:
        rows, decode_only, has = case[rank]
        step = Step(rows=[(None, p) for p in range(rows)])
        step.sample_at = step.rows[:] if decode_only else step.rows[-1:]
        runner = SimpleNamespace(graphs=SimpleNamespace(has=lambda size, has=has: has),
                                 run=lambda step, previous, size, recapture, eager: (size, recapture, eager))
        seen.append(NativeEngine._launch(engine, runner, step))
    return seen


def test_ep_ranks_agree_on_each_step_bucket_eager_steps_and_captures():
    """A capture's warm-up runs the step's collectives, so when one rank lacks the bucket's graph every
    rank captures it; a prefill on one rank makes the step eager (exact sizes) on all."""
    cases = [
        [(3, True, False), (5, True, True)],  # decode on both: bucket of 5; rank 0 has no graph: both capture
        [(3, True, True), (5, True, True)],  # both have it: replay
        [(4, False, True), (2, True, True)],  # rank 0 prefills: eager everywhere
        [(0, True, True), (3, True, True)],  # rank 0 is done: an empty step at rank 1's bucket
        [(0, True, True), (0, True, True)],  # every rank is done
    ]
    got = launch.run_workers(2, _launch_rank, (cases,), timeout_s=60)
    want = [(5, False, (8, True, False)), (5, False, (8, False, False)), (4, False, (None, False, True)),
            (3, False, (4, False, False)), (0, False, None)]
    assert got == [want, want]
