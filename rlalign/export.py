"""`rlalign export CHECKPOINT_DIR OUT_DIR`: the model of a checkpoint as a Hugging Face directory that
transformers (`AutoModelForCausalLM.from_pretrained`), vLLM and rlalign (`model.path=OUT_DIR`) load.

    OUT_DIR/config.json                          Qwen3MoeForCausalLM, the run's model arguments and dtype
    OUT_DIR/model-0000i-of-0000n.safetensors     the weights the run sampled with (the model dtype, as
    OUT_DIR/model.safetensors.index.json           trained: not the fp32 masters), experts one by one
    OUT_DIR/tokenizer.json, ...                  the run's Hugging Face tokenizer files, from the copy the
                                                   checkpoint keeps (step_N/tokenizer; the built-in char
                                                   tokenizer as tokenizer.json + tokenizer_config.json)

The checkpoint's files are checked first (verify: meta.json, every shard's header) and every tensor
read is checked against its fingerprint in meta.json; nothing is unpickled (JSON and safetensors
only). The model's arguments come from meta.json (recorded at each save) or, for a checkpoint
written before that, from the config of the run segment that wrote it (RUN_DIR/segments.jsonl).
Every tensor of the model must be in the checkpoint with its shape and dtype, and every model
tensor of the checkpoint must belong to the model: a checkpoint of another model shape is refused
naming the tensor. The directory is written beside OUT_DIR and renamed into place
(rlalign.model.hf.write_hf_dir, the writer of every HF directory rlalign makes), one shard in
memory at a time; an OUT_DIR that exists is refused unless overwrite, and one that holds the
checkpoint or a run (its checkpoints/ directory) always.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from rlalign.checkpoint_files import (
    META,
    ST_DTYPE,
    CheckpointError,
    Damage,
    Progress,
    checkpoint_dir,
    damaged,
    list_complete,
    newest_intact,
    run_dir_of,
    verify,
)
from rlalign.fingerprint import fingerprint
from rlalign.model.args import ModelArgs
from rlalign.model.hf import HFEntry, write_hf_dir
from rlalign.model.model import DTYPES, Transformer
from rlalign.tasks.tokenizer import CharTokenizer

DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's customary max_shard_size
HF_DIR = "hf"  # checkpoint.export_hf=true: RUN_DIR/checkpoints/step_N/hf
TOKENIZER_DIR = "tokenizer"  # the run's Hugging Face tokenizer files: RUN_DIR/tokenizer, step_N/tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
EXPORT = "rlalign export {} OUT_DIR"  # how an export user names another checkpoint (damaged()'s hint)
PREFIX = "model/"  # the checkpoint's compute-dtype weights (rlalign.training.state.checkpoint_state)


def model_meta(args: ModelArgs, dtype: str, tokenizer: str | None) -> dict:
    """What a checkpoint's meta.json records of its model, so that it exports on its own."""
    return {"model": args.to_hf_config(dtype), "tokenizer": str(Path(tokenizer).resolve()) if tokenizer else None}


def _from_segments(path: Path, step: int) -> tuple[ModelArgs, str, str | None]:
    """The model of the run segment that wrote step `step` (a checkpoint without meta.json's 'model')."""
    from omegaconf import OmegaConf

    from rlalign.config import model_args
    from rlalign.rundir import read_segments
    from rlalign.tasks.tokenizer import tokenizer_dir

    run_dir = run_dir_of(path)
    segs = [s for s in read_segments(run_dir) if s["start_step"] <= step] if run_dir is not None else []
    if not segs:
        raise CheckpointError(f"checkpoint {path}: meta.json names no model (written before checkpoints recorded "
                              f"it) and no run segments.jsonl says which model wrote step {step}")
    cfg = OmegaConf.create(segs[-1]["config"])
    return model_args(cfg), cfg.model.dtype, tokenizer_dir(cfg.task.tokenizer, cfg.model.path)


def model_of(path: Path, meta: dict) -> tuple[ModelArgs, str, str | None]:
    """(model arguments, dtype, tokenizer directory or None) of a checkpoint."""
    if isinstance(meta.get("model"), dict):
        hf = meta["model"]
        if hf.get("dtype") not in DTYPES:
            raise damaged(path, Damage(META, f"model dtype {hf.get('dtype')!r}, expected one of {sorted(DTYPES)}"),
                          use=EXPORT)
        tokenizer = meta.get("tokenizer")
        if tokenizer is not None and not isinstance(tokenizer, str):
            raise damaged(path, Damage(META, f"tokenizer {tokenizer!r}, expected the run's tokenizer directory (a "
                                             "string) or null"), use=EXPORT)
        args = ModelArgs.from_hf_config(hf, where=f"{path / META} (model)")
        _check_layers(path, meta, args)
        return args, hf["dtype"], tokenizer
    args, dtype, tokenizer = _from_segments(path, meta["step"])
    _check_layers(path, meta, args)
    return args, dtype, tokenizer


