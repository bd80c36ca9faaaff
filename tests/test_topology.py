"""Topology-invariant training: gradients, AdamW state and weights are the same bits at every
trainer EP size (the step's work is a fixed partition into global micro-batches; gradients are
summed in one tree over their indices), and a run resumes on a different number of ranks."""

import json
from pathlib import Path

import pytest
import torch
from conftest import inject_fault
from omegaconf import OmegaConf

from rlalign.config import load_config
from rlalign.parallel import launch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_runs")]  # the two gates share their run a


def _batch(n=10):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(2, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    return prompts, responses


def _train_rank(rank, world, group, cfg_dict, prompts, responses, steps):
    """`steps` PPO updates (2 minibatches each) on the whole batch at this EP size; the full
    gradients, AdamW moments and weights after them, unsharded (every rank returns them)."""
    from rlalign import kernels
    from rlalign.parallel.ep import is_expert_param
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, group)
    adv = [(-1.0) ** i * (1 + i / 10) for i in range(len(prompts))]
    samples = [Sample(p, r, torch.full((len(r),), -2.0), a, i, params=SamplingParams())
               for i, (p, r, a) in enumerate(zip(prompts, responses, adv))]
    alg = OmegaConf.create({**cfg_dict["algorithm"], "num_minibatches": 2})
    stats = []
    for _ in range(steps):
        lps, records = tr.train_step(samples, alg)
        stats.append((sorted(lps), sorted(records, key=lambda r: r[0])))

    def full(t, name):
        if world > 1 and is_expert_param(name):
            parts = [torch.empty_like(t) for _ in range(world)]
            torch.distributed.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts, 0)
        return t.clone()

    out = {}
    for n in tr.names:
        st = tr.opt.state[tr.master[n]]
        out[f"grad/{n}"] = full(tr.grads[n], n)
        out[f"exp_avg/{n}"] = full(st["exp_avg"], n)
        out[f"exp_avg_sq/{n}"] = full(st["exp_avg_sq"], n)
        out[f"master/{n}"] = full(tr.master[n].data, n)
    return out, stats


def _run(ep, *over):
    cfg = load_config(["model.dtype=float32", f"trainer.ep_size={ep}", "trainer.micro_batch_size=3", *over])
    args = (OmegaConf.to_container(cfg, resolve=True), *_batch(), 3)
    outs = [_train_rank(0, 1, None, *args)] if ep == 1 else launch.run_workers(ep, _train_rank, args)
    # every rank's stat records, per step, in key order (the grad-norm records all ranks share once)
    stats = [sorted({rec[0]: rec for o in outs for rec in o[1][step][1]}.values(), key=lambda r: r[0])
             for step in range(len(outs[0][1]))]
    return outs[0][0], stats


def _differing(a, b):
    return [k for k in a if not torch.equal(a[k].view(torch.int32), b[k].view(torch.int32))]


def test_gradients_adamw_state_and_weights_are_bitwise_equal_at_trainer_ep_1_2_4():
    ref, ref_stats = _run(1)
    for ep in (2, 4):
        got, stats = _run(ep)
        assert _differing(ref, got) == [], ep
        # per-micro-batch stats carry the same bits; merged in key order they agree too
        assert stats == ref_stats
    # negative twin: the per-rank grouping (sum per rank, then over ranks) differs from EP 1
    twin, _ = _run(2, "trainer.topology_invariant=false")
    assert any(k.startswith("grad/") for k in _differing(ref, twin))


def _backward_rank(rank, world, group, cfg_dict, prompts, responses, hooks):
    """One forward_backward at this EP size; records, whenever a per-source expert leaf's gradient
    enters its tree, how many per-source leaves of this rank hold a gradient, and how many do
    once the backward has finished. hooks=False: the leaves are only collected afterwards."""
    from rlalign import kernels
    from rlalign.parallel.ep import ExpertParallel
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training import gradients as gradients_mod
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, group)
    eps = [m for m in tr.model.modules() if isinstance(m, ExpertParallel)]
    holding = lambda: sum(t.grad is not None for m in eps for lv in m.leaves for t in lv.values())  # noqa: E731
    seen, after = [], []
    into = gradients_mod._into_tree

    def probe(tree, index, leaf):
        seen.append(holding())
        into(tree, index, leaf)

    gradients_mod._into_tree = probe
    if not hooks:
        tr.gradients.before_backward = lambda *a: None
    collect = tr.gradients._collect_leaves

    def collect_probe(*a):
        after.append(holding())
        collect(*a)

    tr.gradients._collect_leaves = collect_probe
    samples = [Sample(p, r, torch.full((len(r),), -2.0), 1.0, i, params=SamplingParams())
               for i, (p, r) in enumerate(zip(prompts, responses))]
    tr.forward_backward(samples, lambda lps, idx: (torch.cat(lps).sum(), {}))
    grads = {n: tr.grads[n].clone() for n in tr.expert_names}
    return seen, after, grads, len(eps)


