"""`rlalign export`: a checkpoint's model as a Hugging Face directory that transformers loads with our
logits and rlalign's model.path loads bit for bit; bad input named; nothing unpickled."""

import json
import os
import pickle
import shlex

import pytest
import torch
from conftest import same_bits

from rlalign import checkpoint as ckpt
from rlalign import cli, kernels
from rlalign.checkpoint import CheckpointError
from rlalign.config import load_config, model_args
from rlalign.export import export_hf, model_meta
from rlalign.model import check_hf_dir, load_hf

transformers = pytest.importorskip("transformers")

WEIGHT = "model/model.layers.0.self_attn.q_proj.weight"


def _trainer():
    """The tiny MoE trainer after one AdamW step (weights no longer the init's)."""
    from rlalign import kernels
    from rlalign.sampling_params import SamplingParams
    from rlalign.sequences import Sample
    from rlalign.training.trainer import Trainer

    cfg = load_config(["trainer.micro_batch_size=2"])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    tr = Trainer(cfg, None)
    samples = [Sample([3, 4, 5], [6, 7, 8, 9], torch.zeros(4), params=SamplingParams()),
               Sample([5, 4], [9, 2], torch.zeros(2), params=SamplingParams())]
    tr.forward_backward(samples, lambda lps, idx: (-torch.cat(lps).sum(), {}), 6)
    tr.optimizer_step()
    return tr, cfg


def _save(tr, cfg, run_dir, step=0, tokenizer=None, model=True):
    ckpt.save_shards(tr.checkpoint_state(), ckpt.tmp_path(run_dir, step))
    meta = {"data_position": step + 1, "weights_fp": "-"}
    if model:
        meta.update(model_meta(model_args(cfg), cfg.model.dtype, tokenizer))
    return ckpt.complete(run_dir, step, meta, keep=0)


@pytest.fixture(scope="module")
def trained():
    return _trainer()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The trainer's checkpoint exported in shards of 100 kB: (checkpoint, export dir, summary)."""
    tr, cfg = trained
    d = tmp_path_factory.mktemp("run")
    path = _save(tr, cfg, d)
    summary = export_hf(path, d / "hf", shard_bytes=100_000)
    return path, d / "hf", summary


def test_the_export_loads_in_rlalign_bitwise_and_in_transformers_with_our_logits(trained, exported):
    tr, _ = trained
    _, out, summary = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.iterdir())
    assert summary["shards"] == 5 and files == ["config.json", *[f"model-0000{i}-of-00005.safetensors"
                                                                  for i in range(1, 6)], "model.safetensors.index.json",
                                                "tokenizer.json", "tokenizer_config.json"]
    assert set(index["weight_map"].values()) == set(files[1:6]) and index["metadata"]["total_size"] == summary["bytes"]
    check_hf_dir(out)
    from rlalign.model.build import model_from_config

    want = tr.model.state_dict()
    for model in (load_hf(out), model_from_config(load_config([f"model.path={out}"]))):  # model.path=OUT_DIR
        got = model.state_dict()
        assert got.keys() == want.keys() and all(same_bits(got[k], want[k]) for k in want)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_hf(out, dtype="float32")
    toks = torch.randint(2, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), kernels.use(mode="deterministic"):
        ref = hf(toks).logits
        got = ours(toks.reshape(-1), [0, 17, 34, 51]).view(3, 17, -1)
        init = model_from_config(load_config(["model.dtype=float32"]))(toks.reshape(-1), [0, 17, 34, 51])
    assert (got - ref).abs().max() / ref.abs().max() <= 1e-5
    assert (init.view(3, 17, -1) - ref).abs().max() / ref.abs().max() > 1e-3  # twin: the weights before the step


def test_an_existing_target_is_refused_unless_overwrite(exported, tmp_path):
    path, _, _ = exported
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=rf"{out} exists; choose another directory or pass --overwrite"):
        export_hf(path, out)
    assert sorted(os.listdir(out)) == ["keep.txt"]  # untouched
    export_hf(path, out, overwrite=True)  # twin: asked to, it replaces it
    assert "keep.txt" not in os.listdir(out) and (out / "config.json").is_file()


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)],
                         ids=["umask022", "umask077"])
def test_the_export_has_the_modes_the_umask_gives_so_that_a_server_of_another_user_reads_it(exported, tmp_path,
                                                                                           umask, dir_mode, file_mode):
    path, _, _ = exported  # the twin (0o077): the modes follow the umask, not a fixed owner-only or open mode
    old = os.umask(umask)
    try:
        export_hf(path, tmp_path / "hf", shard_bytes=100_000)
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "hf").st_mode & 0o777) == oct(dir_mode)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()} == {
        p.name: oct(file_mode) for p in (tmp_path / "hf").iterdir()}