def _check_layers(path: Path, meta: dict, args: ModelArgs) -> None:
    """The checkpoint's tensors hold the layers its model names (checked before the model's tensor names are
    made, one module per layer: a num_hidden_layers in the millions would take that long)."""
    held = {int(m[1]) for k in meta["tensors"] if (m := re.search(r"\.layers\.(\d+)\.", k))}
    n = max(held) + 1 if held else 0
    if n != args.num_layers:
        raise CheckpointError(f"checkpoint {path}: its tensors hold {n} layers, the model of its config "
                              f"({_shape_text(args)}) has {args.num_layers} (another model?)")


class _Reader:
    """Tensors of a checkpoint by key, each checked against meta.json's fingerprint when read; the
    last one kept (an expert's gate and up halves are two HF tensors of one checkpoint tensor)."""

    def __init__(self, path: Path, meta: dict, files: ExitStack):
        self.path, self.index, self.files = path, meta["tensors"], files
        self.open: dict[str, object] = {}
        self.last: tuple[str | None, torch.Tensor | None] = (None, None)

    def get(self, key: str) -> torch.Tensor:
        if self.last[0] == key:
            return self.last[1]
        e = self.index[key]
        if e["file"] not in self.open:
            self.open[e["file"]] = self.files.enter_context(safe_open(str(self.path / e["file"]), framework="pt"))
        t = self.open[e["file"]].get_tensor(key)
        got = fingerprint(t)
        if got != e["fp"]:
            raise damaged(self.path, Damage(e["file"], f"tensor {key!r} has fingerprint {got}, meta.json records "
                                                         f"{e['fp']} (its bytes changed)"), use=EXPORT)
        self.last = (key, t)
        return t


def _expect(path: Path, meta: dict, key: str, shape: list[int], dtype: str, args: ModelArgs) -> int:
    """The bytes of checkpoint tensor `key` after checking that it is there with this shape and dtype."""
    e = meta["tensors"].get(key)
    if e is None:
        raise CheckpointError(f"checkpoint {path}: no tensor {key!r}, which the model of its config "
                              f"({_shape_text(args)}) has (another model?)")
    if list(e["shape"]) != shape or e["dtype"] != dtype:
        raise CheckpointError(f"checkpoint {path}: tensor {key!r} is {e['dtype']}{list(e['shape'])} in {e['file']}, "
                              f"the model of its config ({_shape_text(args)}) needs {dtype}{shape} (a checkpoint "
                              f"of another model shape?)")
    return torch.Size(shape).numel() * torch.empty(0, dtype=_TORCH[dtype]).element_size()


_TORCH = {v: k for k, v in ST_DTYPE.items()}


def _shape_text(a: ModelArgs) -> str:
    return (f"hidden_size={a.hidden_size}, num_layers={a.num_layers}, num_experts={a.num_experts}, "
            f"moe_intermediate_size={a.moe_intermediate_size}, vocab_size={a.vocab_size}")