@pytest.mark.parametrize("mb", [5, 3])  # one and two micro-batches per rank
def test_per_source_expert_gradients_enter_the_tree_during_backward_not_all_at_its_end(mb):
    """The trainer's memory: at trainer EP > 1 each source rank's rows get their own leaf view of the
    rank's experts; their gradients go into the tree as autograd produces them (one leaf's
    gradient alive at a time), not all layers x sources at once after the backward. Twin: without
    the hooks every leaf holds its gradient when the backward ends — and the sums are the same bits."""
    cfg = load_config(["trainer.ep_size=2", f"trainer.micro_batch_size={mb}"])
    args = (OmegaConf.to_container(cfg, resolve=True), *_batch())
    hooked = launch.run_workers(2, _backward_rank, (*args, True))
    plain = launch.run_workers(2, _backward_rank, (*args, False))
    steps = -(-10 // mb) // 2  # 10 sequences in micro-batches of mb, dealt to 2 ranks
    for (seen, after, grads, n_moe), (seen0, after0, grads0, _) in zip(hooked, plain):
        # per lockstep step, each rank's leaves for 2 sources x 2 weights per MoE layer
        assert len(seen) == steps * 2 * 2 * n_moe and max(seen) == 1 and after == [0] * steps
        assert seen0 == [] and after0 == [2 * 2 * n_moe] * steps
        assert all(torch.equal(grads[n], grads0[n]) for n in grads)


def _rows(run_dir):
    rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


SMALL = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=3", "generator.ep_size=1",
         "checkpoint.every=1", "model.dtype=float32"]  # fp32: bf16 gradients often sum exactly in any order


GATE = ["monitor.fingerprints=layers", "run.steps=3"]  # what the baseline gate below adds to its runs


def test_a_run_resumes_at_another_trainer_ep_size_bitwise(tmp_path, shared_runs):
    """3 steps at trainer EP 2, resumed from its checkpoint after step 1 at EP 4 (into a new run dir)
    == 3 uninterrupted steps at EP 1: every metric (time/* aside) and the final weights fingerprint.
    (Step 0's rewards are all 0, so its gradients too: the checkpoint after step 1 is the first whose
    AdamW moments are not 0, and step 2's update is made of the moments loaded at EP 4.) The EP 1 and
    EP 2 runs are the baseline gate's below (shared_runs: trained once in the module)."""
    from rlalign.rl import train

    full = {ep: shared_runs(load_config([*SMALL, *GATE, f"trainer.ep_size={ep}", f"run.dir={tmp_path / f'ep{ep}'}"]))
            for ep in (1, 2)}
    ckpt = tmp_path / "ep2" / "checkpoints" / "step_000001"
    moved = train(load_config([*SMALL, *GATE, "trainer.ep_size=4", f"run.dir={tmp_path / 'moved'}",
                               f"checkpoint.resume={ckpt}"]))
    ref = _rows(tmp_path / "ep1")
    assert moved["start_step"] == 2 and ref[1]["actor/grad_norm"] > 0
    assert _rows(tmp_path / "ep2") == ref and _rows(tmp_path / "moved") == ref[2:]
    assert moved["sync/weights_fp"] == full[1]["sync/weights_fp"] == full[2]["sync/weights_fp"]


def _gate(tmp_path, candidate):
    from rlalign.gates import run_gate

    over = [*SMALL, "trainer.ep_size=1", "run.steps=3", f"gate.candidate={candidate}"]  # runs a, b: the test above's
    return run_gate("baseline", over, load_config([*over, f"run.dir={tmp_path}"]))


def test_gate_baseline_across_trainer_ep_sizes_and_an_injected_reorder_named(tmp_path, monkeypatch):
    ok, text = _gate(tmp_path / "ep", '["trainer.ep_size=2"]')
    assert ok, text
    assert "trainer state (gradients, AdamW moments, weights per global expert): identical" in text
    bad = "model.layers.1.mlp.experts.down_proj"
    inject_fault(f"reorder:trainer:{bad}@b", monkeypatch)
    ok, text = _gate(tmp_path / "bad", '["trainer.ep_size=2"]')
    assert not ok and f"first divergence: state/grad/{bad}/expert" in text, text
