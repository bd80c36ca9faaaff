"""Expert parallelism over gloo process groups: EP size changes not a single bit."""

import os
import time

import pytest
import torch
from conftest import same_bits
from omegaconf import OmegaConf

from rlalign.agree import batch_params, generate_batch, random_prompts, run_agree, score_batch
from rlalign.config import ConfigError, load_config
from rlalign.monitor.consistency import logprob_consistency
from rlalign.parallel import launch

pytestmark = pytest.mark.slow


def _cfg(*over):
    return load_config(["agree.num_prompts=64", "agree.max_new_tokens=40", *over])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_trainer_ep_agrees_with_every_generator_ep(dtype):
    """trainer EP {1,2,4} x generator EP {1,2}: each generator batch rescored at each trainer EP."""
    base = _cfg(f"model.dtype={dtype}")
    prompts = random_prompts(base, 64)
    ids = list(range(len(prompts)))
    gens = {ep: generate_batch(_cfg(f"model.dtype={dtype}", f"generator.ep_size={ep}"), prompts, ids,
                               batch_params(base, 0)) for ep in (1, 2)}
    # the generator's own EP size changes nothing either
    assert all(a.tokens == b.tokens and same_bits(a.logprobs, b.logprobs) for a, b in zip(gens[1], gens[2]))
    ro = gens[1]
    assert sum(len(r.tokens) for r in ro) >= 2000
    P, R = [r.prompt for r in ro], [r.tokens for r in ro]
    scored = {}
    for ep in (1, 2, 4):
        cfg = _cfg(f"model.dtype={dtype}", f"trainer.ep_size={ep}", "trainer.micro_batch_size=5")
        scored[ep] = score_batch(cfg, P, R, ro[0].params)
    for ep in (1, 2, 4):  # the trainer's logprobs are bitwise equal at EP 1, 2 and 4 ...
        assert all(same_bits(a, b) for a, b in zip(scored[ep], scored[1]))
        for g in (1, 2):  # ... and equal to what each generator EP sampled with
            c = logprob_consistency([r.logprobs for r in gens[g]], scored[ep])
            assert c["mismatched_tokens"] == 0 and c["logprob_abs_diff_max"] == 0.0, (ep, g)


def test_agree_command_at_trainer_ep4_generator_ep2():
    res, _ = run_agree(load_config(["trainer.ep_size=4", "generator.ep_size=2", "trainer.micro_batch_size=3"]))
    assert res["trainer_ep"] == 4 and res["generator_ep"] == 2
    assert res["tokens"] >= 2000 and res["mismatched_tokens"] == 0 and res["max_abs_diff"] == 0.0


@pytest.mark.parametrize("over", [
    ["agree.num_prompts=1", "trainer.ep_size=4", "generator.ep_size=4"],  # ranks 1-3 of both sides get no rows
    ["agree.num_prompts=2", "generator.ep_size=2", "seed=1"],  # one generator rank finishes first
    ["agree.num_prompts=3", "trainer.ep_size=2", "trainer.micro_batch_size=1"],  # one rank runs out of micro-batches
])
def test_ep_ranks_with_no_rows_run_the_empty_forward_and_agree(over):
    res, _ = run_agree(load_config(over))
    assert res["tokens"] > 0 and res["mismatched_tokens"] == 0 and res["max_abs_diff"] == 0.0


def test_negative_twin_default_mode_under_ep_reports_mismatch():
    res, _ = run_agree(load_config(["kernels.mode=default", "trainer.ep_size=2", "trainer.micro_batch_size=3"]))
    assert res["mismatched_tokens"] > 0 and res["max_abs_diff"] > 0


def _grads_rank(rank, world, group, cfg_dict, prompts, responses, steps):
    """`steps` optimizer steps of -sum(logprob) on the trainer at this EP size: fingerprints of the
    first step's full gradients and of the final weights, and (rank 0) those gradients."""
    from omegaconf import OmegaConf

    from rlalign import kernels
    from rlalign.fingerprint import state_fingerprints
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    trainer = Trainer(cfg, group)
    # the whole step
    samples = [Sample(p, r, torch.zeros(len(r)), params=SamplingParams()) for p, r in zip(prompts, responses)]
    first = None
    for _ in range(steps):
        trainer.forward_backward(samples, lambda lps, idx: (-torch.cat(lps).sum(), {}))
        trainer.reduce_grads()
        if first is None:
            first = {}
            for n, g in trainer.grads.items():
                if ".mlp.experts." in n:
                    parts = [torch.empty_like(g) for _ in range(world)]
                    torch.distributed.all_gather(parts, g.contiguous(), group=group)
                    g = torch.cat(parts, 0)
                first[n] = g
        trainer.optimizer_step()
    return {"grad_fps": state_fingerprints(first), "weight_fps": state_fingerprints(trainer.full_state_dict()),
            "grads": first if rank == 0 else None}


def test_gradients_are_bit_identical_run_to_run_at_ep2():
    cfg = _cfg("model.dtype=float32", "agree.num_prompts=12", "agree.max_new_tokens=12")
    ro = generate_batch(cfg, random_prompts(cfg, 64), list(range(12)), batch_params(cfg, 0))
    ep2 = load_config(["model.dtype=float32", "trainer.ep_size=2", "trainer.micro_batch_size=2"])
    args = (OmegaConf.to_container(ep2, resolve=True), [r.prompt for r in ro], [r.tokens for r in ro], 2)
    a = launch.run_workers(2, _grads_rank, args)[0]
    b = launch.run_workers(2, _grads_rank, args)[0]
    assert a["grad_fps"] == b["grad_fps"] and a["weight_fps"] == b["weight_fps"]
    assert any(v.abs().sum() > 0 for k, v in a["grads"].items() if "experts" in k)


