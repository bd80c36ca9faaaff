"""`rlalign export CHECKPOINT_DIR OUT_DIR`: the model of a checkpoint as a Hugging Face directory that
transformers (`AutoModelForCausalLM.from_pretrained`), vLLM and rlalign (`model.path=OUT_DIR`) load.

    OUT_DIR/config.json                          Qwen3MoeForCausalLM, the run's model arguments and dtype
    OUT_DIR/model-0000i-of-0000n.safetensors     the weights the run sampled with (the model dtype, as
    OUT_DIR/model.safetensors.index.json           trained: not the fp32 masters), experts one by one
    OUT_DIR/tokenizer.json, ...                  the run's Hugging Face tokenizer files (the built-in char
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
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
            raise damaged(path, Damage(META, f"model dtype {hf.get('dtype')!r}, expected one of {sorted(DTYPES)}"))
        return ModelArgs.from_hf_config(hf, where=f"{path / META} (model)"), hf["dtype"], meta.get("tokenizer")
    return _from_segments(path, meta["step"])


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
                                                         f"{e['fp']} (its bytes changed)"))
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


def tokenizer_files(tokenizer: str | None, scratch: ExitStack) -> tuple[list[Path], str]:
    """The tokenizer files to copy and a note on what was found; the built-in char tokenizer's written as
    Hugging Face files into a directory that `scratch` removes."""
    if not tokenizer:
        files = CharTokenizer().save_hf(Path(scratch.enter_context(tempfile.TemporaryDirectory())))
        return files, f"the built-in char tokenizer of the run as {', '.join(f.name for f in files)}"
    d = Path(tokenizer)
    files = [d / f for f in TOKENIZER_FILES if (d / f).is_file()]
    if not files:
        return [], f"no tokenizer files: the run's tokenizer directory {d} holds none (now)"
    return files, f"tokenizer files from {d}: {', '.join(f.name for f in files)}"


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
            verify(done[-1])
        raise CheckpointError(f"{path}: {kind} without an intact checkpoint")
    print(f"rlalign export: {path} is {kind}: its newest intact checkpoint is {newest}", file=sys.stderr)
    return newest


def export_hf(checkpoint: str | Path, out: str | Path, overwrite: bool = False,
              shard_bytes: int = DEFAULT_SHARD_BYTES, what: str = "rlalign export", note: bool = True) -> dict:
    """Write the checkpoint's model to `out` as a Hugging Face directory (module docstring); a summary.
    `note`: say on stderr which tokenizer files come along (a run's exports at each checkpoint do not)."""
    checkpoint, out = resolve_checkpoint(Path(checkpoint)), Path(out)
    if checkpoint.resolve().is_relative_to(out.resolve()):  # --overwrite would delete what it exports
        what = "is the checkpoint itself" if out.resolve() == checkpoint.resolve() else "holds the checkpoint"
        raise ValueError(f"{out} {what}; write the export elsewhere (e.g. {checkpoint / HF_DIR})")
    if checkpoint_dir(out).is_dir():
        raise ValueError(f"{out} is a run directory ({checkpoint_dir(out)} is there), which an export would replace; "
                         f"write it elsewhere")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose another directory or pass --overwrite to replace it")
    meta = verify(checkpoint)
    args, dtype, tokenizer = model_of(checkpoint, meta)
    with ExitStack() as stack:
        files, found = tokenizer_files(tokenizer, stack)
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


USAGE = """usage: rlalign export CHECKPOINT_DIR OUT_DIR [--overwrite] [--shard-mb N]

The model of a checkpoint (RUN_DIR/checkpoints/step_N; RUN_DIR or RUN_DIR/checkpoints: its newest intact one)
as a Hugging Face directory: config.json, safetensors shards with model.safetensors.index.json, and
the run's tokenizer files (its Hugging Face tokenizer's, or the built-in char tokenizer's written out).
transformers' from_pretrained, vLLM and rlalign's model.path=OUT_DIR load it. The weights are the model
dtype the run sampled with.
  --overwrite    replace OUT_DIR if it exists (else refused); never a run directory or one holding
                 the checkpoint
  --shard-mb N   shards of at most N MB (default 5000)
exit status: 0 written (the last stdout line is a JSON summary), 2 error"""


def parse(argv: list[str]) -> tuple[list[str], bool, int] | None:
    """(positional, overwrite, shard bytes) or None for --help; ValueError on bad arguments."""
    pos, overwrite, shard_bytes, i = [], False, DEFAULT_SHARD_BYTES, 0
    while i < len(argv):
        a, i = argv[i], i + 1
        if a in ("-h", "--help"):
            return None
        if a == "--overwrite":
            overwrite = True
        elif a == "--shard-mb" or a.startswith("--shard-mb="):
            v = a.split("=", 1)[1] if "=" in a else (argv[i] if i < len(argv) else "")
            i += "=" not in a
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"--shard-mb {v!r}: expected a whole number of MB >= 1")
            shard_bytes = int(v) * 10**6
        elif a.startswith("-"):
            raise ValueError(f"unknown option {a!r} (rlalign export --help)")
        else:
            pos.append(a)
    if len(pos) != 2:
        raise ValueError(f"expected CHECKPOINT_DIR OUT_DIR, got {len(pos)} argument(s) (rlalign export --help)")
    return pos, overwrite, shard_bytes


def main(argv: list[str]) -> int:
    from rlalign.logger import json_line

    parsed = parse(argv)
    if parsed is None:
        print(USAGE)
        return 0
    (src, out), overwrite, shard_bytes = parsed
    print(json_line(export_hf(src, out, overwrite, shard_bytes)), flush=True)
    return 0