def plan(path: Path, meta: dict, args: ModelArgs, dtype: str, reader: _Reader) -> list[HFEntry]:
    """The HF tensors of the checkpoint's model, in the model's order (experts one by one: HF's
    layout), each loaded from the checkpoint when its shard is written; CheckpointError naming the
    first tensor that is missing, of another shape or dtype, or not part of the model."""
    with torch.device("meta"):
        names = dict(Transformer(args).state_dict())
    if args.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    st = ST_DTYPE[DTYPES[dtype]]
    left = {k for k in meta["tensors"] if k.startswith(PREFIX)}
    out: list[HFEntry] = []
    for name, ref in names.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            key = PREFIX + name
            n = _expect(path, meta, key, list(ref.shape), st, args)
            out.append((name, n, lambda key=key: reader.get(key)))
            left.discard(key)
            continue
        pre, part = name.rsplit(".", 1)
        for e in range(ref.shape[0]):
            key = f"{PREFIX}{name}/expert{e}"
            n = _expect(path, meta, key, list(ref.shape[1:]), st, args)
            left.discard(key)
            if part == "down_proj":
                out.append((f"{pre}.{e}.down_proj.weight", n, lambda key=key: reader.get(key)))
                continue
            half = ref.shape[1] // 2  # gate rows, then up rows (rlalign.model.hf.hf_state_dict)
            out.append((f"{pre}.{e}.gate_proj.weight", n // 2, lambda key=key, h=half: reader.get(key)[:h]))
            out.append((f"{pre}.{e}.up_proj.weight", n // 2, lambda key=key, h=half: reader.get(key)[h:]))
    if left:
        key = sorted(left)[0]
        raise CheckpointError(f"checkpoint {path}: tensor {key!r} ({meta['tensors'][key]['dtype']}"
                              f"{meta['tensors'][key]['shape']}) is not part of the model of its config "
                              f"({_shape_text(args)}; a checkpoint of another model shape?)")
    return out


def _files(d: Path) -> list[Path]:
    return [d / f for f in TOKENIZER_FILES if (d / f).is_file()]


def tokenizer_nbytes(src: str | Path | None) -> int:
    """The bytes of the tokenizer files keep_tokenizer() copies from directory `src` (0 for None: the built-in
    char tokenizer, of which a checkpoint keeps nothing)."""
    return 0 if src is None else sum(f.stat().st_size for f in _files(Path(src)))


def keep_tokenizer(src: str | Path | None, dst: Path) -> None:
    """`dst` holds a copy of the Hugging Face tokenizer files of directory `src` (TOKENIZER_FILES), in place of
    what it held, or for `src` None (the built-in char tokenizer, which an export writes out) nothing: it is
    removed. A `src` without tokenizer files raises FileNotFoundError naming it."""
    if src is not None and Path(src).resolve() == dst.resolve():  # a run whose tokenizer is its own copy
        return
    files = [] if src is None else _files(Path(src))
    if src is not None and not files:
        raise FileNotFoundError(f"the tokenizer directory {src} holds none of {', '.join(TOKENIZER_FILES)}")
    part = dst.with_name(dst.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    if files:
        part.mkdir(parents=True)
        for f in files:
            shutil.copyfile(f, part / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    if files:
        os.replace(part, dst)


def tokenizer_files(checkpoint: Path, tokenizer: str | None, scratch: ExitStack,
                    given: str | None = None) -> tuple[list[Path], str]:
    """The tokenizer files to copy and a note on what was found: `given`'s (--tokenizer DIR), else the copy the
    checkpoint keeps (step_N/tokenizer), else those of the run's tokenizer directory `tokenizer`; the
    built-in char tokenizer's (`tokenizer` None) written as Hugging Face files into a directory that
    `scratch` removes. A directory without tokenizer files is an error naming it and --tokenizer."""
    if given is not None:
        files = _files(Path(given))
        if not files:
            raise FileNotFoundError(f"--tokenizer {given}: holds none of {', '.join(TOKENIZER_FILES)}")
        return files, f"tokenizer files from {given} (--tokenizer): {', '.join(f.name for f in files)}"
    kept = _files(checkpoint / TOKENIZER_DIR)
    if kept:
        return kept, f"tokenizer files the checkpoint keeps: {', '.join(f.name for f in kept)}"
    if not tokenizer:
        files = CharTokenizer().save_hf(Path(scratch.enter_context(tempfile.TemporaryDirectory())))
        return files, f"the built-in char tokenizer of the run as {', '.join(f.name for f in files)}"
    files = _files(Path(tokenizer))
    if not files:
        raise FileNotFoundError(f"checkpoint {checkpoint} keeps no copy of its run's tokenizer and the run's tokenizer "
                                f"directory {tokenizer} holds no tokenizer files now (moved or deleted?); pass "
                                f"--tokenizer DIR, the directory of that Hugging Face tokenizer")
    return files, f"tokenizer files from {tokenizer}: {', '.join(f.name for f in files)}"


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory as given, or the newest intact checkpoint of a run directory or of its
    checkpoints directory."""
    if (path / META).is_file():
        return path
    run = path if checkpoint_dir(path).is_dir() else path.parent if path.name == checkpoint_dir(path).name else None
    if run is None or not checkpoint_dir(run).is_dir():
        return path
    newest = newest_intact(run)
    kind = "a run directory" if run == path else "a run's checkpoints directory"
    if newest is None:
        done = list_complete(run)
        if done:  # say what is wrong with the newest: verify raises naming its file
            verify(done[-1], use=EXPORT)
        raise CheckpointError(f"{path}: {kind} without an intact checkpoint")
    print(f"rlalign export: {path} is {kind}: its newest intact checkpoint is {newest}", file=sys.stderr)
    return newest


def export_hf(checkpoint: str | Path, out: str | Path, overwrite: bool = False,
              shard_bytes: int = DEFAULT_SHARD_BYTES, what: str = "rlalign export", note: bool = True,
              tokenizer: str | None = None) -> dict:
    """Write the checkpoint's model to `out` as a Hugging Face directory (module docstring); a summary.
    `note`: say on stderr which tokenizer files come along (a run's exports at each checkpoint do not);
    `tokenizer`: a directory whose tokenizer files come along instead of the run's (--tokenizer)."""
    checkpoint, out = resolve_checkpoint(Path(checkpoint)), Path(out)
    if checkpoint.resolve().is_relative_to(out.resolve()):  # --overwrite would delete what it exports
        what = "is the checkpoint itself" if out.resolve() == checkpoint.resolve() else "holds the checkpoint"
        raise ValueError(f"{out} {what}; write the export elsewhere (e.g. {checkpoint / HF_DIR})")
    if checkpoint_dir(out).is_dir():
        raise ValueError(f"{out} is a run directory ({checkpoint_dir(out)} is there), which an export would replace; "
                         f"write it elsewhere")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose another directory or pass --overwrite to replace it")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise NotADirectoryError(f"OUT_DIR {out}: {above} is a file, so no directory can be made below it; choose "
                                 "another OUT_DIR")
    meta = verify(checkpoint, use=EXPORT)
    args, dtype, runs = model_of(checkpoint, meta)
    with ExitStack() as stack:
        files, found = tokenizer_files(checkpoint, runs, stack, tokenizer)
        if note:
            print(f"{what}: {found}", file=sys.stderr, flush=True)
        entries = plan(checkpoint, meta, args, dtype, _Reader(checkpoint, meta, stack))
        total = sum(n for _, n, _ in entries)
        progress = Progress(f"{what}: {out}", total)
        write_hf_dir(out, args.to_hf_config(dtype), entries, shard_bytes, files, on_bytes=progress.update)
        progress.done(result="written")
    shards = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    return {"checkpoint": str(checkpoint), "out": str(out), "step": meta["step"], "dtype": dtype,
            "tensors": len(entries), "bytes": total, "shards": len(set(shards.values())),
            "tokenizer": [f.name for f in files], "weights_fp": meta.get("weights_fp")}


USAGE = """usage: rlalign export CHECKPOINT_DIR OUT_DIR [--overwrite] [--shard-mb N] [--tokenizer DIR]

The model of a checkpoint (RUN_DIR/checkpoints/step_N; RUN_DIR or RUN_DIR/checkpoints: its newest intact one)
as a Hugging Face directory: config.json, safetensors shards with model.safetensors.index.json, and
the run's tokenizer files (the copy of its Hugging Face tokenizer the checkpoint keeps, or the built-in
char tokenizer's written out). transformers' from_pretrained, vLLM and rlalign's model.path=OUT_DIR load
it. The weights are the model dtype the run sampled with.
  --overwrite      replace OUT_DIR if it exists (else refused); never a run directory or one holding
                   the checkpoint
  --shard-mb N     shards of at most N MB (default 5000)
  --tokenizer DIR  the tokenizer files of DIR instead of the run's (a checkpoint that keeps no copy,
                   whose run's tokenizer directory has moved)
exit status: 0 written (the last stdout line is a JSON summary), 2 error"""


def _value(argv: list[str], i: int, a: str) -> tuple[str, int]:
    """The value of option `a` (`--opt=V`, or `--opt V` at argv[i]) and the index after it."""
    if "=" in a:
        return a.split("=", 1)[1], i
    return (argv[i], i + 1) if i < len(argv) else ("", i)


def parse(argv: list[str]) -> tuple[list[str], bool, int, str | None] | None:
    """(positional, overwrite, shard bytes, tokenizer directory) or None for --help; ValueError on bad
    arguments."""
    pos, overwrite, shard_bytes, tokenizer, i = [], False, DEFAULT_SHARD_BYTES, None, 0
    while i < len(argv):
        a, i = argv[i], i + 1
        if a in ("-h", "--help"):
            return None
        if a == "--overwrite":
            overwrite = True
        elif a == "--shard-mb" or a.startswith("--shard-mb="):
            v, i = _value(argv, i, a)
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"--shard-mb {v!r}: expected a whole number of MB >= 1")
            shard_bytes = int(v) * 10**6
        elif a == "--tokenizer" or a.startswith("--tokenizer="):
            tokenizer, i = _value(argv, i, a)
            if not tokenizer:
                raise ValueError("--tokenizer: expected a directory")
        elif a.startswith("-"):
            raise ValueError(f"unknown option {a!r} (rlalign export --help)")
        else:
            pos.append(a)
    if len(pos) != 2:
        raise ValueError(f"expected CHECKPOINT_DIR OUT_DIR, got {len(pos)} argument(s) (rlalign export --help)")
    return pos, overwrite, shard_bytes, tokenizer


def main(argv: list[str]) -> int:
    from rlalign.logger import json_line

    parsed = parse(argv)
    if parsed is None:
        print(USAGE)
        return 0
    (src, out), overwrite, shard_bytes, tokenizer = parsed
    print(json_line(export_hf(src, out, overwrite, shard_bytes, tokenizer=tokenizer)), flush=True)
    return 0
