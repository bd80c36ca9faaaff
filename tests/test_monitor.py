"""Consistency monitor, fingerprints, traces, the three gates and the report."""

import errno
import io
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import inject_fault

from rlalign.config import load_config
from rlalign.fingerprint import fingerprint, row_fingerprints
from rlalign.gates import GateRefused, compare_runs, run_gate
from rlalign.monitor.consistency import logprob_consistency
from rlalign.monitor.trace import TraceError, env_difference, fixed_environment, read_trace

pytestmark = pytest.mark.usefixtures("shared_runs")  # a config run before in the module: copied (conftest.py)

SMALL = ["task.num_prompts=4", "task.samples_per_prompt=4", "trainer.micro_batch_size=4",
         "trainer.ep_size=1"]  # one trainer actor: what these tests check does not depend on the EP size


# --- fingerprints ---------------------------------------------------------------------------------
def test_fingerprints_see_permutations_dtypes_and_single_bits():
    x = torch.randn(64, 32)
    assert fingerprint(x) == fingerprint(x.clone())
    assert fingerprint(x) != fingerprint(x.flip(0))  # a permutation
    assert fingerprint(x[:, :2]) != fingerprint(x[:, :2].flip(1))
    y = torch.tensor([1.0, 2.0, 0.5])  # exactly representable: equal values in bf16 and fp32
    assert torch.equal(y.bfloat16().float(), y)
    assert fingerprint(y) != fingerprint(y.bfloat16())
    flipped = x.clone()
    flipped.view(torch.int32)[3, 7] ^= 1  # one last bit
    assert fingerprint(flipped) != fingerprint(x)
    assert fingerprint(x) != fingerprint(x.reshape(32, 64))  # same bytes, other shape


def test_negative_twin_torch_hash_tensor_is_blind_to_permutation():
    if not hasattr(torch, "hash_tensor"):
        pytest.skip("torch.hash_tensor not in this torch")
    x = torch.tensor([1.0, 2.0, 3.0])
    assert torch.hash_tensor(x) == torch.hash_tensor(x.flip(0))  # why we hash bytes with positions


def test_row_fingerprints_are_per_row_and_order_sensitive():
    x = torch.randn(10, 16).bfloat16()
    r = row_fingerprints(x)
    assert all(int(row_fingerprints(x[i : i + 1])[0]) == int(r[i]) for i in range(10))
    assert int(row_fingerprints(x[:, [1, 0, *range(2, 16)]])[0]) != int(r[0])
    assert int(row_fingerprints(x.float())[0]) != int(r[0])


# --- consistency metrics --------------------------------------------------------------------------
def test_consistency_metrics():
    g = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    t = [torch.tensor([-1.0, -2.1]), torch.tensor([-0.5])]
    c = logprob_consistency(g, t)
    assert c["tokens"] == 3 and c["mismatched_tokens"] == 1
    assert c["mismatch_token_frac"] == pytest.approx(1 / 3) and c["mismatch_seq_frac"] == 0.5
    assert c["logprob_abs_diff_max"] == pytest.approx(0.1, abs=1e-6)
    d = -0.1
    assert c["k3_kl"] == pytest.approx((math.exp(d) - 1 - d) / 3, rel=1e-5)
    assert c["ppl_ratio"] == pytest.approx(math.exp(0.1 / 3), rel=1e-5)
    assert sum(c["abs_diff_hist"]) == 3 and c["abs_diff_hist"][0] == 2
    same = logprob_consistency(g, g)
    assert same["mismatched_tokens"] == 0 and same["k3_kl"] == 0.0 and same["ppl_ratio"] == 1.0
    with pytest.raises(ValueError, match="sequence 1 has 1 generator vs 2 trainer logprobs"):
        logprob_consistency(g, [g[0], torch.zeros(2)])