def test_ep_size_must_divide_num_experts_before_any_process_starts():
    with pytest.raises(ConfigError, match=r"trainer.ep_size=3 does not divide the model's num_experts=8"):
        load_config(["trainer.ep_size=3"])
    with pytest.raises(ConfigError, match=r"generator.ep_size=0: must be >= 1"):
        load_config(["generator.ep_size=0"])


def test_ep_size_beyond_available_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"trainer.ep_size=4 needs 4 GPUs \(one rank each\); this machine has 2"):
        launch.check_local_world(4, "cuda", "trainer.ep_size")


def _die_mid_step(rank, world, group, delay):
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    if rank == 1:
        time.sleep(delay)
        os._exit(7)  # killed mid-step: no message, no result
    dist.all_reduce(t, group=group)  # rank 0 now waits on a peer that is gone
    return "unreachable"


def _raise_on_rank(rank, world, group):
    if rank == 2:
        raise RuntimeError("reward model exploded")
    import torch.distributed as dist

    dist.barrier(group=group)


def test_a_dead_rank_fails_the_others_fast_with_its_name():
    # a driver that waited for the collective timeout would raise a timeout, not name the dead rank
    with pytest.raises(launch.WorkerError, match=r"rank 1 of 2 died \(exit code 7\)"):
        launch.run_workers(2, _die_mid_step, (0.5,), timeout_s=120)
    with pytest.raises(launch.WorkerError, match=r"rank 2 of 3 failed: RuntimeError: reward model exploded"):
        launch.run_workers(3, _raise_on_rank, (), timeout_s=120)


def _env_of(rank, world, group, name):
    return os.environ.get(name)


def _put_env(q, name):
    q.put(os.environ.get(name))


def test_ranks_run_with_the_callers_environment_of_each_call(monkeypatch):
    """The ranks fork from a server started at the first call; each call's ranks still see the
    caller's environment as it is now (as spawned processes would)."""
    import multiprocessing as mp

    name = "RLALIGN_TEST_RANK_ENV"
    monkeypatch.setenv(name, "first")
    assert launch.run_workers(2, _env_of, (name,)) == ["first", "first"]
    monkeypatch.setenv(name, "second")
    assert launch.run_workers(2, _env_of, (name,)) == ["second", "second"]
    q = mp.get_context("forkserver").SimpleQueue()  # the twin: a bare child of the same server
    p = mp.get_context("forkserver").Process(target=_put_env, args=(q, name))
    p.start()
    p.join()
    assert q.get() != "second"  # keeps the server's environment


def test_shard_range_covers_everything_once():
    for n in (0, 1, 5, 64):
        for w in (1, 2, 3, 4):
            parts = [list(launch.shard_range(n, w, r)) for r in range(w)]
            assert sum(parts, []) == list(range(n))


def _train_with_all_tokens_on_rank0_experts(rank, world, group, cfg_dict):
    """Zero router weights: every top-k tie goes to experts 0 and 1, all owned by rank 0, so rank 1's
    experts see no rows in any layer. Its backward must still take part in every all-to-all."""
    from omegaconf import OmegaConf

    from rlalign import kernels
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = OmegaConf.create(cfg_dict)
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, group)
    with torch.no_grad():
        for layer in tr.model.model.layers:
            layer.mlp.gate.weight.zero_()
    samples = [Sample([3 + rank, 4, 5], [6, 7, 8, 9], torch.zeros(4), params=SamplingParams()) for _ in range(3)]

    def loss_fn(lps, idx):
        return -torch.cat(lps).sum(), {}

    tr.forward_backward(samples, loss_fn, 24)
    tr.optimizer_step()
    return tr.grad_norm()


def test_ranks_whose_experts_get_no_rows_stay_in_lockstep():
    cfg = load_config(["trainer.ep_size=2", "dist.timeout_s=30", "trainer.micro_batch_size=2"])
    from omegaconf import OmegaConf

    norms = launch.run_workers(2, _train_with_all_tokens_on_rank0_experts,
                               (OmegaConf.to_container(cfg, resolve=True),), timeout_s=30)
    assert norms[0] == norms[1] and norms[0] > 0


def test_the_launchers_store_holds_its_port_from_the_start():
    """A group's rendezvous store binds a port the OS picks and holds it: no other process can bind
    it before the ranks join. Twin: the old way (probe a free port, release it, let rank 0 bind it
    later) leaves a window in which anyone can take it."""
    import socket

    from rlalign.parallel.launch import host_store

    store = host_store("127.0.0.1", 5.0)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        probed = s.getsockname()[1]
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", probed))  # taken by another job before rank 0 binds it


_CUT = "RuntimeError: Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [10.0.0.1]:26771"


def test_a_launch_whose_join_lost_gloos_connect_race_is_tried_again():
    assert launch.join_lost_race({1: ("join-error", _CUT)}, {}, {})


def test_negative_twin_a_launch_that_ran_fn_timed_out_or_lost_a_rank_is_not_tried_again():
    assert not launch.join_lost_race({1: ("error", _CUT)}, {}, {})  # fn had started
    assert not launch.join_lost_race({1: ("join-error", _CUT)}, {0: "result"}, {})
    assert not launch.join_lost_race({1: ("join-error", _CUT)}, {}, {0: -9})  # a rank died silently
    assert not launch.join_lost_race({1: ("join-error", "Gloo connectFullMesh failed: Timed out")}, {}, {})
    assert not launch.join_lost_race({1: ("join-error", "ValueError: bad interface")}, {}, {})
