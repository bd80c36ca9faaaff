"""GPU: weight sync on the device without Ray. NCCL: trainer on GPU 0 -> generator on GPU 1 over the
trainer-rank-0 + generator group; colocated: both on GPU 0, buckets through CUDA IPC. The generator's
weights must be the trainer's bits, and the device fingerprints equal the host-side recomputation."""

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from rlalign.config import load_config
from rlalign.fingerprint import state_fingerprints
from rlalign.parallel import launch, weight_sync
from rlalign.parallel.launch import LOCAL_HOST

pytestmark = pytest.mark.gpu

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUCKET = 1 << 20


def _cfg(seed: int, device: str) -> dict:
    return OmegaConf.to_container(load_config([f"model.init_seed={seed}", f"device={device}", "model=bench-moe",
                                               "model.num_layers=2"]), resolve=True)


def _full(model) -> dict:
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _nccl_rank(rank, world, group):
    from rlalign.workers import GeneratorWorker, TrainerWorker

    w = TrainerWorker(_cfg(1, "cuda"), 0, 1) if rank == 0 else GeneratorWorker(_cfg(0, "cuda"), 0, 1)
    specs, port = w.prepare_weight_sync(BUCKET, 2 if rank == 0 else 0, LOCAL_HOST)
    box = [port]
    dist.broadcast_object_list(box, src=0)
    w.join_weight_sync(LOCAL_HOST, box[0], rank, 2)
    out = w.send_weights() if rank == 0 else w.receive_weights()
    model = w.trainer.model if rank == 0 else w.model
    return specs, out, _full(model)


def _ipc_rank(rank, world, group):
    from rlalign.workers import GeneratorWorker, TrainerWorker

    w = TrainerWorker(_cfg(1, "cuda:0"), 0, 1) if rank == 0 else GeneratorWorker(_cfg(0, "cuda:0"), 0, 1)
    specs, _ = w.prepare_weight_sync(BUCKET)
    box = [w.send_weights(ipc=True) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # the IPC handles, through gloo here (through Ray in a job)
    out = box[0] if rank == 0 else w.receive_weights(-1, box[0].ipc, box[0].device_uuid)
    dist.barrier()  # the generator has copied: the trainer may drop its buckets
    if rank == 0:
        w.free_sync_buckets()
        out.ipc = None
    model = w.trainer.model if rank == 0 else w.model
    return specs, out, _full(model)


def _check(res):
    (specs, t_out, want), (_, g_out, got) = res
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k].view(torch.int16), got[k].view(torch.int16)) for k in want)
    fps = weight_sync.merge(specs, [t_out.shares], "trainer", dense_on_all=False)
    gen = weight_sync.merge(specs, [g_out.shares], "generator", dense_on_all=True)
    weight_sync.check(fps, gen)
    host = state_fingerprints({n: want[n] for n, *_ in specs})  # want: CPU copies (numpy)
    assert fps == host  # device and host compute the same function of the same bits
    assert t_out.buckets > 1


@needs_2_gpus
def test_nccl_sync_gpu0_to_gpu1_is_bitwise():
    _check(launch.run_workers(2, _nccl_rank, (), device="cuda", timeout_s=300))


@needs_gpu
def test_colocated_ipc_sync_is_bitwise():
    _check(launch.run_workers(2, _ipc_rank, (), device="cpu", timeout_s=300))


def _direct_rank(rank, world, group):
    """Three colocated syncs, one rank per side, the generator copying from the trainer's parameters:
    the second after an in-place update (no handles sent: the opened views read the new values), the
    third after a parameter moved (its handles sent again)."""
    from rlalign.workers import GeneratorWorker, TrainerWorker

    w = TrainerWorker(_cfg(1, "cuda:0"), 0, 1) if rank == 0 else GeneratorWorker(_cfg(0, "cuda:0"), 0, 1)
    specs, _ = w.prepare_weight_sync(BUCKET)
    handles, outs = [], []
    for k in range(3):
        if rank == 0 and k == 1:
            with torch.no_grad():
                for p in w.trainer.model.parameters():
                    p.neg_()
        if rank == 0 and k == 2:
            p = next(iter(w.trainer.model.parameters()))
            p.data = p.data.clone() + 1
        box = [w.send_weights(ipc=True, direct=True) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        handles.append(box[0].ipc is not None)
        outs.append(box[0] if rank == 0 else w.receive_weights(-1, box[0].ipc, box[0].device_uuid, True))
        outs[-1].ipc = None
        dist.barrier()  # the generator has copied before the trainer changes its weights again
        model = w.trainer.model if rank == 0 else w.model
        outs[-1] = (outs[-1], _full(model))
    return specs, outs, handles


@needs_gpu
def test_colocated_direct_sync_reads_the_trainers_parameters_bitwise():
    (specs, t_outs, handles), (_, g_outs, _) = launch.run_workers(2, _direct_rank, (), device="cpu", timeout_s=300)
    assert handles == [True, False, True]  # twin: a moved parameter makes the trainer hand out its handles again
    prev = None
    for (t_out, want), (g_out, got) in zip(t_outs, g_outs):
        assert all(torch.equal(want[k].view(torch.int16), got[k].view(torch.int16)) for k in want)
        fps = weight_sync.merge(specs, [t_out.shares], "trainer", dense_on_all=False)
        gen = weight_sync.merge(specs, [g_out.shares], "generator", dense_on_all=True)
        weight_sync.check(fps, gen)
        assert fps == state_fingerprints({n: want[n] for n, *_ in specs}) and fps != prev  # each sync moved new bits
        prev = fps