def test_overwrite_never_replaces_the_checkpoint_a_directory_holding_it_or_a_run_directory(trained, tmp_path):
    tr, cfg = trained
    path = _save(tr, cfg, tmp_path / "run")
    other = _save(tr, cfg, tmp_path / "other").parent.parent
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for out, what in ((path, "is the checkpoint itself"), (path.parent.parent, "holds the checkpoint"),
                      (path.parent, "holds the checkpoint"),
                      (other, rf"is a run directory \({other}/checkpoints is there\), which an export would replace")):
        with pytest.raises(ValueError, match=rf"^{out} {what}"):
            export_hf(path, out, overwrite=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    export_hf(path, tmp_path / "hf")  # twin: an earlier export beside the run is replaced when asked
    assert export_hf(path, tmp_path / "hf", overwrite=True)["out"] == str(tmp_path / "hf")


def test_overwrite_replaces_a_file_or_a_link_there_and_leaves_nothing_beside_it(exported, tmp_path):
    path, _, _ = exported
    (tmp_path / "file").write_text("x")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("y")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for name in ("file", "link"):
        with pytest.raises(FileExistsError):  # twin: not without --overwrite
            export_hf(path, tmp_path / name)
        export_hf(path, tmp_path / name, overwrite=True)
        assert check_hf_dir(tmp_path / name) and not (tmp_path / name).is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["file", "link", "target"]
    assert (tmp_path / "target" / "keep").read_text() == "y"


def _edit_meta(path, **model):
    meta = json.loads((path / "meta.json").read_text())
    meta["model"].update(model)
    (path / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_of_another_model_shape_is_refused_naming_the_tensor(trained, tmp_path):
    tr, cfg = trained
    path = _save(tr, cfg, tmp_path)
    _edit_meta(path, moe_intermediate_size=32)
    with pytest.raises(CheckpointError, match=r"tensor 'model/model.layers.0.mlp.experts.gate_up_proj/expert0' is "
                                              r"BF16\[128, 64\] in shard-00001-model-00001-of-00001.safetensors, the "
                                              r"model of its config \(.*moe_intermediate_size=32.*\) needs "
                                              r"BF16\[64, 64\]"):
        export_hf(path, tmp_path / "a")
    _edit_meta(path, moe_intermediate_size=64, num_experts=4)
    with pytest.raises(CheckpointError, match=r"tensor 'model/model.layers.0.mlp.gate.weight' is BF16\[8, 64\] .* "
                                              r"needs BF16\[4, 64\]"):
        export_hf(path, tmp_path / "b")
    _edit_meta(path, num_experts=8, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match=r"tensor 'model/lm_head.weight' \(BF16\[64, 64\]\) is not part of the "
                                              r"model of its config"):
        export_hf(path, tmp_path / "b")
    for layers in (3, 10**7):  # checked before a module per layer is made (10**7 of them took minutes)
        _edit_meta(path, tie_word_embeddings=False, num_hidden_layers=layers)
        with pytest.raises(CheckpointError, match=rf"its tensors hold 2 layers, the model of its config \(.*\) has "
                                                  rf"{layers} \(another model\?\)"):
            export_hf(path, tmp_path / "c")
    assert not any((tmp_path / n).exists() for n in "abc")
    _edit_meta(path, num_hidden_layers=2)
    export_hf(path, tmp_path / "d")  # twin: the shape it was written with


def test_a_tokenizer_entry_that_is_not_a_path_and_an_out_dir_below_a_file_are_named(trained, tmp_path):
    """meta.json's tokenizer of another type is damage named in meta.json (it was a TypeError in the copy), and
    an OUT_DIR below a file is named before the checkpoint is read ('[Errno 17] File exists' before). The twin:
    a null tokenizer (the char tokenizer's) exports."""
    tr, cfg = trained
    path = _save(tr, cfg, tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "tokenizer": 123}))
    with pytest.raises(CheckpointError, match=r"meta.json: tokenizer 123, expected the run's tokenizer directory"):
        export_hf(path, tmp_path / "a")
    (tmp_path / "afile").write_text("")
    with pytest.raises(NotADirectoryError, match=rf"OUT_DIR {tmp_path}/afile/x/y: {tmp_path}/afile is a file"):
        export_hf(path, tmp_path / "afile" / "x" / "y")
    (path / "meta.json").write_text(json.dumps({**meta, "tokenizer": None}))
    export_hf(path, tmp_path / "b")