# --- traces ------------------------------------------------------------------------------------------
def _trace(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("".join(lines))
    return p


HEADER = json.dumps({"kind": "header", "role": "trainer", "rank": 0, "env": {"seed": 0}}) + "\n"
REC = json.dumps({"step": 0, "rank": 0, "name": "grad/w", "shape": [2], "dtype": "float32", "fp": "ab"}) + "\n"


def test_corrupt_traces_name_the_line(tmp_path):
    with pytest.raises(TraceError, match=r"t1.jsonl:3: truncated record"):
        read_trace(_trace(tmp_path, "t1.jsonl", [HEADER, REC, REC[:-1]]))
    with pytest.raises(TraceError, match=r"t2.jsonl:2: corrupt record"):
        read_trace(_trace(tmp_path, "t2.jsonl", [HEADER, '{"step": 0, "na\n']))
    with pytest.raises(TraceError, match=r"t3.jsonl:2: record lacks or mistypes field\(s\) \['fp'\]"):
        read_trace(_trace(tmp_path, "t3.jsonl", [HEADER, REC.replace('"fp": "ab"', '"x": 1')]))
    with pytest.raises(TraceError, match=r"t4.jsonl:1: not an rlalign trace"):
        read_trace(_trace(tmp_path, "t4.jsonl", [REC]))
    with pytest.raises(TraceError, match=r"t7.jsonl:2: a JSON list, not a record"):
        read_trace(_trace(tmp_path, "t7.jsonl", [HEADER, "[1, 2]\n"]))
    with pytest.raises(TraceError, match=r"t8.jsonl:1: a JSON list, not a record"):
        read_trace(_trace(tmp_path, "t8.jsonl", ["[1, 2]\n"]))
    rows = {"step": 0, "rank": 1, "name": "w/expert", "first": 4, "shape": [2], "dtype": "bfloat16", "fps": ["a", "b"]}
    _, recs = read_trace(_trace(tmp_path, "t5.jsonl", [HEADER, json.dumps(rows) + "\n"]))
    assert [(r["name"], r["fp"], r["shape"]) for r in recs] == [("w/expert4", "a", [2]), ("w/expert5", "b", [2])]
    with pytest.raises(TraceError, match=r"t6.jsonl:2: record lacks or mistypes field\(s\) \['fps'\]"):
        read_trace(_trace(tmp_path, "t6.jsonl", [HEADER, json.dumps({**rows, "fps": ["a", 7]}) + "\n"]))


def test_a_trace_that_is_not_text_and_a_missing_or_mixed_compare_argument_are_named(tmp_path, capsys):
    from rlalign.monitor.compare import main

    (tmp_path / "run" / "traces").mkdir(parents=True)
    binary = tmp_path / "run" / "traces" / "trainer-rank0.jsonl"
    binary.write_bytes(HEADER.encode() + b"\x80\x04\x95pickled\n")
    with pytest.raises(TraceError, match=r"trainer-rank0.jsonl:2: not UTF-8 text \(byte 0x80 at column 1\)"):
        read_trace(binary)
    good = _trace(tmp_path, "good.jsonl", [HEADER, REC])  # twin: the same header with a text record reads
    dump = tmp_path / "run" / "mismatch-step000000"
    dump.mkdir()
    (dump / "batch.json").write_text("{}")
    assert read_trace(good)[1][0]["fp"] == "ab"
    for argv, line in (([str(good), str(tmp_path / "nope")], f"{tmp_path}/nope: no such run directory or trace file"),
                       ([str(tmp_path / "run"), str(good)], "compare two run directories or two trace files"),
                       ([str(good), str(binary)], "trainer-rank0.jsonl:2: not UTF-8 text"),
                       ([str(tmp_path / "run"), str(dump)], f"{dump}: a mismatch dump, not a run directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and line in err[0], err
    assert main([str(good), str(good)]) == 0


def test_one_first_divergence_for_records_state_and_a_tokens_ops():
    """trace records by index, trainer state by (step, name), a token's rows by (op in model order,
    position): each the first key of divergence.first_divergence; None when nothing differs."""
    from rlalign.monitor.compare import first_differing_state
    from rlalign.monitor.divergence import first_divergence, first_divergent_tap
    from rlalign.monitor.trace import first_differing_record

    assert first_divergence([3, 1, 2], lambda k: k < 3) == 1 and first_divergence([1, 2], lambda k: False) is None
    recs = [{"step": 0, "name": n, "fp": n} for n in "abc"]
    assert first_differing_record(recs, recs) is None
    d = first_differing_record(recs, [recs[0], {**recs[1], "fp": "x"}, {**recs[2], "fp": "y"}])
    assert (d["index"], d["previous"], d["step_first"]) == (1, "a", False)
    d = first_differing_record(recs, recs[:2])
    assert (d["index"], d["a"], d["b"], d["length"]) == (2, recs[2], None, (3, 2))
    st = {(0, "w"): {"fp": 1, "shape": [2], "dtype": "f"}, (1, "w"): {"fp": 2, "shape": [2], "dtype": "f"}}
    assert first_differing_state(st, st) is None
    assert first_differing_state(st, {**st, (1, "w"): {"fp": 3, "shape": [2], "dtype": "f"}}) == (1, "w")
    assert first_differing_state(st, {(1, "w"): st[(1, "w")]}) == (0, "w")  # in one run only
    gen = {(7, 0): {"attn": 1, "mlp": 1}, (7, 1): {"attn": 2, "mlp": 5}}
    train = {(7, 0): {"attn": 1, "mlp": 9}, (7, 1): {"attn": 3, "mlp": 5}}
    assert first_divergent_tap(gen, train, 7, 1, ["attn", "mlp"]) == ("attn", 1)  # op order before position
    assert first_divergent_tap(gen, train, 7, 0, ["attn", "mlp"]) == ("mlp", 0)
    assert first_divergent_tap(gen, gen, 7, 1, ["attn", "mlp"]) is None


def test_the_trace_writer_thread_writes_in_program_order_and_its_errors_surface(tmp_path):
    """flush hands the writing to the trace's writer thread: records land in program order (a known
    record queued between two launched ones stays between them); an error while writing is raised by
    the trace's next call, and nothing recorded after the failed record is written."""
    from rlalign.monitor.trace import Trace

    tr = Trace(tmp_path / "ok.jsonl", "trainer", 0, {})
    tr.record("a", torch.arange(4))
    tr.record_known([("k", (2,), torch.float32)], lambda: [fingerprint(torch.zeros(2))])
    tr.record("b", torch.arange(3))
    tr.flush()
    tr.record("c", torch.ones(2))
    tr.close()
    recs = read_trace(tmp_path / "ok.jsonl")[1]
    assert [r["name"] for r in recs] == ["a", "k", "b", "c"]
    assert recs[1]["fp"] == fingerprint(torch.zeros(2)) and recs[0]["fp"] == fingerprint(torch.arange(4))

    bad = Trace(tmp_path / "bad.jsonl", "trainer", 0, {})  # the twin: the known record's fingerprints fail
    bad.record("a", torch.arange(4))
    bad.record_known([("k", (2,), torch.float32)], lambda: [][0])
    bad.record("b", torch.arange(3))
    bad.flush()
    with pytest.raises(IndexError):
        bad.record("c", torch.ones(2))
    bad._f.close()
    assert [r["name"] for r in read_trace(tmp_path / "bad.jsonl")[1]] == ["a"]


class _FullDisk(io.StringIO):
    def flush(self):  # a buffered file's flush on a full disk: errno 28, no file named
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_under_the_trace_writer_names_the_trace_file(tmp_path):
    from rlalign.monitor.trace import Trace

    for full in (True, False):  # twin: a disk with room
        tr = Trace(tmp_path / f"{full}.jsonl", "generator", 0, {})
        if full:
            tr._f.close()
            tr._f = _FullDisk()
        tr.record("a", torch.arange(4))
        tr.flush()
        if full:
            with pytest.raises(OSError, match=rf"No space left on device \(writing the trace\): '{tmp_path}/True"):
                tr.record("b", torch.ones(2))
            tr._f = io.StringIO()
        tr.close()
    assert [r["name"] for r in read_trace(tmp_path / "False.jsonl")[1]] == ["a"]


def test_compare_says_plainly_when_traces_come_from_different_configs(tmp_path, capsys):
    a = _trace(tmp_path, "a.jsonl", [HEADER, REC])
    b = _trace(tmp_path, "b.jsonl", [HEADER.replace('"seed": 0', '"seed": 1'), REC.replace('"ab"', '"cd"')])
    p = subprocess.run([sys.executable, "-m", "rlalign.cli", "compare", str(a), str(b)], capture_output=True,
                       text=True)
    assert p.returncode == 1
    assert "come from different runs/configs" in p.stdout and "seed: 0 vs 1" in p.stdout
    assert "first difference at record 0" in p.stdout and "grad/w" in p.stdout
    bad = _trace(tmp_path, "c.jsonl", [HEADER, REC[:-1]])
    rc, out, err = _compare_cli(capsys, a, bad)  # in-process from here: the exit status above was the process's
    assert rc == 2 and "c.jsonl:2: truncated record" in err


def _compare_cli(capsys, a, b):
    """`rlalign compare A B` in this process: (exit status, stdout, stderr)."""
    from rlalign import cli

    capsys.readouterr()
    rc = cli.main(["compare", str(a), str(b)])
    out, err = capsys.readouterr()
    return rc, out, err


# --- gates ---------------------------------------------------------------------------------------------
GATE_RUN = [*SMALL, "run.steps=1", "monitor.on_mismatch=warn"]  # its run (fingerprints=layers) serves three tests


def test_a_gate_candidate_the_config_refuses_is_named_before_any_run(tmp_path, capsys, monkeypatch):
    """`gate.candidate` with a misspelt key stops the baseline gate before Ray starts or the reference run
    trains, naming gate.candidate. The twin: a candidate the config takes passes the same check (and only then
    does the gate connect, here to a stub that stops it)."""
    from rlalign import cli, cluster

    def no_cluster(num_cpus):
        raise RuntimeError("connect reached")

    monkeypatch.setattr(cluster, "connect", no_cluster)
    rc = cli.main(["gate", "baseline", *GATE_RUN, 'gate.candidate=["trainer.ep_sise=1"]', f"run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "gate.candidate=['trainer.ep_sise=1']: unknown config key 'trainer.ep_sise'" in err, err
    assert not (tmp_path / "gate-baseline").exists()
    with pytest.raises(RuntimeError, match="connect reached"):
        run_gate("baseline", [*GATE_RUN, 'gate.candidate=["trainer.ep_size=1"]'],
                 load_config([*GATE_RUN, 'gate.candidate=["trainer.ep_size=1"]', f"run.dir={tmp_path}"]))


def _gate(kind, tmp_path, *over):
    cfg = load_config([*SMALL, f"run.dir={tmp_path}", *over])
    return run_gate(kind, [*SMALL, *over], cfg)


@pytest.mark.slow
def test_gate_repeatability_pass_and_fail_names_the_injected_op(tmp_path, capsys, monkeypatch):
    from rlalign import cli

    t = time.perf_counter()
    rc = cli.main(["gate", "repeatability", *GATE_RUN, f"run.dir={tmp_path}/cli"])  # in-process: this module's Ray
    out, err = capsys.readouterr()
    print(f"rlalign gate repeatability run.steps=1: {time.perf_counter() - t:.1f}s")
    assert rc == 0, err[-2000:]
    assert "gate repeatability: PASS" in out
    rows = [json.loads(ln) for ln in (tmp_path / "cli" / "gate-repeatability" / "a" / "metrics.jsonl").open()]
    assert [r["consistency/mismatched_tokens"] for r in rows] == [0]  # on_mismatch=warn let none through
    inject_fault("noise:generator:layers.1.mlp", monkeypatch)  # both runs: noise is not repeatable
    ok, text = _gate("repeatability", tmp_path / "noise", "run.steps=1", "monitor.on_mismatch=warn")
    assert not ok and "FAIL" in text
    assert "first divergence: gen.step.layers.1.mlp" in text


@pytest.mark.slow
def test_gate_baseline_pass_and_fail_names_the_non_invariant_op(tmp_path, monkeypatch):
    ok, text = _gate("baseline", tmp_path / "ep", "run.steps=3", "checkpoint.every=1",  # candidate: generator EP 2
                     "checkpoint.keep=0")  # run a: the replay gate's (shared_runs)
    assert ok, text
    inject_fault("default:both:layers.1.attn@b", monkeypatch)  # the candidate: run b with that fault
    ok, text = _gate("baseline", tmp_path / "bad", "run.steps=1", "monitor.on_mismatch=warn",  # run a: GATE_RUN's
                     "gate.candidate=[]")
    assert not ok and "first divergence: gen.step.layers.1.attn" in text


@pytest.mark.slow
def test_gate_replay_pass_and_fail_on_a_perturbed_sampling_rng(tmp_path, monkeypatch):
    ok, text = _gate("replay", tmp_path / "ok", "run.steps=3")
    assert ok, text
    inject_fault("seed:generator@b", monkeypatch)  # the resumed run only
    ok, text = _gate("replay", tmp_path / "rng", "run.steps=3")
    assert not ok and "first divergence: gen.step.sample" in text


# --- generator-vs-trainer divergence report -------------------------------------------------------------
def _divergence_run(shared_runs, monkeypatch, run_dir, site):
    """A GATE_RUN run (fp32, per-op fingerprints) whose generator runs `site` on the default kernels."""
    inject_fault(f"default:generator:{site}", monkeypatch)
    shared_runs(load_config([*GATE_RUN, f"run.dir={run_dir}", "monitor.fingerprints=layers", "model.dtype=float32"]))
    monkeypatch.delenv("RLALIGN_FAULT")


@pytest.mark.slow
@pytest.mark.parametrize("site, first", [("layers.1.attn", "layers.1.attn"), ("layers.0.mlp", "layers.0.router")])
def test_divergence_report_names_the_injected_layer(tmp_path, site, first, shared_runs, monkeypatch):
    from rlalign.monitor.report import make_report

    _divergence_run(shared_runs, monkeypatch, tmp_path, site)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["consistency/mismatched_tokens"] > 0
    assert row["consistency/first_divergent_op"] == first
    div = json.loads((tmp_path / "divergence.jsonl").read_text().splitlines()[0])
    assert set(div["first_op_counts"]) == {first} and div["worst_tokens"]
    out = make_report(tmp_path)
    assert {p.name for p in out.iterdir()} >= {"reward.png", "mismatch.png", "abs_diff_hist.png", "divergence.png",
                                              "summary.md"}


@pytest.mark.slow
def test_gates_refuse_runs_whose_fixed_environment_differs(tmp_path, shared_runs, monkeypatch):
    """Two runs of the module (the repeatability gate's and the divergence report's: shared_runs) whose
    model.dtype differs; and the seed is part of the fixed environment (twin: a monitor key is not)."""
    shared_runs(load_config([*GATE_RUN, "monitor.fingerprints=layers", f"run.dir={tmp_path / 'a'}"]))
    _divergence_run(shared_runs, monkeypatch, tmp_path / "b", "layers.1.attn")
    with pytest.raises(GateRefused, match=r"fixed environments differ.*model.dtype: 'bfloat16' vs 'float32'"):
        compare_runs(tmp_path / "a", tmp_path / "b")
    env = {over: fixed_environment(load_config([over])) for over in ("seed=0", "seed=1", "monitor.worst_tokens=3")}
    assert env_difference(env["seed=0"], env["seed=1"]) == ["seed"]
    assert env_difference(env["seed=0"], env["monitor.worst_tokens=3"]) == []


@pytest.mark.slow
def test_mismatch_in_deterministic_mode_raises_dumps_and_replays(tmp_path, monkeypatch):
    from rlalign.agree import run_agree
    from rlalign.rl import MismatchError, train

    inject_fault("default:generator:layers.0.attn", monkeypatch)
    with pytest.raises(MismatchError, match=r"first divergence: layers.0.attn.*agree.replay=") as e:
        train(load_config([*SMALL, "run.steps=1", f"run.dir={tmp_path}", "monitor.fingerprints=layers"]))
    dump = tmp_path / "mismatch-step000000"
    assert dump.is_dir() and str(dump) in str(e.value)
    assert (dump / "weights" / "config.json").is_file() and (dump / "config.yaml").is_file()
    div = json.loads((tmp_path / "divergence.jsonl").read_text().splitlines()[0])  # written before the raise
    batch = json.loads((dump / "batch.json").read_text())
    assert div["step"] == 0 and div["first_divergent_op"] == "layers.0.attn" == batch["first_divergent_op"]
    assert 0 < batch["consistency"]["mismatched_tokens"] <= batch["consistency"]["tokens"]
    res, _ = run_agree(load_config([f"agree.replay={dump}", "trainer.ep_size=1"]))
    assert res["replay_same_tokens"] and res["replay_generator_logprobs_equal"] and res["mismatched_tokens"] > 0
    monkeypatch.delenv("RLALIGN_FAULT")
    res, _ = run_agree(load_config([f"agree.replay={dump}", "trainer.ep_size=1"]))  # without the fault
    assert res["mismatched_tokens"] == 0 and not res["replay_generator_logprobs_equal"]


# --- traces of resumed runs ----------------------------------------------------------------------------
def _weights(step, flip=None):
    w = {name: torch.arange(4, dtype=torch.float32) + step + i for i, name in enumerate(("a", "b", "c"))}
    if flip:
        w[flip].view(torch.int32)[0] ^= 1
    return w


def _worker_steps(tr, steps):
    """What a generator worker records: per step its tokens, then the synced weights of that step."""
    for s in steps:
        tr.step = s
        tr.record("gen.tokens", torch.tensor([s, s + 1]))
        tr.step = s
        tr.record_state("weights", _weights(s))
        tr.flush()


def _resume(path, start, flip=None):
    from rlalign.monitor.trace import Trace

    tr = Trace(path, "generator", 0, {"seed": 0}, start)
    tr.step = start - 1  # rl.train: open_traces(start), load the checkpoint, sync_weights(start - 1)
    tr.record_state("weights", _weights(start - 1, flip))
    _worker_steps(tr, range(start, 4))
    tr.close()
    return tr


def _uninterrupted(path):
    from rlalign.monitor.trace import Trace

    tr = Trace(path, "generator", 0, {"seed": 0})
    tr.step = -1
    tr.record_state("weights", _weights(-1))
    _worker_steps(tr, range(4))
    tr.close()


def _interrupted(path):
    """Steps 0-1 (checkpoint after step 1), then killed in step 2 in the middle of a line."""
    from rlalign.monitor.trace import Trace

    tr = Trace(path, "generator", 0, {"seed": 0})
    tr.step = -1
    tr.record_state("weights", _weights(-1))
    _worker_steps(tr, range(3))
    tr.close()
    path.write_text(path.read_text() + '{"step": 3, "rank": 0, "na')


def _compare(a, b):
    import io

    from rlalign.monitor.compare import compare_files

    out = io.StringIO()
    return compare_files(a, b, out), out.getvalue()


def test_a_resumed_trace_equals_the_uninterrupted_one(tmp_path):
    _uninterrupted(tmp_path / "full.jsonl")
    _interrupted(tmp_path / "part.jsonl")
    tr = _resume(tmp_path / "part.jsonl", 2)
    assert tr.replaced == []
    full, part = read_trace(tmp_path / "full.jsonl")[1], read_trace(tmp_path / "part.jsonl")[1]
    assert part == full and [r["step"] for r in part].count(1) == 4  # step 1's weights once, not twice
    assert _compare(tmp_path / "full.jsonl", tmp_path / "part.jsonl") == (True, "identical: 19 records (full.jsonl)\n")


def test_negative_twin_a_resumed_trace_with_perturbed_weights_differs_where_they_were_loaded(tmp_path):
    _uninterrupted(tmp_path / "full.jsonl")
    _interrupted(tmp_path / "part.jsonl")
    with pytest.warns(UserWarning, match=r"re-recorded 1 record\(s\) of step 1 differently.*first weights/b"):
        tr = _resume(tmp_path / "part.jsonl", 2, flip="b")
    assert tr.replaced == ["weights/b"]
    ok, text = _compare(tmp_path / "full.jsonl", tmp_path / "part.jsonl")
    assert not ok and "first difference at record 9" in text and "B: step 1 rank 0 weights/b float32[4]" in text


def test_a_resumed_trace_of_another_shard_shape_replaces_the_held_records_without_a_warning(tmp_path):
    """Resumed at another generator EP size, a rank's expert weights are another shard (another shape):
    replaced silently; the twin above (same shape, other bits) warns."""
    import warnings

    from rlalign.monitor.trace import Trace

    _uninterrupted(tmp_path / "full.jsonl")
    _interrupted(tmp_path / "part.jsonl")
    tr = Trace(tmp_path / "part.jsonl", "generator", 0, {"seed": 0}, 2)
    tr.step = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr.record_state("weights", {**_weights(1), "b": _weights(1)["b"][:2]})
        tr.close()
    assert tr.replaced == ["weights/b"]
    held = [r for r in read_trace(tmp_path / "part.jsonl")[1] if r["name"] == "weights/b" and r["step"] == 1]
    assert [r["shape"] for r in held] == [[2]]


def test_a_trace_resumed_into_a_new_run_dir_compares_from_its_start(tmp_path):
    _uninterrupted(tmp_path / "full.jsonl")
    _resume(tmp_path / "fresh.jsonl", 2)
    header, recs = read_trace(tmp_path / "fresh.jsonl")
    assert header["start_step"] == 2 and [r["step"] for r in recs][:4] == [1, 1, 1, 2]
    for a, b in (("full", "fresh"), ("fresh", "full")):
        ok, text = _compare(tmp_path / f"{a}.jsonl", tmp_path / f"{b}.jsonl")
        assert ok, text
        assert "begins at a resume (step 2) without the earlier steps" in text and "identical: 11 records" in text
    # negative twin: the same with perturbed weights differs at the perturbed tensor
    _resume(tmp_path / "bad.jsonl", 2, flip="c")
    ok, text = _compare(tmp_path / "full.jsonl", tmp_path / "bad.jsonl")
    assert not ok and "B: step 1 rank 0 weights/c" in text and "first difference at record 2" in text


def test_trace_records_of_the_syncs_fingerprints_equal_hashing_the_weights(tmp_path):
    """A one-rank generator writes the weight sync's own fingerprints of the weights it received into
    its trace (Trace.record_known): the same records as hashing the weights again (record_state).
    Twin: one changed bit in one weight changes that record and no other."""
    from rlalign.model.build import model_from_config
    from rlalign.monitor.trace import Trace
    from rlalign.parallel import weight_sync

    model = model_from_config(load_config(["model.num_layers=1"]))
    params = dict(model.named_parameters())
    plan = weight_sync.make_plan(weight_sync.tensor_specs(model, 1), 1 << 16)
    specs = plan.specs()

    def known(path):
        fps = weight_sync.merge(specs, [weight_sync.partial_fingerprints(model, plan, 0, 1)], "generator", True)
        tr = Trace(path, "generator", 0, {})
        tr.record_known(sorted((f"weights/{n}", s, getattr(torch, d.removeprefix("torch."))) for n, d, s, _ in specs),
                        lambda: [fps[n] for n in sorted(fps)])
        tr.close()
        return read_trace(path)[1]

    hashed = Trace(tmp_path / "hashed.jsonl", "generator", 0, {})
    hashed.record_state("weights", params)
    hashed.close()
    want = read_trace(tmp_path / "hashed.jsonl")[1]
    assert len(want) == len(params) and known(tmp_path / "known.jsonl") == want
    name = sorted(params)[3]
    with torch.no_grad():
        params[name].view(-1)[0:1].view(torch.int16)[0] ^= 1
    got = known(tmp_path / "changed.jsonl")
    assert [r["name"] for r, w in zip(got, want) if r != w] == [f"weights/{name}"]
