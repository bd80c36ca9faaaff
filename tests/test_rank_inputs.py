"""What the ranks read besides the run dir (rlalign.actors.probe.rank_inputs): relative paths reach
the ranks absolute (a rank's working directory is its node's), and the node probe names an input a
node does not see. The probe function runs here as a plain call; tests/test_multinode.py runs it on
a node of a real cluster."""

from __future__ import annotations

from pathlib import Path

from rlalign.actors.probe import RankInput, _missing, _probe, _refusal, _wanted, rank_inputs, ship
from rlalign.config import load_config


def _inputs(tmp_path: Path, monkeypatch, *over: str) -> dict:
    monkeypatch.chdir(tmp_path)
    return rank_inputs(load_config(list(over)))


def test_relative_paths_reach_the_ranks_absolute_and_module_names_unchanged(tmp_path, monkeypatch):
    got = _inputs(tmp_path, monkeypatch, "task=guess", "task.env=envs/my_env.py:MyEnv", "task.tokenizer=tok",
                  "algorithm.loss=mylosses.clipped:loss")
    assert {k: (v.kind, v.target, v.shipped) for k, v in got.items()} == {
        "task.env": ("path", f"{tmp_path}/envs/my_env.py", f"{tmp_path}/envs/my_env.py:MyEnv"),
        "task.tokenizer": ("path", f"{tmp_path}/tok", f"{tmp_path}/tok"),
        "algorithm.loss": ("module", "mylosses.clipped", "mylosses.clipped:loss")}
    cfg = {"task": {"env": "envs/my_env.py:MyEnv", "tokenizer": "tok"}, "algorithm": {"loss": "x"}}
    assert ship(cfg, got) == {"task": {"env": f"{tmp_path}/envs/my_env.py:MyEnv", "tokenizer": f"{tmp_path}/tok"},
                              "algorithm": {"loss": "mylosses.clipped:loss"}}


def test_built_ins_and_the_char_tokenizer_are_no_inputs(tmp_path, monkeypatch):
    assert _inputs(tmp_path, monkeypatch, "task=guess") == {}  # task.env=guess: built in
    assert _inputs(tmp_path, monkeypatch, "task=guess", "task.tokenizer=char") == {}
    # twin: the tokenizer is an input only where the ranks tokenize (task.env's observations)
    assert list(_inputs(tmp_path, monkeypatch, "task.tokenizer=tok")) == []
    assert list(_inputs(tmp_path, monkeypatch, "task=guess", "task.tokenizer=tok")) == ["task.tokenizer"]


def test_the_probe_names_the_first_input_a_node_does_not_see(tmp_path):
    (tmp_path / "env.py").write_text("")
    seen = {"task.env": ("path", str(tmp_path / "env.py")), "algorithm.loss": ("module", "json.decoder")}
    assert _missing(seen) is None
    # twins: a path that is not there, a module the node cannot import
    assert _missing({**seen, "model.path": ("path", str(tmp_path / "model"))}) == (
        "model.path", f"does not see {tmp_path / 'model'}")
    assert _missing({**seen, "algorithm.loss": ("module", "no_such_pkg_x.losses")}) == (
        "algorithm.loss", "has no module named 'no_such_pkg_x'")


def test_the_probe_checks_the_run_dir_before_the_inputs(tmp_path):
    (tmp_path / "driver").write_text("token")
    missing = {"model.path": ("path", str(tmp_path / "model"))}
    assert _probe(str(tmp_path), "token", "n1", {}) is None and (tmp_path / "node-n1").read_text() == "token"
    assert _probe(str(tmp_path), "token", "n1", missing) == ("model.path", f"does not see {tmp_path / 'model'}")
    assert _probe(str(tmp_path), "other", "n1", missing) == ("run.dir", "reads another run's probe file there")


def test_a_module_a_node_cannot_import_is_named_with_where_a_rank_looks(tmp_path, monkeypatch):
    inputs = _inputs(tmp_path, monkeypatch, "task=guess", "task.env=myenvs.env:MyEnv")
    line = str(_refusal("task.env", "has no module named 'myenvs'", tmp_path / "run", inputs, "10.0.0.2"))
    assert line == ("task.env=myenvs.env:MyEnv: node 10.0.0.2 has no module named 'myenvs' (a rank imports from its "
                    f"node's packages and PYTHONPATH and from the driver's working directory {tmp_path} as that node "
                    "sees it); install it on every node, or run from a directory that every node mounts at the same "
                    "path")
    # twin: a path the node does not see is a matter of shared storage, not of imports
    inputs["model.path"] = RankInput("path", str(tmp_path / "m"), str(tmp_path / "m"))
    line = str(_refusal("model.path", f"does not see {tmp_path / 'm'}", tmp_path / "run", inputs, "10.0.0.2"))
    assert line.startswith(f"model.path={tmp_path / 'm'}: node 10.0.0.2 does not see {tmp_path / 'm'}; put it on a "
                           "file system") and "imports" not in line


def test_a_node_is_asked_only_for_what_its_ranks_read():
    """A generator-only node is not asked for the trainer's loss, nor a trainer-only node for the
    environment; model.path is every rank's. Twin: a node hosting both groups is asked for all three."""
    from omegaconf import OmegaConf

    got = rank_inputs(OmegaConf.create({"model": {"path": "m"}, "algorithm": {"loss": "losses:fn"},
                                        "task": {"env": "my_env.py:MyEnv", "tokenizer": None}}))
    assert list(_wanted(got, {"generator"})) == ["model.path", "task.env"]
    assert list(_wanted(got, {"trainer"})) == ["model.path", "algorithm.loss"]
    assert list(_wanted(got, {"trainer", "generator"})) == ["model.path", "task.env", "algorithm.loss"]