def test_a_changed_tensor_is_refused_by_its_fingerprint(trained, tmp_path):
    tr, cfg = trained
    path = _save(tr, cfg, tmp_path)
    shard = next(p for p in path.iterdir() if p.name.endswith(".safetensors"))
    b = bytearray(shard.read_bytes())
    n = int.from_bytes(b[:8], "little")
    b[8 + n + json.loads(b[8:8 + n])[WEIGHT]["data_offsets"][0]] ^= 1
    shard.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor '{WEIGHT}' has fingerprint .* meta.json records"):
        export_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _tokenizer_dir(d):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("abcdefghij:")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(d)
    return d


def test_the_runs_tokenizer_files_come_along(trained, tmp_path, capsys):
    tr, cfg = trained
    tok = _tokenizer_dir(tmp_path / "tok")
    path = _save(tr, cfg, tmp_path / "run", tokenizer=str(tok))
    summary = export_hf(path, tmp_path / "hf")
    assert "tokenizer.json" in summary["tokenizer"] and (tmp_path / "hf" / "tokenizer.json").is_file()
    assert f"tokenizer files from {tok}: tokenizer.json" in capsys.readouterr().err
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.encode("a:b", add_special_tokens=False) == [2, 12, 3]


def test_a_checkpoint_keeps_its_runs_tokenizer_and_exports_it_once_that_directory_is_gone(trained, tmp_path, capsys):
    import shutil

    from rlalign.export import keep_tokenizer

    tr, cfg = trained
    tok, run = _tokenizer_dir(tmp_path / "tok"), tmp_path / "run"
    keep_tokenizer(tok, run / "tokenizer")  # what `rlalign train` keeps at its start (rl.Saves.copy_tokenizer)
    ckpt.save_shards(tr.checkpoint_state(), ckpt.tmp_path(run, 0))
    meta = {"data_position": 1, "weights_fp": "-", **model_meta(model_args(cfg), cfg.model.dtype, str(tok))}
    path = ckpt.complete(run, 0, meta, keep=0, tokenizer=str(run / "tokenizer"))
    assert ckpt.verify(path, tensors=True)["step"] == 0  # the copy beside the shards leaves the checkpoint intact
    shutil.rmtree(tok)
    shutil.rmtree(run / "tokenizer")
    capsys.readouterr()
    assert "tokenizer.json" in export_hf(path, tmp_path / "hf")["tokenizer"]
    assert "tokenizer files the checkpoint keeps: tokenizer.json" in capsys.readouterr().err
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert loaded.encode("a:b", add_special_tokens=False) == [2, 12, 3]
    # twin: a checkpoint that keeps no copy, its run's tokenizer directory gone: refused naming it and the flag
    old = _save(tr, cfg, tmp_path / "old", tokenizer=str(tok))
    assert cli.main(["export", str(old), str(tmp_path / "hf2")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rlalign export: error: checkpoint {old} keeps no copy of its run's tokenizer and the run's tokenizer "
        f"directory {tok} holds no tokenizer files now (moved or deleted?); pass --tokenizer DIR, the directory of "
        f"that Hugging Face tokenizer"]
    assert not (tmp_path / "hf2").exists()
    assert cli.main(["export", str(old), str(tmp_path / "hf2"), f"--tokenizer={path / 'tokenizer'}"]) == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf2").encode("a:b", add_special_tokens=False) == [
        2, 12, 3]


def test_a_run_keeps_its_hf_tokenizer_in_the_run_dir_and_a_char_tokenizer_run_none(tmp_path):
    from rlalign.export import TOKENIZER_FILES
    from rlalign.rl import Saves

    tok, run = _tokenizer_dir(tmp_path / "tok"), tmp_path / "run"
    saves = Saves(load_config([f"task.tokenizer={tok}"]), run, -1)
    saves.copy_tokenizer()
    want = sorted(f for f in os.listdir(tok) if f in TOKENIZER_FILES)
    assert "tokenizer.json" in want and sorted(os.listdir(run / "tokenizer")) == want
    assert saves.kept == (run / "tokenizer").resolve() and saves.model["tokenizer"] == str(tok.resolve())
    saves = Saves(load_config([]), run, -1)  # twin: a later start with the char tokenizer keeps no HF copy
    saves.copy_tokenizer()
    assert saves.kept is None and not (run / "tokenizer").exists() and os.listdir(run) == []


