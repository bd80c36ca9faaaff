"""The one fault-injection mechanism (rlalign.faults, RLALIGN_FAULT): its forms, a gate run's own faults,
what each side carries; and no test knob left in the user's config. (The faults at work: the gates'
tests in test_monitor.py and test_topology.py, the crashed and hung actors in test_train.py,
test_agree.py and test_scheduler.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from rlalign import faults
from rlalign.config import ConfigError, load_config
from rlalign.faults import Fault, SideFaults, gate_run, parse


def test_the_forms_parse():
    spec = ("exit:trainer.train_step:1:3; hang:checkpoint.write:0:2;sleep:checkpoint.write:0:1:6.5;"
            "default:both:layers.1.attn;"
            "noise:generator:layers.0.mlp;seed:generator@b;reorder:trainer:model.layers.1.mlp.experts.down_proj@a")
    assert parse(spec) == [
        Fault("exit", "trainer.train_step", rank=1, n=3), Fault("hang", "checkpoint.write", rank=0, n=2),
        Fault("sleep", "checkpoint.write", rank=0, n=1, seconds=6.5),
        Fault("default", "both", "layers.1.attn"), Fault("noise", "generator", "layers.0.mlp"),
        Fault("seed", "generator", run="b"),
        Fault("reorder", "trainer", "model.layers.1.mlp.experts.down_proj", run="a")]


@pytest.mark.parametrize("spec, message", [
    ("crash:trainer.score:0:1", r"unknown fault 'crash'; one of exit, hang, sleep, default, noise, seed, reorder"),
    ("exit:trainer.score:zero:1", r"expected exit:<site>:<rank>:<n>"),
    ("sleep:checkpoint.write:0:1:sleep=6", r"expected sleep:<site>:<rank>:<n>:<s>"),  # the old form
    ("trainer.score:0:1", r"unknown fault 'trainer.score'"),  # the old form is refused, not ignored
    ("default:generator:layers.0.router", r"expected default:<side>:layers.<i>.attn\|mlp"),
    ("noise:gen:layers.0.mlp", r"expected noise:<side>:<op> \(<side>: generator, trainer, both\)"),
    ("seed:trainer", r"expected seed:generator"),
    ("seed:generator@c", r"a gate run is @a or @b"),
])
def test_a_malformed_fault_is_named(spec, message):
    with pytest.raises(ValueError, match=rf"RLALIGN_FAULT=.*{message}"):
        parse(spec)


def test_a_gate_runs_faults_apply_in_that_run_only(monkeypatch):
    monkeypatch.setenv(faults.ENV, "noise:generator:layers.1.mlp;seed:generator@b;default:trainer:layers.0.mlp@a")
    assert [f.kind for f in faults.active()] == ["noise"]  # outside a gate: the scoped ones are not active
    with gate_run("b"):
        assert os.environ[faults.ENV] == "noise:generator:layers.1.mlp;seed:generator"
        assert SideFaults("generator").seed_offset == 1 and SideFaults("trainer").default == []
    with gate_run("a"):
        assert [f.kind for f in faults.active()] == ["noise", "default"] and SideFaults("generator").seed_offset == 0
    assert os.environ[faults.ENV] == "noise:generator:layers.1.mlp;seed:generator@b;default:trainer:layers.0.mlp@a"
    monkeypatch.setenv(faults.ENV, "seed:generator@b")
    with gate_run("a"):
        assert faults.ENV not in os.environ  # nothing for run a: unset, so its actors get no runtime env
    assert os.environ[faults.ENV] == "seed:generator@b"
    monkeypatch.setenv(faults.ENV, "seed:generator@x")
    with pytest.raises(ValueError, match="a gate run is @a or @b"), gate_run("a"):
        pass


def test_what_each_side_carries(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert not SideFaults("generator").touches_ops and SideFaults("generator").seed_offset == 0
    both = parse("noise:both:layers.1.mlp;reorder:trainer:w;seed:generator")
    gen, tr = SideFaults("generator", both), SideFaults("trainer", both)
    assert (gen.seed_offset, gen.reorder, gen.touches_ops) == (1, None, True)
    assert (tr.seed_offset, tr.reorder, tr.touches_ops) == (0, "w", True)
    assert not SideFaults("trainer", parse("reorder:trainer:w")).touches_ops  # the taps stay inert
    x = torch.randn(4, 8)
    y = gen.apply("layers.1.mlp", x)
    assert (y.view(torch.int32) != x.view(torch.int32)).sum() == 1  # one last bit
    assert gen.apply("layers.0.mlp", x) is x  # another op: untouched


def test_maybe_fail_counts_only_its_site_and_rank_and_a_sleep_goes_on(monkeypatch):
    monkeypatch.setenv(faults.ENV, "exit:trainer.score:1:2")
    faults._calls.clear()
    faults.maybe_fail("trainer.score", 0)  # another rank
    faults.maybe_fail("generator.generate", 1)  # another site
    faults.maybe_fail("trainer.score", 1)  # call 1 of 2: the process lives on
    assert faults._calls == {"trainer.score": 1}
    waits = []

    class Event:  # records the wait instead of waiting
        def wait(self, timeout=None):
            waits.append(timeout)

    monkeypatch.setattr(faults.threading, "Event", Event)
    monkeypatch.setenv(faults.ENV, "sleep:generator.generate:0:1:0.2")
    faults.maybe_fail("generator.generate", 0)  # the first call waits 0.2 s, then returns
    faults.maybe_fail("generator.generate", 0)
    assert waits == [0.2]


def test_test_knobs_are_not_in_the_users_config():
    for key in ("monitor.inject=generator:sampling:seed", "gate.b_overrides=[]"):
        with pytest.raises(ConfigError, match=r"unknown config key"):
            load_config([key])
