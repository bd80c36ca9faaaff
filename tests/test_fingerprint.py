"""The tensor fingerprint (rlalign.kernels.fingerprint): what it sees, that every implementation
gives the same bits (numpy on the CPU, the Triton kernel under TRITON_INTERPRET=1, hence the GPU's
kernel: the same code), that shares add up, and that what it cannot read is named, not skipped."""

import os

import numpy as np
import pytest
import torch

from rlalign.fingerprint import Part, fingerprint, row_fingerprints, state_fingerprints
from rlalign.kernels import fingerprint as fpk


def _interpreted(parts):
    """The Triton kernel's (A, B) under the interpreter (conftest sets TRITON_INTERPRET=1 on a CPU-only host)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (the CPU test run sets it)")
    from rlalign.kernels.triton import fingerprint as tfp

    return tfp.fingerprint_sums(parts).numpy().view(np.uint32)


def _tensors():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(40, 70, generator=g)
    return [
        big,  # one masked BLOCK here; several when BLOCK is patched below
        torch.randn(5, 3, generator=g).bfloat16(),  # 6-byte rows: each row's tail padded (rows=True)
        torch.randint(-5, 100, (9,), generator=g),  # int64
        torch.randn(4, 3, 2, generator=g)[:, 1],  # not contiguous: read through a copy
        torch.randn(7, generator=g).bfloat16()[1:],  # starts 2 bytes into its storage: read through a copy
        torch.zeros(0, 4),
        torch.tensor(3.0),
        torch.tensor([True, False, True]),
        torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),  # 13 bytes: a padded tail word
    ]


def test_the_triton_kernel_under_the_interpreter_gives_numpys_bits():
    ts = _tensors()
    parts = [Part(t) for t in ts] + [Part(ts[0], rows=True), Part(ts[1], rows=True),
                                      Part(ts[0][10:22], first_row=10)]
    want = fpk.sums_cpu(parts)
    assert want.shape == (len(ts) + 40 + 5 + 1, 2)
    assert np.array_equal(_interpreted(parts), want)
    # negative twin: one bit of one element in the kernel's input -> that result alone differs
    flipped = ts[0].clone()
    flipped.view(torch.int32)[23, 45] ^= 1 << 20
    got = _interpreted([Part(flipped)] + parts[1:])
    assert not np.array_equal(got[0], want[0]) and np.array_equal(got[1:len(ts)], want[1:len(ts)])


def test_the_value_is_pinned_so_no_host_can_drift_from_it():
    # integer arithmetic only: these are the definition's bits on any machine (and on the GPU)
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert fingerprint(x) == "7afa5e57437ee2c4"
    assert fingerprint(x.bfloat16()) == "0535c290658502cb"
    assert fingerprint(x) != fingerprint(x + 1)  # negative twin: other values, other bits


def test_the_value_does_not_depend_on_chunking_or_block(monkeypatch):
    from rlalign.kernels.triton import fingerprint as tfp

    parts = [Part(t) for t in _tensors()]
    want = fpk.sums_cpu(parts)
    monkeypatch.setattr(fpk, "CHUNK", 256)  # more programs, each a few blocks
    monkeypatch.setattr(fpk, "_NP_BLOCK", 32)
    monkeypatch.setattr(tfp, "BLOCK", 16)
    assert np.array_equal(fpk.sums_cpu(parts), want)
    assert np.array_equal(_interpreted(parts), want)


def test_the_work_table_from_cached_per_part_chunks_equals_one_built_directly(monkeypatch):
    monkeypatch.setattr(fpk, "CHUNK", 64)  # several chunks a row
    g = torch.Generator().manual_seed(4)
    store = torch.randn(4096, generator=g)
    # tensors of one shape at each address mod 16 (their peel differs), stacked rows, a share, a copy
    ts = [store[k : k + 300] for k in range(4)] + [store[1000:1600].view(6, 100)] + [store[2000:2200]]
    parts = [Part(t) for t in ts[:4]] + [Part(ts[4], rows=True), Part(ts[5].view(2, 100), first_row=7),
                                          Part(store[3000:3200].view(20, 10).t())]
    segs, copies, n_out = fpk.segments(parts)
    assert n_out == 4 + 6 + 1 + 1 and len(copies) == 2  # the share's byte view, the transposed view's copy
    assert [s[0] for s in segs] == [t.data_ptr() for t in ts] + [copies[1].data_ptr()]  # the rest in place
    assert copies[1].data_ptr() != store[3000:].data_ptr()
    direct = fpk.chunk_tables(segs, fpk.CHUNK)
    for _ in range(2):  # the second time from the cache
        cached = fpk.segment_tables(segs)
        assert all(np.array_equal(a, b) for a, b in zip(cached, direct))
    assert np.array_equal(_interpreted(parts), fpk.sums_cpu(parts))
    # negative twin: the chunks of one shape depend on the address mod 16 (the cache keys on it): the
    # first tensor's chunks shifted to the second one's address (4 bytes on) are not its chunks
    first, second = (fpk.chunk_tables([(*segs[k][:4], 0)], fpk.CHUNK)[0] for k in (0, 1))
    shifted = first.copy()
    shifted[:, 0] += 4
    assert not np.array_equal(shifted, second)


def test_two_swapped_elements_and_bf16_vs_fp32_of_equal_values_differ():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    swapped = x.clone()
    swapped[3, 5], swapped[40, 7] = x[40, 7], x[3, 5]
    assert fingerprint(swapped) != fingerprint(x)
    y = torch.tensor([1.0, 2.0, 0.5, -4.0])
    assert torch.equal(y.bfloat16().float(), y)  # exactly representable: equal values
    assert fingerprint(y) != fingerprint(y.bfloat16())
    # negative twins: swapping two equal elements is no change; torch.hash_tensor (XOR) is blind
    same = x.clone()
    same[3, 5] = same[40, 7] = 1.5
    again = same.clone()
    again[3, 5], again[40, 7] = same[40, 7], same[3, 5]
    assert fingerprint(again) == fingerprint(same)
    if hasattr(torch, "hash_tensor"):
        assert torch.hash_tensor(swapped) == torch.hash_tensor(x)


def test_shares_with_global_indices_add_up_to_the_whole_tensor():
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(2)).bfloat16()
    cuts = [0, 3, 4, 10]
    shares = fpk.raw_values(fpk.sums_cpu([Part(x[a:b], first_row=a) for a, b in zip(cuts, cuts[1:])]))
    whole = fpk.finalize(fpk.add_raw(shares), x.dtype, x.shape)
    assert fpk.hex64(whole) == fingerprint(x)
    # negative twin: the pieces hashed as tensors of their own (indices from 0) do not add up
    local = fpk.raw_values(fpk.sums_cpu([Part(x[a:b]) for a, b in zip(cuts, cuts[1:])]))
    assert fpk.hex64(fpk.finalize(fpk.add_raw(local), x.dtype, x.shape)) != fingerprint(x)


def test_word_indices_past_two_to_the_32_split_chunks_and_still_add_up():
    rows = torch.randn(4, 1 << 10, generator=torch.Generator().manual_seed(3))  # 1024 words a row
    r0 = (1 << 32) // (1 << 10) - 2  # rows r0, r0 + 1 below index 2**32, r0 + 2, r0 + 3 above it
    both = Part(rows, first_row=r0)
    halves = [Part(rows[:2], first_row=r0), Part(rows[2:], first_row=r0 + 2)]
    want = fpk.sums_cpu([both])
    assert np.array_equal(_interpreted([both]), want)
    assert fpk.add_raw(fpk.raw_values(fpk.sums_cpu(halves))) == fpk.raw_values(want)[0]
    table = fpk.work_table([both])[0]
    starts = table[:, 2]  # key1 bases: the chunk beginning at index 2**32 has the high word's key
    assert len(table) == 2 and (fpk.K3 + fpk.C1) & 0xFFFFFFFF in starts.tolist()


def test_a_padded_tail_word_is_told_apart_by_the_byte_count_in_the_salt():
    y = torch.tensor([1.0, 2.0, 3.0]).bfloat16()  # 6 bytes: words (1.0, 2.0) and (3.0, zero padding)
    z = torch.tensor([1.0, 2.0, 3.0, 0.0]).bfloat16()  # the same 8 bytes, unpadded
    assert fingerprint(y) == "9fa7b7a6b150fd02"
    assert np.array_equal(fpk.sums_cpu([Part(y)]), fpk.sums_cpu([Part(z)]))  # the same words...
    assert fingerprint(y) != fingerprint(z)  # ...and still another value (the salt holds 6 vs 8 bytes)
    # negative twin: the tail's real bytes count; one changed bit in them changes the value
    y2 = y.clone()
    y2.view(torch.int16)[2] ^= 1
    assert fingerprint(y2) != fingerprint(y)


def test_a_share_of_rows_that_are_not_whole_words_is_an_error_naming_it():
    x = torch.randn(6, 3).bfloat16()  # 6-byte rows: a share's words would straddle two ranks' rows
    with pytest.raises(fpk.FingerprintError, match=r"fingerprint of experts\.w: a share \(first_row=3\) needs dim-0 "
                                                   r"rows of whole 32-bit words"):
        fpk.sums_cpu([Part(x[3:], first_row=3, name="experts.w")])
    fpk.sums_cpu([Part(x[3:].float(), first_row=3, name="experts.w")])  # negative twin: 12-byte rows are fine


def test_row_fingerprints_are_the_rows_own_fingerprints():
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    r = row_fingerprints(x)
    assert [f"{int(v) & ((1 << 64) - 1):016x}" for v in r] == [fingerprint(x[i]) for i in range(10)]
    odd = torch.randn(4, 5, generator=torch.Generator().manual_seed(5)).bfloat16()  # 10-byte rows: padded
    got = [f"{int(v) & ((1 << 64) - 1):016x}" for v in row_fingerprints(odd)]
    assert got == [fingerprint(odd[i]) for i in range(4)]
    assert int(row_fingerprints(x[:, [1, 0, *range(2, 16)]])[0]) != int(r[0])  # negative twin: a swap


def test_what_cannot_be_read_is_named_not_skipped():
    x = torch.randn(6, 4)
    assert fingerprint(x.t()) == fingerprint(x.t().contiguous())  # handled: the values in logical order
    with pytest.raises(fpk.FingerprintError, match=r"fingerprint of grad/w: a torch.sparse_coo"):
        state_fingerprints({"grad/w": x.to_sparse()})
    with pytest.raises(fpk.FingerprintError, match=r"fingerprint of w: .*on meta"):
        state_fingerprints({"w": torch.empty(3, device="meta")})
    with pytest.raises(fpk.FingerprintError, match=r"rows of a 0-d tensor"):
        fpk.sums_cpu([Part(torch.tensor(1.0), rows=True, name="s")])


# --- the trainer's trace at EP 2: one flipped bit on one rank, named by `rlalign compare` --------------
FLIPPED = "model.layers.1.mlp.experts.down_proj"


def _faulty(trainer):
    step = trainer.optimizer_step

    def faulty_step():
        out = step()
        with torch.no_grad():
            dict(trainer.model.named_parameters())[FLIPPED][1].view(-1)[7:8].view(torch.int16).bitwise_xor_(1)
        return out

    return faulty_step


def _trainer_trace_rank(rank, world, group, cfg_dict, runs):
    """Per run (run dir, flip): one train step of the real TrainerWorker at EP 2 with its trace; flip:
    rank 1's update writes one wrong bit into its second local expert of FLIPPED (a silent fault after
    the gradients and moments were right)."""
    from omegaconf import OmegaConf

    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.workers import TrainerWorker

    for run_dir, flip in runs:
        cfg = OmegaConf.to_container(OmegaConf.merge(cfg_dict, {"run": {"dir": run_dir}}), resolve=True)
        w = TrainerWorker(cfg, rank, world, group=group)
        if flip and rank == 1:
            w.trainer.optimizer_step = _faulty(w.trainer)
        w.open_trace(0)
        g = torch.Generator().manual_seed(5)
        samples = [Sample(torch.randint(2, 60, (6,), generator=g).tolist(),
                          torch.randint(2, 60, (5,), generator=g).tolist(), torch.zeros(5),
                          advantage=float(i % 3) - 1.0, sample_id=i, params=SamplingParams()) for i in range(8)]
        w.train_step(samples, OmegaConf.to_container(OmegaConf.create(cfg).algorithm), 0)
        w.close_trace()


@pytest.mark.slow
def test_a_flipped_bit_in_one_expert_on_one_trainer_rank_at_ep2_is_named_by_compare(tmp_path, capsys):
    from omegaconf import OmegaConf

    from rlalign import cli
    from rlalign.config import load_config
    from rlalign.parallel import launch

    cfg = OmegaConf.to_container(load_config(["trainer.ep_size=2", "trainer.micro_batch_size=2"]), resolve=True)
    runs = [(str(tmp_path / d), d == "flip") for d in ("a", "b", "flip")]
    launch.run_workers(2, _trainer_trace_rank, (cfg, runs), timeout_s=240)

    def compare(x, y):  # `rlalign compare` in-process
        capsys.readouterr()
        rc = cli.main(["compare", str(tmp_path / x), str(tmp_path / y)])
        return rc, *capsys.readouterr()

    rc, out, err = compare("a", "flip")
    assert rc == 1, out + err
    # rank 1 holds experts 4..7: its second local expert is global expert 5, and the grads and moments
    # before it in the stream matched
    assert f"B: step 0 rank 1 state/weights/{FLIPPED}/expert5 bfloat16[64, 64]" in out, out
    assert "inputs matched: yes" in out and out.count("identical:") == 1  # rank 0's stream
    rc, out, err = compare("a", "b")  # negative twin: the same step without the fault
    assert rc == 0 and out.count("identical:") == 2, out + err


def test_the_trace_holds_the_adamw_moments_at_every_nth_step_and_all_else_every_step(tmp_path):
    from omegaconf import OmegaConf

    from rlalign.config import ConfigError, load_config
    from rlalign.monitor.trace import read_trace
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.workers import TrainerWorker

    with pytest.raises(ConfigError, match=r"monitor.optim_every=0: must be >= 1"):
        load_config(["monitor.optim_every=0"])
    g = torch.Generator().manual_seed(5)
    samples = [Sample(torch.randint(2, 60, (6,), generator=g).tolist(),
                      torch.randint(2, 60, (5,), generator=g).tolist(), torch.zeros(5), advantage=float(i % 3) - 1.0,
                      sample_id=i, params=SamplingParams()) for i in range(4)]
    cfg = OmegaConf.to_container(load_config(["trainer.ep_size=1", "trainer.micro_batch_size=4", "model.num_layers=1",
                                              "monitor.optim_every=3", f"run.dir={tmp_path}"]), resolve=True)
    w = TrainerWorker(cfg, 0, 1)
    w.open_trace(0)
    for step in range(3):
        if step == 2:  # negative twin: every step (step 2 is no multiple of 3)
            w.cfg.monitor.optim_every = 1
        w.train_step(samples, cfg["algorithm"], step)
    w.close_trace()
    recs = read_trace(tmp_path / "traces" / "trainer-rank0.jsonl")[1]
    names = {s: [r["name"] for r in recs if r["step"] == s and r["name"].startswith("state/")] for s in range(3)}
    moments = [n for n in names[0] if n.startswith("state/optim/")]
    assert moments and {n.split("/")[1] for n in names[0]} == {"grad", "optim", "weights"}
    assert names[1] == [n for n in names[0] if n not in moments]  # gradients and weights every step
    assert names[2] == names[0]