def test_a_char_tokenizer_run_exports_that_tokenizer_which_transformers_loads_with_our_ids(trained, tmp_path, capsys):
    from rlalign.tasks.tokenizer import CharTokenizer

    tr, cfg = trained
    path = _save(tr, cfg, tmp_path / "char")
    assert export_hf(path, tmp_path / "hf")["tokenizer"] == ["tokenizer.json", "tokenizer_config.json"]
    assert "the built-in char tokenizer of the run as tokenizer.json, tokenizer_config.json" in capsys.readouterr().err
    ours, theirs = CharTokenizer(), transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "12+34= (a|b), ok?!"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    ids = [*ours.encode(text), ours.eos_token_id, 60, ours.pad_token_id]  # 60: a model id past the tokenizer's
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text
    assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)
    with pytest.raises(ValueError, match="not in the char tokenizer's alphabet"):  # twin: unknown text refused,
        ours.encode("A~")
    with pytest.raises(Exception, match="Missing \\[UNK\\] token"):  # by both, never dropped
        theirs.encode("A~", add_special_tokens=False)


def test_a_checkpoint_without_its_model_in_meta_json_takes_it_from_the_run_segments(trained, tmp_path):
    from omegaconf import OmegaConf

    from rlalign.rundir import record_segment

    tr, cfg = trained
    path = _save(tr, cfg, tmp_path, model=False)
    with pytest.raises(CheckpointError, match="meta.json names no model .* no run segments.jsonl"):
        export_hf(path, tmp_path / "hf")
    record_segment(tmp_path, 0, None, OmegaConf.to_container(cfg, resolve=True), "")
    export_hf(path, tmp_path / "hf")
    got, want = load_hf(tmp_path / "hf").state_dict(), tr.model.state_dict()
    assert all(same_bits(got[k], want[k]) for k in want)


def test_nothing_in_the_checkpoint_is_unpickled(exported, tmp_path, monkeypatch):
    path, _, _ = exported
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {shlex.quote(str(marker))}",)

    copy = tmp_path / "checkpoints" / "step_000000"
    import shutil

    shutil.copytree(path, copy)
    for name in (".metadata", "__0.metadata", "model.safetensors.index.json"):
        (copy / name).write_bytes(pickle.dumps(Payload()))

    def refuse(*a, **k):
        raise AssertionError("unpickling during export")

    for mod, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, attr, refuse)
    export_hf(copy, tmp_path / "hf")
    assert not marker.exists()


def test_rlalign_export_command(exported, tmp_path, capsys):
    path, _, _ = exported
    out = tmp_path / "hf"
    run_dir = path.parent.parent
    assert cli.main(["export", str(run_dir), str(out), "--shard-mb=1"]) == 0  # a run dir: its newest checkpoint
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["out"] == str(out) and summary["step"] == 0 and summary["shards"] == 1
    assert f"its newest intact checkpoint is {path}" in captured.err
    assert cli.main(["export", str(path), str(out)]) == 2  # twin: the target exists now
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlalign export: error: {out} exists; choose another directory or pass --overwrite to replace it"]
    assert cli.main(["export", str(path), str(out), "--overwrite"]) == 0
    capsys.readouterr()
    assert cli.main(["export", str(path)]) == 2
    assert "expected CHECKPOINT_DIR OUT_DIR, got 1 argument(s)" in capsys.readouterr().err
    assert cli.main(["export", "--help"]) == 0 and "usage: rlalign export" in capsys.readouterr().out


def test_a_runs_checkpoints_directory_exports_its_newest_intact_checkpoint(exported, tmp_path, capsys):
    path, _, _ = exported
    assert export_hf(path.parent, tmp_path / "hf")["checkpoint"] == str(path)
    assert f"{path.parent} is a run's checkpoints directory: its newest intact checkpoint is {path}" in \
        capsys.readouterr().err
    (tmp_path / "run" / "checkpoints" / "step_000000.tmp").mkdir(parents=True)  # twin: none intact there
    with pytest.raises(CheckpointError, match=r"checkpoints: a run's checkpoints directory without an intact "):
        export_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf2")


def test_a_run_directory_whose_checkpoints_are_all_damaged_is_refused_naming_the_damage(exported, tmp_path):
    import shutil

    path, _, _ = exported
    copy = tmp_path / "run" / "checkpoints" / path.name
    shutil.copytree(path, copy)
    assert export_hf(tmp_path / "run", tmp_path / "hf")["checkpoint"] == str(copy)  # twin: intact
    shard = next(p for p in copy.iterdir() if p.name.endswith(".safetensors"))
    os.truncate(shard, 100)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {copy} is not loadable: {shard.name}: 100 bytes, "
                                              r"meta.json records \d+ \(truncated or overwritten\)"):
        export_hf(tmp_path / "run", tmp_path / "hf2")


