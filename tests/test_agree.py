import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import same_bits, train_cli_with_fault

from rlalign.agree import run_agree, score_batch
from rlalign.config import load_config


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_agree_deterministic_is_bitwise(dtype):
    """`rlalign agree` at micro-batch 3, then the same rollouts rescored by the trainer at
    micro-batch 1 and all-at-once, each in another shuffled order: every token's logprob is the
    generator's, bit for bit (one generation serves the three trainer batchings)."""
    cfg = load_config([f"model.dtype={dtype}", "trainer.micro_batch_size=3", "trainer.ep_size=1"])
    res, rollouts = run_agree(cfg)
    assert res["tokens"] >= 2000
    assert res["mismatched_tokens"] == 0 and res["max_abs_diff"] == 0.0 and res["mean_abs_diff"] == 0.0
    assert res["dtype"] == dtype and res["kernels"] == "deterministic"
    for mb, seed in ((1, 11), (0, 12)):
        cfg.trainer.micro_batch_size = mb
        order = torch.randperm(len(rollouts), generator=torch.Generator().manual_seed(seed)).tolist()
        lps = score_batch(cfg, [rollouts[i].prompt for i in order], [rollouts[i].tokens for i in order],
                          rollouts[0].params, order)
        assert all(same_bits(lp, rollouts[i].logprobs) for lp, i in zip(lps, order)), mb


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_agree_default_mode_reports_the_mismatch(dtype):
    cfg = load_config(["kernels.mode=default", f"model.dtype={dtype}", "trainer.micro_batch_size=3",
                       "trainer.ep_size=1"])
    res, _ = run_agree(cfg)
    assert res["mismatched_tokens"] > 0 and res["max_abs_diff"] > 0


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rlalign.cli", *args], capture_output=True, text=True, timeout=300)


def _refuse(name):
    raise ValueError(f"non-standard JSON constant {name}")


def test_cli_last_line_is_the_json_report():
    p = _cli("agree", "agree.num_prompts=6", "agree.max_new_tokens=5", "trainer.ep_size=1")  # in-process ranks
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1], parse_constant=_refuse)  # standard JSON only
    assert set(res) >= {"tokens", "mismatched_tokens", "max_abs_diff", "mean_abs_diff", "kernels", "dtype",
                        "trainer_ep", "generator_ep"}
    assert res["mismatched_tokens"] == 0
    err = p.stderr.strip().splitlines()  # what it runs as it begins, then its closing line
    assert any(ln.startswith("rlalign agree: [") and "generating 6 sequences of up to 5 tokens" in ln for ln in err)
    assert any("scoring the " in ln and "on the trainer side (EP 1, in this process" in ln for ln in err)
    assert err[-1] == (f"rlalign agree: 0 of {res['tokens']} tokens differ between the generator's and the trainer's "
                       f"logprobs: bitwise agreement (kernels.mode=deterministic)")


def test_cli_rejects_bad_config_with_the_valid_keys(capsys):
    from rlalign import cli

    assert cli.main(["agree", "trainer.micro_batch=3"]) == 2  # in-process (the process exit: the test above)
    err = capsys.readouterr().err
    assert "unknown config key 'trainer.micro_batch'" in err and "micro_batch_size" in err
    assert cli.main(["agree", "generator.temperature=0"]) == 2 and "temperature" in capsys.readouterr().err
    assert cli.main(["agree", "--cfg", "job", "kernels.mode=default"]) == 0
    assert "mode: default" in capsys.readouterr().out


