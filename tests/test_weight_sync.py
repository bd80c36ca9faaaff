"""Weight sync on the device (rlalign.parallel.weight_sync): the generator holds the trainer's bits
at every trainer/generator EP pair, and the device fingerprints name a corrupted tensor.

The ranks are the real TrainerWorker / GeneratorWorker (the classes Ray hosts), each side with its
own process group, plus the trainer-rank-0 + generator-ranks sync group they build themselves;
spawned gloo processes stand in for the actors (the Ray path runs in tests/test_train.py)."""

import pytest
import torch
import torch.distributed as dist
from conftest import same_bits
from omegaconf import OmegaConf

from rlalign.config import load_config
from rlalign.fingerprint import state_fingerprints
from rlalign.parallel import launch, weight_sync
from rlalign.parallel.launch import LOCAL_HOST
from rlalign.parallel.weight_sync import SyncError

pytestmark = pytest.mark.slow

BUCKET = 64 << 10  # bytes: several buckets even for the tiny model, experts split across them


def _cfg(seed: int) -> dict:
    return OmegaConf.to_container(load_config([f"model.init_seed={seed}", "dist.timeout_s=60"]), resolve=True)


def _sync_rank(rank, world, group, n, m, tamper):
    """Trainer ranks 0..n-1 (init seed 1), generator ranks n..n+m-1 (init seed 0): one sync. Returns
    (side, before, after, SyncOutput) with the unsharded weights on each side's rank 0."""
    from rlalign.workers import GeneratorWorker, TrainerWorker

    t_group, g_group = dist.new_group(list(range(n))), dist.new_group(list(range(n, n + m)))
    if rank < n:
        w = TrainerWorker(_cfg(1), rank, n, group=t_group if n > 1 else None)
        side, before = "trainer", w.full_state()[0]
    else:
        w = GeneratorWorker(_cfg(0), rank - n, m, group=g_group if m > 1 else None)
        side, before = "generator", w.full_state()
    specs, port = w.prepare_weight_sync(BUCKET, 1 + m if side == "trainer" else 0, LOCAL_HOST)
    box = [port]
    dist.broadcast_object_list(box, src=0)  # trainer rank 0's store port, to everyone
    w.join_weight_sync(LOCAL_HOST, box[0], 0 if rank == 0 else (rank - n + 1 if side == "generator" else -1), 1 + m)
    if side == "trainer":
        out = w.send_weights()
        after = w.full_state()[0]
    else:
        hook = None
        if tamper is not None and tamper[0] == w.rank:
            _, bucket, offset = tamper

            def hook(i, buf):
                if i == bucket:
                    buf[offset] ^= 1  # one bit of one received bucket

        out = weight_sync.receive(w.model, w._plan, w.rank, w.world, w.group, w._sync, tamper=hook)
        after = w.full_state()
    return side, specs, before, after, out


def _run(n: int, m: int, tamper=None):
    res = launch.run_workers(n + m, _sync_rank, (n, m, tamper), timeout_s=240)
    trainer, generator = res[:n], res[n:]
    specs = trainer[0][1]
    weight_sync.check_specs(specs, generator[0][1])
    fps = weight_sync.merge(specs, [r[4].shares for r in trainer], "trainer", dense_on_all=False)
    return trainer, generator, specs, fps, [r[4].shares for r in generator]