def test_checkpoint_export_hf_writes_the_export_inside_the_checkpoint_before_it_is_published(trained, tmp_path,
                                                                                            monkeypatch):
    from rlalign import export

    tr, cfg = trained
    meta = {"data_position": 1, "weights_fp": "-", **model_meta(model_args(cfg), "bfloat16", None)}
    saver = ckpt.AsyncSaver()
    saver.save(tr.checkpoint_state(), ckpt.tmp_path(tmp_path, 0), publish={
        "run_dir": str(tmp_path), "step": 0, "meta": meta, "keep": 0, "export_hf": True})
    path = saver.wait()
    got, want = load_hf(path / "hf").state_dict(), tr.model.state_dict()
    assert all(same_bits(got[k], want[k]) for k in want)
    fresh, _ = _trainer()
    ckpt.load_shards(fresh.checkpoint_state(), path)  # the hf directory inside does not disturb a resume
    assert all(same_bits(fresh.model.state_dict()[k], want[k]) for k in want)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_hf_dir", full)  # twin: a failed export costs the checkpoint nothing
    ckpt.save_shards(tr.checkpoint_state(), ckpt.tmp_path(tmp_path, 1))
    with pytest.raises(CheckpointError, match=rf"checkpoint of step 1 is complete \({tmp_path}/checkpoints/step_000001"
                                              r"\), but its Hugging Face export failed: No space left on device"):
        ckpt.complete(tmp_path, 1, meta, keep=0, export_hf=True)
    assert ckpt.verify(tmp_path / "checkpoints" / "step_000001", tensors=True)["step"] == 1
    assert sorted(os.listdir(tmp_path / "checkpoints" / "step_000001")) == [
        "meta.json", "shard-00001-model-00001-of-00001.safetensors"]


def test_a_full_disk_under_an_export_is_one_line_and_leaves_the_checkpoint_it_rides_on_published(
        trained, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    from rlalign.model import hf

    tr, cfg = trained
    path = _save(tr, cfg, tmp_path / "run")

    def full(*a, **k):  # what safetensors raises on a full disk (not an OSError)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf, "save_file", full)
    out = tmp_path / "models" / "hf"
    assert cli.main(["export", str(path), str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"rlalign export: error: [Errno 28] No space left on device: '{out}/model-00001-of-00001.safetensors'")
    assert os.listdir(out.parent) == []  # nothing half-written left behind
    meta = {"data_position": 2, "weights_fp": "-", **model_meta(model_args(cfg), "bfloat16", None)}
    ckpt.save_shards(tr.checkpoint_state(), ckpt.tmp_path(tmp_path / "run", 1))
    with pytest.raises(CheckpointError, match=r"checkpoint of step 1 is complete .*, but its Hugging Face export "
                                              r"failed: No space left on device \(ENOSPC\)"):
        ckpt.complete(tmp_path / "run", 1, meta, keep=0, export_hf=True)
    published = tmp_path / "run" / "checkpoints" / "step_000001"
    assert ckpt.verify(published, tensors=True)["step"] == 1 and not (published / "hf").exists()
    monkeypatch.undo()  # twin: with room, the same export and the same checkpoint's export are written
    assert cli.main(["export", str(path), str(out)]) == 0 and (out / "config.json").is_file()
    ckpt.save_shards(tr.checkpoint_state(), ckpt.tmp_path(tmp_path / "run", 2))
    assert (ckpt.complete(tmp_path / "run", 2, meta, keep=0, export_hf=True) / "hf" / "config.json").is_file()


def test_a_damaged_checkpoints_hint_names_the_export_argument_not_a_train_key(trained, tmp_path, capsys):
    """rlalign export of a damaged checkpoint points at the run's newest intact one as the export's own
    argument; twin: the same damage met by a train (verify's default) names checkpoint.resume."""
    from rlalign.checkpoint_files import verify

    tr, cfg = trained
    first, damaged = _save(tr, cfg, tmp_path, step=0), _save(tr, cfg, tmp_path, step=1)
    os.truncate(next(p for p in damaged.iterdir() if p.name.endswith(".safetensors")), 100)
    assert cli.main(["export", str(damaged), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"; newest intact checkpoint: {first} (rlalign export {first} OUT_DIR)")
    assert "checkpoint.resume" not in err[0]
    with pytest.raises(CheckpointError, match=rf"; newest intact checkpoint: {first} \(checkpoint.resume={first}\)$"):
        verify(damaged)
