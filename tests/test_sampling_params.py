"""SamplingParams travels with each request and each finished sequence, and every reader takes it from
there: a field added to the class reaches the native engine's rollouts, its decode-graph cache key,
vLLM's per-request extra_args and sampler, `rlalign agree`'s replay and the trainer's rescoring
without another edit. No module but rlalign/sampling_params.py lists the fields by hand (a source
scan). Each check has a negative twin."""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import same_bits, tiny_model

from rlalign.config import load_config
from rlalign.rollout.native.engine import generate
from rlalign.rollout.native.graphs import DecodeGraphs
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Sample
from rlalign.training.scoring import drawn_with, score

ROOT = Path(__file__).resolve().parent.parent
FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# the class itself; the model's own ModelArgs has a `top_k` (experts per token) and an `eos_token_id` (its
# checkpoint's): other things under the same names. kernels/ (below SamplingParams) takes the numbers.
OWN = ("rlalign/sampling_params.py", "rlalign/model/")


def field_lists(path: str, text: str, fields=FIELDS) -> list[str]:
    """'path:line names a, b' for each place that names two or more sampling fields by hand: a tuple,
    list, set or dict display (string constants, attribute reads, names in it), a call's keyword
    arguments, a function's parameters."""
    out = []
    for node in ast.walk(ast.parse(text)):
        names: set[str] = set()
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            for sub in ast.walk(node):
                name = sub.value if isinstance(sub, ast.Constant) else sub.attr if isinstance(sub, ast.Attribute) \
                    else sub.id if isinstance(sub, ast.Name) else None
                if name in fields:
                    names.add(name)
        elif isinstance(node, ast.Call):
            names = {k.arg for k in node.keywords if k.arg in fields}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg in fields}
        if len(names) >= 2:
            out.append(f"{path}:{node.lineno} names {', '.join(sorted(names))}")
    return out


def test_no_hand_written_list_of_sampling_fields_outside_sampling_params():
    files = [f for d in ("rlalign", "actors") for f in sorted((ROOT / d).rglob("*.py"))]
    rel = [str(f.relative_to(ROOT)) for f in files]
    assert "rlalign/rollout/native/graphs.py" in rel and "rlalign/agree.py" in rel
    offences = [o for f, r in zip(files, rel) if not r.startswith(OWN) for o in field_lists(r, f.read_text())]
    assert offences == [], "\n".join(offences)


def test_negative_twin_the_old_hand_written_lists_are_found():
    """The four places the issue named, as they were."""
    old = {
        "graphs.py": "key = (p.logprob_temperature, p.top_k, p.top_p, p.greedy)\n",
        "engine.py": 'spec = {"seed": params.seed, "temperature": params.temperature, "top_k": params.top_k}\n',
        "sampler.py": "for (seed, temperature, top_k, top_p, greedy), idx in groups.items():\n    pass\n",
        "agree.py": 'gen = {k: s[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p", "greedy")}\n',
        "scoring.py": "def score_micro_batch(model, temperature=1.0, top_k=0, top_p=1.0):\n    pass\n",
        "sampler2.py": "p = SamplingParams(temperature=t, top_k=k, top_p=q, greedy=g, seed=s)\n",
    }
    for path, text in old.items():
        assert field_lists(path, text), path
    assert field_lists("ok.py", "key = params.graph_key()\nd = params.to_dict()\nt = params.top_k\n") == []


@pytest.fixture
def with_min_p(monkeypatch):
    """SamplingParams with one more field, as if it had been added to the class: bound in its place in
    every module of ours that imported the class (the readers are not edited)."""
    extended = dataclasses.make_dataclass("SamplingParams", [("min_p", float, 0.0)], bases=(SamplingParams,))
    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("rlalign") and getattr(m, "SamplingParams", None) is SamplingParams]
    for m in patched:
        monkeypatch.setattr(m, "SamplingParams", extended)
    assert len(patched) >= 4
    return extended


def test_graph_key_and_dict_carry_a_new_field(with_min_p):
    a, b = with_min_p(min_p=0.0), with_min_p(min_p=0.5)
    assert a.graph_key() != b.graph_key() and a.key() != b.key()
    assert dataclasses.replace(b, seed=9, eos_token_id=1).graph_key() == b.graph_key()  # not baked into graphs
    back = with_min_p.from_dict(json.loads(json.dumps(b.to_dict())))  # a mismatch dump, through JSON
    assert type(back) is with_min_p and back == b and back.min_p == 0.5
    with pytest.raises(ValueError, match=r"\['min_q'\]: not fields of SamplingParams"):
        with_min_p.from_dict({**b.to_dict(), "min_q": 1.0})  # twin: a field the class lacks is named


