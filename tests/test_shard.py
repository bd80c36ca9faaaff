"""Dense sharding (trainer.shard_dense): the dense fp32 masters, AdamW moments and (after the grad
norm) gradients split across the trainer ranks in units whose identity does not depend on the
number of ranks. Gradients, AdamW state and weights are the same bits as without sharding and at
every trainer EP size; checkpoints reshard (sharded EP 2 -> unsharded EP 1, sharded EP 4); each
rank holds ~1/W of the dense state."""

import pytest
import torch
from conftest import same_bits
from omegaconf import OmegaConf

from rlalign import checkpoint as ckpt
from rlalign.config import ConfigError, load_config
from rlalign.kernels import fixed_order as fo
from rlalign.kernels.torch_deterministic import sum_of_squares
from rlalign.training.shards import UNIT_ALIGN, assign_units, dense_units

UNIT = 1024  # elements per unit for the tiny model (34,176 dense elements: 43 units)
STEPS = 2  # train_step calls (2 minibatches each: 4 AdamW updates)


# --- the elementwise premise and the unit rule (no processes) ---------------------------------------
def _adamw(params, grads, steps=3):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, foreach=False, fused=False)
    for s in range(steps):
        for p, g in zip(ps, grads):
            p.grad = g[s].clone()
        opt.step()
    return [(p.data, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in ps]


def test_adamw_on_slices_is_bitwise_adamw_on_the_whole_tensor():
    """The premise of sharding by slices: torch's single-tensor AdamW (foreach=False, fused=False)
    gives every element the same bits whether it runs on the whole tensor or on a slice, also at
    offsets that are not multiples of the vector width (the units are 64-aligned anyway) and across
    the intra-op parallel split of a large tensor."""
    g = torch.Generator().manual_seed(0)
    for n in (200_003, 4_099, 77):
        p = torch.randn(n, generator=g)
        grads = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 3, (n,), generator=g) for _ in range(3)]
        (whole,) = _adamw([p], [grads])
        every13 = [[*range(0, n, 13), n]] if n < 10_000 else []  # many unaligned pieces (small n: fast)
        for cuts in ([0, 7, n // 3, n // 2 + 5, n], [0, 64, n - n % 64, n], *every13):
            cuts = sorted(set(cuts))
            pieces = _adamw([p[a:b] for a, b in zip(cuts, cuts[1:])],
                            [[x[a:b] for x in grads] for a, b in zip(cuts, cuts[1:])])
            for i in range(3):  # weights, exp_avg, exp_avg_sq
                assert same_bits(torch.cat([t[i] for t in pieces]), whole[i]), (n, cuts[:4], i)


def test_the_chunked_sum_of_squares_is_bitwise_the_tree_of_squares():
    """Trainer.grad_norm's dense part (and per-expert rows) without a second full-size copy: the same
    bits as fo.tree_sum(x ** 2) (the norm of the unsharded trainer), whatever the chunk; the twin
    (another grouping: chunks summed one after the other) differs."""
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 64, 1000, 1024, 1025, 77_777):
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 4, (n,), generator=g)
        want = fo.tree_sum(x**2, 0)
        for chunk in (1, 7, 64, 1 << 24):
            assert same_bits(sum_of_squares(x, chunk), want), (n, chunk)
    y = torch.randn(77_777, generator=g)
    pieces = [fo.tree_sum(y[a : a + 1000] ** 2, 0) for a in range(0, len(y), 1000)]
    assert not same_bits(sum(pieces[1:], pieces[0]), sum_of_squares(y, 1000))
    for shape in ((3, 1), (4, 5), (3, 77_777), (2, 1024)):  # per row: the grad norm's per-expert sums
        x = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-4, 4, shape, generator=g)
        want = fo.tree_sum(x**2, 1)
        for chunk in (1, 7, 1000, 1 << 24):
            assert same_bits(sum_of_squares(x, chunk), want), (shape, chunk)