def test_agree_runs_the_worker_methods_that_train_runs(monkeypatch):
    """`rlalign agree` certifies the code `rlalign train` runs: the same GeneratorWorker.generate
    and the trainer's score_micro_batch (spied here in-process; train's side below)."""
    from rlalign import workers
    from rlalign.agree import run_agree
    from rlalign.training import trainer

    calls = {"generate": 0, "score": 0, "score_micro_batch": 0}

    def spy(owner, name, key):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            calls[key] += 1
            return real(*a, **k)

        monkeypatch.setattr(owner, name, wrapper)

    spy(workers.GeneratorWorker, "generate", "generate")
    spy(workers.TrainerWorker, "score", "score")
    spy(trainer, "score_micro_batch", "score_micro_batch")
    res, _ = run_agree(load_config(["trainer.ep_size=1", "generator.ep_size=1", "agree.num_prompts=4",
                                    "agree.max_new_tokens=8"]))
    assert res["mismatched_tokens"] == 0
    assert calls["generate"] == 1 and calls["score"] == 1 and calls["score_micro_batch"] >= 1
    # negative twin: an agree whose generation bypasses the worker is caught by the same check
    from omegaconf import OmegaConf

    from rlalign import agree
    from rlalign.model.build import model_from_config
    from rlalign.rollout.native.engine import generate

    def bypass(rank, world, group, cfg_dict, prompts, sample_ids, params, recorded):
        return generate(model_from_config(OmegaConf.create(cfg_dict)), prompts, sample_ids, params), {}  # no rows

    monkeypatch.setattr(agree, "_generate_rank", bypass)
    calls.update(generate=0, score=0)
    run_agree(load_config(["trainer.ep_size=1", "generator.ep_size=1", "agree.num_prompts=4",
                           "agree.max_new_tokens=8"]))
    assert calls["generate"] == 0 and calls["score"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("site,method", [("generator.generate", "generate"),
                                         ("scoring.score_micro_batch", "train_step")])
def test_train_runs_the_generation_and_scoring_functions_agree_certifies(tmp_path, site, method, capsys, monkeypatch):
    """A fault planted in the function agree certifies stops `rlalign train` there (its actors are
    other processes: a spy cannot reach them, an environment-selected fault can)."""
    rc, err = train_cli_with_fault(f"exit:{site}:0:1", ["run.steps=1", f"run.dir={tmp_path}", "task.num_prompts=2",
                                                   "task.samples_per_prompt=2", "trainer.ep_size=1",
                                                   "generator.ep_size=1"], capsys, monkeypatch)
    assert rc == 2 and f"failed in {method}()" in err, err[-2000:]


def test_agree_exits_1_on_a_deterministic_mismatch_and_0_without_one(capsys, monkeypatch):
    """The real command: a fault in the generator's attention (rlalign.faults; agree runs no Ray
    actor) makes tokens differ (exit 1); the same batch without it agrees (exit 0)."""
    from rlalign import cli

    small = ["trainer.ep_size=1", "generator.ep_size=1", "agree.num_prompts=2", "agree.max_new_tokens=4"]
    monkeypatch.setenv("RLALIGN_FAULT", "default:generator:layers.0.attn")
    assert cli.main(["agree", *small]) == 1
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mismatched_tokens"] > 0
    monkeypatch.delenv("RLALIGN_FAULT")
    assert cli.main(["agree", *small]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mismatched_tokens"] == 0


SMALL_EP1 = ["trainer.ep_size=1", "generator.ep_size=1", "agree.num_prompts=2", "agree.max_new_tokens=3"]


@pytest.mark.parametrize("fault, first", [("default:generator:layers.1.attn", "layers.1.attn"),
                                          ("default:trainer:layers.0.mlp", "layers.0.mlp")])
def test_agree_with_layer_fingerprints_names_the_first_divergent_op(monkeypatch, fault, first):
    """monitor.fingerprints=layers: both sides' per-token row fingerprints locate where the mismatch began,
    on whichever side the fault sits; the JSON, the table and the closing line name it."""
    from rlalign.agree import verdict

    monkeypatch.setenv("RLALIGN_FAULT", fault)
    res, _ = run_agree(load_config([*SMALL_EP1, "monitor.fingerprints=layers"]))
    assert res["mismatched_tokens"] > 0 and res["first_divergent_op"] == first
    assert verdict(res).endswith(f"; first divergence: {first})")


def test_negative_twin_agree_without_layer_fingerprints_names_no_op(monkeypatch):
    monkeypatch.setenv("RLALIGN_FAULT", "default:generator:layers.1.attn")
    res, _ = run_agree(load_config(SMALL_EP1))
    assert res["mismatched_tokens"] > 0 and res["first_divergent_op"] is None


@pytest.mark.parametrize("text, message", [
    ('{"step": 0, "sampl', r"batch.json:1:13: not JSON \(.*\): a damaged mismatch dump"),
    ('{"step": 0}', r"batch.json: not a mismatch dump's batch \(no sampling, prompts, sample_ids, responses, "
                    r"generator_logprobs\)"),
    ('[1, 2]', r"batch.json: not a mismatch dump's batch \(no sampling,"),
    (json.dumps({"sampling": {"top_p": 5.0}, "prompts": [[3]], "sample_ids": [0], "responses": [[4]],
                 "generator_logprobs": [[-1.0]]}), r"batch.json: sampling.top_p=5.0: must be in \(0, 1\]"),
    (json.dumps({"sampling": {"top_q": 1}, "prompts": [[3]], "sample_ids": [0], "responses": [[4]],
                 "generator_logprobs": [[-1.0]]}), r"batch.json: sampling parameters \['top_q'\]: not fields"),
])
def test_a_damaged_mismatch_dump_is_one_line_naming_its_file(tmp_path, capsys, text, message):
    from rlalign import cli

    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}")
    (tmp_path / "batch.json").write_text(text)
    assert cli.main(["agree", f"agree.replay={tmp_path}", "trainer.ep_size=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(rf"rlalign agree: error: agree.replay: {tmp_path}/{message}", err[0]), err


def test_a_prompt_length_past_the_context_names_the_key_to_set(capsys):
    """agree.prompt_max_len past the model's context is refused naming the key and the most it may be;
    twin: at that most it draws its prompts."""
    from rlalign import cli
    from rlalign.agree import random_prompts
    from rlalign.config import model_args

    cfg = load_config(["agree.max_new_tokens=5"])
    room = model_args(cfg).max_position_embeddings - 5
    assert cli.main(["agree", f"agree.prompt_max_len={room + 1}", "agree.max_new_tokens=5", "trainer.ep_size=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"agree.prompt_max_len={room + 1}: with agree.max_new_tokens=5" in err[0], err
    assert f"set agree.prompt_max_len<={room} or lower agree.max_new_tokens" in err[0], err
    cfg = load_config(["agree.max_new_tokens=5", f"agree.prompt_max_len={room}", f"agree.prompt_min_len={room}"])
    assert [len(p) for p in random_prompts(cfg, 64)] == [room] * cfg.agree.num_prompts  # twin: it fits


def test_a_replay_path_that_is_missing_or_not_a_dump_says_which(tmp_path, capsys):
    from rlalign import cli

    assert cli.main(["agree", f"agree.replay={tmp_path}/absent", "trainer.ep_size=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"agree.replay='{tmp_path}/absent': no such directory" in err[0], err
    assert cli.main(["agree", f"agree.replay={tmp_path}", "trainer.ep_size=1"]) == 2  # twin: it exists
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"agree.replay='{tmp_path}': not a mismatch dump" in err[0], err