def test_native_engine_and_its_graph_cache_carry_a_new_field(with_min_p):
    m = tiny_model(seed=4)
    p = with_min_p(max_new_tokens=3, seed=2, min_p=0.5)
    rollouts = generate(m, [[3, 4, 5], [6, 7]], [0, 1], p)
    assert all(r.params is p for r in rollouts)
    g = DecodeGraphs(None, None, 0, 0)

    def graphs_for(params):
        g.begin(m, params)
        g.has(1)
        g.end()
        return g.graphs

    graphs_for(p)[4] = "captured"
    assert graphs_for(dataclasses.replace(p, seed=7)) == {4: "captured"}  # the seed: the same graphs
    assert graphs_for(dataclasses.replace(p, min_p=0.25)) == {}  # the new field: another distribution's


def test_vllm_request_round_trip_carries_a_new_field(with_min_p):
    """The vLLM engine's per-request extra_args, read back by the sampler inside vLLM's worker."""
    pytest.importorskip("vllm")
    from rlalign.rollout.vllm import sampler
    from rlalign.rollout.vllm.engine import VllmGenerator

    class Llm:  # vLLM's LLM.generate: records the requests, returns one token each
        def generate(self, prompts, sps, use_tqdm):
            self.sps = sps
            out = type("Out", (), {"token_ids": [1], "logprobs": [{1: type("L", (), {"logprob": -0.5})()}],
                                   "finish_reason": "stop"})
            return [type("R", (), {"outputs": [out]})() for _ in prompts]

    eng = object.__new__(VllmGenerator)
    eng.stock, eng.llm = False, Llm()
    p = with_min_p(max_new_tokens=3, seed=2, eos_token_id=1, min_p=0.5)
    rollouts = eng._generate([[3, 4], [5]], [7, 8], p)
    assert [r.params is p for r in rollouts] == [True, True]
    reqs = [sampler._request(sp, [3, 4], []) for sp in eng.llm.sps]
    assert [r.sample_id for r in reqs] == [7, 8] and all(r.params == p and r.params.min_p == 0.5 for r in reqs)
    other = sampler._request(type("S", (), {"extra_args": {"rlalign": {"params": with_min_p(min_p=0.2).to_dict(),
                                                                        "sample_id": 9}}})(), [3], [])
    assert other.params.key() != reqs[0].params.key()  # twin: sampled apart


def test_agree_replays_a_dump_with_a_new_field(with_min_p, tmp_path):
    from rlalign.agree import load_replay

    p = with_min_p(max_new_tokens=5, seed=3, eos_token_id=1, temperature=0.7, min_p=0.5)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}")
    batch = {"sampling": p.to_dict(), "prompts": [[3, 4]], "sample_ids": [0], "responses": [[5]],
             "generator_logprobs": [[-1.0]]}  # what step.dump_mismatch writes
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    cfg, prompts, ids, params, _ = load_replay(load_config([f"agree.replay={tmp_path}"]))
    assert params == p and params.min_p == 0.5 and cfg.model.path == str(tmp_path / "weights")


def test_the_trainer_scores_under_the_samples_params_not_the_config(with_min_p, monkeypatch):
    """The trainer's config says temperature 1; the samples were drawn at 0.7: the trainer scores at 0.7
    (what score() gives under the samples' params), and the params it passes are the samples' own."""
    from rlalign.training import trainer as trainer_mod

    cfg = load_config(["model.num_layers=1", "trainer.micro_batch_size=2"])
    tr = trainer_mod.Trainer(cfg)
    p = with_min_p(temperature=0.7, top_k=20, min_p=0.5)
    samples = [Sample([3, 4, 5], [6, 7, 8], torch.zeros(3), sample_id=i, params=p) for i in range(3)]
    seen = []
    real = trainer_mod.score_micro_batch

    def spy(*a, **kw):
        seen.append(kw["params"])
        return real(*a, **kw)

    monkeypatch.setattr(trainer_mod, "score_micro_batch", spy)
    got = tr.score(samples)
    assert seen and all(s is p for s in seen)
    P, R = [s.prompt for s in samples], [s.response for s in samples]
    with torch.no_grad():
        want = score(tr.model, P, R, p, micro_batch_size=2)
        at_config = score(tr.model, P, R, SamplingParams.from_config(cfg), micro_batch_size=2)
    assert all(same_bits(a, b.float()) for a, b in zip(got, want))
    assert not all(same_bits(a, b.float()) for a, b in zip(got, at_config))  # twin: the config's distribution


def test_one_micro_batch_is_scored_under_one_distribution():
    p = SamplingParams(temperature=0.7)
    same = [Sample([3], [4], torch.zeros(1), sample_id=i, params=dataclasses.replace(p, seed=i)) for i in range(2)]
    assert drawn_with(same) is same[0].params  # other seeds: the same distribution
    mixed = same + [Sample([3], [4], torch.zeros(1), sample_id=2, params=SamplingParams(temperature=0.9))]
    with pytest.raises(ValueError, match=r"samples \[2\] were drawn from another distribution"):
        drawn_with(mixed)