def test_units_are_fixed_by_shapes_and_budget_and_balanced_at_every_world_size():
    shapes = [("a", (151, 2048)), ("b", (2048,)), ("c", (7, 3)), ("d", (5000, 6)), ("e", (1,))]
    units = dense_units(shapes, 4096)
    for name, shape in shapes:  # each parameter covered exactly, in order, 64-aligned starts
        mine = [u for u in units if u.name == name]
        assert mine[0].lo == 0 and mine[-1].hi == shape[0] and all(a.hi == b.lo for a, b in zip(mine, mine[1:]))
        row = shape[1] if len(shape) > 1 else 1
        assert all(u.lo * row % UNIT_ALIGN == 0 for u in mine)
        assert all(u.numel <= max(4096, row * UNIT_ALIGN) for u in mine)
        assert (len(mine) == 1) == (mine[0].key == name)
    assert [u.key for u in units[:2]] == ["a/rows0-2", "a/rows2-4"]
    total, biggest = sum(u.numel for u in units), max(u.numel for u in units)
    for world in range(1, 9):
        owner = assign_units([u.numel for u in units], world)
        assert owner == sorted(owner) and owner[0] == 0  # contiguous runs in unit order
        share = [sum(u.numel for u, r in zip(units, owner) if r == k) for k in range(world)]
        assert sum(share) == total and all(abs(s - total / world) <= biggest for s in share), (world, share)


def test_a_bad_shard_unit_is_refused_naming_the_key():
    for bad in (0, 100, -64):
        with pytest.raises(ConfigError, match=rf"trainer.shard_unit_numel={bad}: must be a positive multiple of 64"):
            load_config(["trainer.shard_dense=true", f"trainer.shard_unit_numel={bad}"])
    with pytest.raises(ConfigError, match="trainer.shard_dense=maybe"):
        load_config(["trainer.shard_dense=maybe"])
    assert load_config(["trainer.shard_dense=true", "trainer.shard_unit_numel=64"]).trainer.shard_dense is True