@pytest.mark.parametrize("n,m", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_generator_holds_the_trainers_bits_at_every_ep_pair(n, m):
    trainer, generator, specs, fps, gen_shares = _run(n, m)
    want, before, got = trainer[0][3], generator[0][2], generator[0][3]
    assert sorted(want) == sorted(got)
    assert not all(same_bits(before[k], want[k]) for k in want)  # the sync had something to move
    assert all(same_bits(got[k], want[k]) for k in want)
    gen = weight_sync.merge(specs, gen_shares, "generator", dense_on_all=True)
    assert weight_sync.check(fps, gen)
    # the merged shares are the full tensors' fingerprints, whatever the EP size: the unsharded
    # tensors' own (one launch on the host copies), as a trace or a checkpoint records them
    assert gen == state_fingerprints({name: want[name] for name, *_ in specs})
    out, raw = trainer[0][4], sum(t.numel() * t.element_size() for t in want.values())
    assert out.buckets > 2 and raw <= out.bytes < raw + 256 * len(specs)  # buckets move alignment padding too


def _expert_entry():
    """The first expert tensor: (bucket index, byte offset of its middle, name)."""
    from rlalign.workers import GeneratorWorker

    w = GeneratorWorker(_cfg(0), 0, 1)
    plan = weight_sync.make_plan(weight_sync.tensor_specs(w.model, 1), BUCKET)
    return next((i, e.offset + e.nbytes // 2, e.name) for i, b in enumerate(plan.buckets) for e in b.entries
                if e.expert)


def test_a_flipped_bit_in_one_bucket_is_named_by_the_device_fingerprints():
    bucket, offset, name = _expert_entry()
    trainer, generator, specs, fps, gen_shares = _run(2, 1, tamper=(0, bucket, offset))
    gen = weight_sync.merge(specs, gen_shares, "generator", dense_on_all=True)
    with pytest.raises(SyncError, match=rf"tensor '{name}' differs between trainer and generator"):
        weight_sync.check(fps, gen)
    assert [k for k in fps if fps[k] != gen[k]] == [name]  # that tensor only
    assert not same_bits(generator[0][3][name], trainer[0][3][name])


def test_a_bad_dense_copy_on_one_generator_rank_is_named_with_the_rank():
    from rlalign.workers import GeneratorWorker

    plan = weight_sync.make_plan(weight_sync.tensor_specs(GeneratorWorker(_cfg(0), 0, 1).model, 1), BUCKET)
    bucket, e = next((i, e) for i, b in enumerate(plan.buckets) for e in b.entries if not e.expert)
    _, _, specs, _, gen_shares = _run(1, 2, tamper=(1, bucket, e.offset + 1))
    with pytest.raises(SyncError, match=rf"generator rank 1 holds tensor '{e.name}' with fingerprint"):
        weight_sync.merge(specs, gen_shares, "generator", dense_on_all=True)


def test_plan_buckets_per_dtype_within_the_size_and_specs_mismatch_named():
    specs = [("a", torch.bfloat16, (3, 5), False), ("b", torch.float32, (7,), False),
             ("c", torch.bfloat16, (4, 100), True), ("d", torch.bfloat16, (2,), False)]
    plan = weight_sync.make_plan(specs, 512)
    assert [(str(b.dtype), [e.name for e in b.entries]) for b in plan.buckets] == [
        ("torch.bfloat16", ["a"]), ("torch.bfloat16", ["c"]), ("torch.bfloat16", ["d"]), ("torch.float32", ["b"])]
    assert all(e.offset % 256 == 0 for b in plan.buckets for e in b.entries)
    assert plan.buckets[1].nbytes == 800  # larger than the bucket size: a bucket of its own
    other = [*plan.specs()[:2], ("d", "torch.float32", (2,), False), *plan.specs()[3:]]
    with pytest.raises(SyncError, match=r"the trainer's tensor \('d', 'torch.bfloat16', \(2,\), False\) meets"):
        weight_sync.check_specs(plan.specs(), other)
    with pytest.raises(SyncError, match=r"only the trainer has tensor \('b'"):
        weight_sync.check_specs(plan.specs(), plan.specs()[:3])


def test_direct_colocated_protocol_trainer_shares_come_with_its_step(monkeypatch):
    """The colocated one-rank-per-side sync (CUDA IPC on a GPU; here the trainer's tensors handed over
    in-process): handles once, then each train_step returns the trainer's fingerprints of its updated
    weights and the generator copies from the views it kept; both sides agree. Twin: a parameter that
    moved makes train_step return none (the driver then asks send_weights, which hands out handles)."""
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.workers import GeneratorWorker, TrainerWorker

    monkeypatch.setattr(weight_sync, "reduce_tensor", lambda t: (lambda t=t: t, ()))
    t, g = TrainerWorker(_cfg(1), 0, 1), GeneratorWorker(_cfg(0), 0, 1)
    specs, _ = t.prepare_weight_sync(BUCKET)
    g.prepare_weight_sync(BUCKET)

    def check(t_out, g_out):
        return weight_sync.check(weight_sync.merge(specs, [t_out.shares], "trainer", dense_on_all=False),
                                 weight_sync.merge(specs, [g_out.shares], "generator", dense_on_all=True))

    first = t.send_weights(True, True)
    assert first.ipc is not None and first.direct
    fp0 = check(first, g.receive_weights(-1, first.ipc, first.device_uuid, True))
    alg = OmegaConf.to_container(load_config([]).algorithm)
    outs = g.generate([[3, 4, 5]] * 4, [0, 1, 2, 3], SamplingParams.from_config(load_config([]), None, 1, 8)).rollouts
    samples = [Sample([3, 4, 5], r.tokens, r.logprobs, 0.5 * i - 0.75, r.sample_id, params=r.params)
               for i, r in enumerate(outs)]
    out = t.train_step(samples, alg, 0)
    assert out.sync is not None and out.sync.ipc is None
    fp1 = check(out.sync, g.receive_weights(0, None, None, True))
    assert fp1 != fp0 and same_bits(t.full_state()[0][specs[0][0]], g.full_state()[specs[0][0]])
    p = next(iter(t.trainer.model.parameters()))
    p.data = p.data.clone()
    assert t.train_step(samples, alg, 1).sync is None
    assert t.send_weights(True, True).ipc is not None


def test_the_direct_sync_holds_the_trainers_bits_and_names_a_changed_or_swapped_source():
    """receive_direct (the colocated one-rank-per-side sync, in-process): the generator's parameters
    hold the trainer's bits and its shares equal the trainer's, taken after its update. Twins: a
    trainer parameter changed by one bit after its hash, and two sources of one shape handed over
    swapped, are each named by `check`."""
    from rlalign.model.build import model_from_config

    trainer, gen = (model_from_config(load_config([f"model.init_seed={s}", "model.num_layers=1"])) for s in (1, 0))
    plan = weight_sync.make_plan(weight_sync.tensor_specs(trainer, 1), BUCKET)
    specs = plan.specs()
    params = dict(trainer.named_parameters())
    sources = [params[name].detach() for name, *_ in specs]
    fps = weight_sync.merge(specs, [weight_sync.partial_fingerprints(trainer, plan, 0, 1)], "trainer", False)

    def synced(srcs):
        out = weight_sync.receive_direct(gen, plan, srcs)
        return weight_sync.check(fps, weight_sync.merge(specs, [out.shares], "generator", True))

    assert synced(sources) == weight_sync.combined(fps)
    assert all(same_bits(p, params[n]) for n, p in gen.named_parameters())
    i, j = next((i, j) for i in range(len(specs)) for j in range(i + 1, len(specs))
                if specs[i][1:3] == specs[j][1:3])
    swapped = list(sources)
    swapped[i], swapped[j] = sources[j], sources[i]
    with pytest.raises(SyncError, match=rf"tensor '{specs[i][0]}' differs between trainer and generator"):
        synced(swapped)
    with torch.no_grad():
        sources[-1].view(-1)[3:4].view(torch.int16)[0] ^= 1
    with pytest.raises(SyncError, match=rf"tensor '{specs[-1][0]}' differs between trainer and generator"):
        synced(sources)