# --- spawned gloo ranks ----------------------------------------------------------------------------
def _samples():
    g = torch.Generator().manual_seed(3)
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample

    out = []
    for i in range(8):
        prompt = torch.randint(2, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(2, 64, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(prompt, resp, torch.full((len(resp),), -2.0), (-1.0) ** i * (1 + i / 10), i,
                          params=SamplingParams()))
    return out


def _cfg(ep: int, shard: bool) -> dict:
    # fp32 (bf16 gradients often sum exactly in any order); a small clip: the norm's bits reach the weights
    cfg = load_config(["model.dtype=float32", f"trainer.ep_size={ep}", "trainer.micro_batch_size=2",
                       "trainer.weight_decay=0.01", "trainer.grad_clip=0.05", f"trainer.shard_unit_numel={UNIT}",
                       f"trainer.shard_dense={str(shard).lower()}", "dist.timeout_s=60"])
    return OmegaConf.to_container(cfg, resolve=True)


def _dense_state_numel(tr) -> dict[str, int]:
    """Elements of dense fp32 state a rank holds: masters, AdamW moments, gradients (the memory
    record of dense sharding; the compute-dtype model copy is whole on every rank)."""
    out = {"master": 0, "adamw": 0, "grad": 0}
    for u in tr.my_units():
        m, g, st = tr.weights.held(u, tr.grads)
        out["master"] += m.numel()
        out["adamw"] += sum(st[k].numel() for k in ("exp_avg", "exp_avg_sq") if k in st)
        out["grad"] += 0 if g is None else g.numel()
    return out


def _partial_sum_norm(tr):
    """Negative twin of Trainer.grad_norm: each rank adds its own units' sums of squares one after
    the other, then the ranks' partial sums are added in rank order (what a sharded norm without
    the whole gradient would do; its grouping depends on the units and the EP size)."""
    import torch.distributed as dist

    from rlalign.kernels import fixed_order as fo
    from rlalign.training.shards import unit_rows

    sq = [fo.tree_sum(unit_rows(tr.grads[u.name], u).reshape(-1) ** 2, 0) for u in tr.my_units()]
    dense = sum(sq[1:], sq[0]) if sq else torch.zeros(())
    if tr.world > 1:
        parts = [torch.empty_like(dense) for _ in range(tr.world)]
        dist.all_gather(parts, dense, group=tr.group)
        dense = parts[0]
        for p in parts[1:]:
            dense = dense + p
    expert = torch.cat([fo.tree_sum(tr.grads[n].reshape(tr.grads[n].shape[0], -1) ** 2, 1) for n in tr.expert_names])
    if tr.world > 1:
        parts = [torch.empty_like(expert) for _ in range(tr.world)]
        dist.all_gather(parts, expert, group=tr.group)
        expert = torch.stack([p.view(len(tr.expert_names), -1) for p in parts], 1).reshape(-1)
    return float(torch.sqrt(dense + fo.tree_sum(expert, 0)))


def _state(tr) -> dict[str, torch.Tensor]:
    """This rank's checkpoint state and trace records (world- and sharding-independent keys)."""
    out = {f"ckpt/{k}": v.detach().clone() for k, v in tr.checkpoint_state().items()}
    out.update({f"trace/{k}": v.detach().clone() for k, v in tr.topology_records().items()})
    return out


def _job(rank, world, group, jobs, ckpt_path=None):
    """Each job: (cfg dict, what) with what in {'train', 'twin', 'save', 'load'}. 'train'/'twin':
    STEPS train_steps from the initial weights; 'save': the same, writing a checkpoint after the
    first step; 'load': the checkpoint of ckpt_path, then the remaining STEPS - 1. Returns per job
    (this rank's state, stat records, dense numel after the run, dense numel after construction)."""
    from rlalign import kernels
    from rlalign.training.trainer import Trainer

    out = []
    for cfg_dict, what in jobs:
        cfg = OmegaConf.create(cfg_dict)
        kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
        tr = Trainer(cfg, group)
        built = _dense_state_numel(tr)
        if what == "twin":
            tr.grad_norm = lambda tr=tr: _partial_sum_norm(tr)
        alg = OmegaConf.create({**cfg_dict["algorithm"], "num_minibatches": 2})
        steps = range(STEPS)
        if what == "load":
            ckpt.load_shards(tr.checkpoint_state(), ckpt_path, rank, group)
            steps = range(1, STEPS)
        records = []
        for step in steps:
            _, rec = tr.train_step(_samples(), alg)
            records += [((step, *k), v) for k, v in rec]
            if what == "save" and step == 0:
                ckpt.save_shards(tr.checkpoint_state(), ckpt_path, rank, group)
        out.append((_state(tr), sorted(records), _dense_state_numel(tr), built))
    return out


def _run(ep, jobs, ckpt_path=None):
    from rlalign.parallel import launch

    if ep == 1:
        return [_job(0, 1, None, jobs, ckpt_path)]
    return launch.run_workers(ep, _job, (jobs, ckpt_path), timeout_s=180)


def _union(ranks: list, j: int) -> dict[str, torch.Tensor]:
    """Job j's state over all ranks; a key held by several ranks (replicated) must be equal bits."""
    out = {}
    for r in ranks:
        for k, v in r[j][0].items():
            assert k not in out or same_bits(out[k], v), k
            out[k] = v
    return out


def _records(ranks: list, j: int) -> list:
    return sorted({rec[0]: rec for r in ranks for rec in r[j][1]}.values(), key=lambda rec: rec[0])


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return [k for k in a if not same_bits(a[k], b[k])]


@pytest.mark.slow
def test_sharded_dense_is_bitwise_unsharded_across_ep_1_2_4_reshards_checkpoints_and_holds_1_over_w(tmp_path):
    tmp = ckpt.tmp_path(tmp_path, 0)
    ep2 = _run(2, [(_cfg(2, False), "train"), (_cfg(2, True), "save"), (_cfg(2, True), "twin")], str(tmp))
    path = ckpt.complete(tmp_path, 0, {}, keep=0)
    ep1 = _run(1, [(_cfg(1, False), "train"), (_cfg(1, True), "train"), (_cfg(1, False), "load")], str(path))
    ep4 = _run(4, [(_cfg(4, True), "load")], str(path))  # step 1 (2 updates) sharded at EP 4
    ref, ref_records = _union(ep1, 0), _records(ep1, 0)
    assert any("/rows" in k for k in ref) and any("/expert" in k for k in ref)  # units and experts both keyed

    # bits: sharded == unsharded at the same EP size and at EP 1, 2 (weights, AdamW, grads, masters);
    # EP 4 below (it resumes the EP-2 checkpoint)
    for name, ranks, j in (("unsharded ep2", ep2, 0), ("sharded ep1", ep1, 1), ("sharded ep2", ep2, 1)):
        assert _differing(ref, _union(ranks, j)) == [], name
        assert _records(ranks, j) == ref_records, name  # grad norms and per-micro-batch stats
    # negative twin: a norm from per-rank partial sums (EP-size-dependent grouping) changes the bits
    twin = _differing(ref, _union(ep2, 2))
    assert any(k.startswith("ckpt/master/") for k in twin), twin
    norms = lambda rec: [v["grad_norm_last"] for _, v in rec if "grad_norm_last" in v]  # noqa: E731
    assert norms(_records(ep2, 2)) != norms(ref_records)

    # checkpoint: saved sharded at EP 2 after step 0, loaded unsharded at EP 1 and sharded at EP 4,
    # one more step == the uninterrupted run (the same keys at every EP size, sharded or not)
    assert ckpt.read_meta(path)["world"] == 2
    assert _differing(ref, _union(ep1, 2)) == [], "resumed unsharded ep1"
    assert _differing(ref, _union(ep4, 0)) == [], "resumed sharded ep4"
    assert _records(ep1, 2) == _records(ep4, 0) == [r for r in ref_records if r[0][0] >= 1]

    # memory: each sharded rank holds ~1/W of the dense masters, AdamW moments and gradients
    total = ep1[0][0][2]["master"]
    assert ep1[0][0][2] == {"master": total, "adamw": 2 * total, "grad": total}  # unsharded: everything
    assert ep2[0][0][2] == ep2[1][0][2] == ep1[0][0][2]
    for ranks, j in ((ep2, 1), (ep4, 0)):
        world = len(ranks)
        held = [r[j][2] for r in ranks]
        assert sum(h["master"] for h in held) == total
        for h, r in zip(held, ranks):
            assert abs(h["master"] / total - 1 / world) <= UNIT / total, (world, h)
            assert h["adamw"] == 2 * h["master"] and h["grad"] == h["master"]
            assert r[j][3]["master"] == h["master"]  # from construction on, not only after a step


@pytest.mark.slow
def test_baseline_gate_unsharded_ep1_vs_sharded_ep2_through_the_ray_job(tmp_path):
    """The whole job (Ray actors, traces, the gate's trainer-state comparison by name): every
    metric, trace stream and trainer-state record of a sharded EP-2 run equals an unsharded EP-1 run."""
    from rlalign.gates import run_gate

    over = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=3", "generator.ep_size=1",
            "model.dtype=float32", f"trainer.shard_unit_numel={UNIT}", "trainer.grad_clip=0.05", "trainer.ep_size=1",
            "run.steps=2", "checkpoint.every=0", 'gate.candidate=["trainer.ep_size=2","trainer.shard_dense=true"]']
    ok, text = run_gate("baseline", over, load_config([*over, f"run.dir={tmp_path}"]))
    assert ok, text
    assert "trainer state (gradients, AdamW moments, weights per global expert): identical" in text
    traces = tmp_path / "gate-baseline" / "b" / "traces"
    assert "embed_tokens.weight/rows0-16" in (traces / "trainer-rank0.jsonl").read_text()  # units on their owner
    assert "lm_head.weight/rows0-16" in (traces / "trainer-rank1.jsonl").read_text()
