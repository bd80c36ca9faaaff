"""Load and save a local Hugging Face directory (config.json + safetensors) of Qwen3MoeForCausalLM.

HF stores experts one by one (`mlp.experts.{e}.gate_proj.weight`, ...) or, in transformers 5,
possibly fused (`mlp.experts.gate_up_proj`); we keep them fused. Saving writes the per-expert
layout every transformers version reads, into a temporary directory renamed into place, so a
failed save leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlalign.model.args import ModelArgs, read_args
from rlalign.model.model import DTYPES, Transformer

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    return files


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8}


def _read_tensors(path: Path, meta: bool = False) -> dict[str, tuple[torch.Tensor, Path]]:
    """Every tensor of the directory with its file; meta=True reads the headers only (shape and
    dtype on the meta device: the checks of a 30 B model's directory cost no tensor reads)."""
    out = {}
    for f in _weight_files(path):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: listed in the index but missing")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if meta:
                        sl = sf.get_slice(k)
                        dt = _SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.uint8)  # unknown: not floating
                        out[k] = (torch.empty(sl.get_shape(), dtype=dt, device="meta"), f)
                    else:
                        out[k] = (sf.get_tensor(k), f)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    return out


def check_hf_dir(path: str | os.PathLike, dtype: str | None = None) -> ModelArgs:
    """Every check of `load_hf` (config fields, tensor names, shapes, dtypes) from the headers
    alone, before any process starts. Returns the model's arguments."""
    return _state(Path(path), dtype, meta=True)[0]


def load_hf(path: str | os.PathLike, dtype: str | None = None, device=None) -> Transformer:
    """Build our Transformer from a HF Qwen3MoeForCausalLM directory; every expected tensor must be
    present with the right shape and a floating dtype (errors name the file and the tensor)."""
    args, state, dt = _state(Path(path), dtype, meta=False)
    model = Transformer(args).to(DTYPES[dt])
    model.load_state_dict(state, strict=not args.tie_word_embeddings)
    return model.to(device) if device is not None else model


EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def group_experts(items: Iterable[tuple[str, Any]]) -> tuple[dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """HF's per-expert entries grouped by layer, {'model.layers.L.mlp.experts': {e: {part: value}}},
    and every other entry by name."""
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    others = {}
    for name, value in items:
        m = _EXPERT_KEY.match(name)
        if m:
            experts.setdefault(f"model.layers.{m[1]}.mlp.experts", {}).setdefault(int(m[2]), {})[m[3]] = value
        else:
            others[name] = value
    return experts, others


def require_experts(pre: str, per_expert: dict[int, dict[str, Any]], experts: Iterable[int], where: str) -> None:
    """Every part of each of `experts` is present; else the first missing tensor is named."""
    for e in experts:
        missing = [p for p in EXPERT_PARTS if p not in per_expert.get(e, {})]
        if missing:
            raise ValueError(f"{where}: missing tensor {pre}.{e}.{missing[0]}.weight")


def fuse_experts(per_expert: dict[int, dict[str, torch.Tensor]], experts: Iterable[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused [E', 2I, d] gate_up_proj and [E', d, I] down_proj of `experts`, in that order."""
    experts = list(experts)
    gate_up = torch.stack([torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]], 0) for e in experts])
    return gate_up, torch.stack([per_expert[e]["down_proj"] for e in experts])


def _state(path: Path, dtype: str | None, meta: bool) -> tuple[ModelArgs, dict[str, torch.Tensor], str]:
    args, cfg = read_args(path)
    raw = _read_tensors(path, meta)
    files = {k: f for k, (_, f) in raw.items()}
    experts, tensors = group_experts((k, t) for k, (t, _) in raw.items())
    for pre, per_expert in experts.items():  # per-expert HF tensors -> fused [E, 2I, d] / [E, d, I]
        require_experts(pre, per_expert, range(args.num_experts), str(path))
        extra = sorted(set(per_expert) - set(range(args.num_experts)))
        if extra:
            raise ValueError(f"{path}: tensor {pre}.{extra[0]}.* names an expert beyond num_experts={args.num_experts}")
        for e in range(args.num_experts):
            for part, t in per_expert[e].items():
                _check_expert_shapes(args, pre, e, {part: tuple(t.shape)}, files[f"{pre}.{e}.{part}.weight"])
        tensors[f"{pre}.gate_up_proj"], tensors[f"{pre}.down_proj"] = fuse_experts(per_expert, range(args.num_experts))
        files[f"{pre}.gate_up_proj"] = files[f"{pre}.down_proj"] = files[f"{pre}.0.gate_proj.weight"]

    dt = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dt not in DTYPES:
        raise ValueError(f"{path}/config.json: unsupported dtype {dt!r}; expected one of {sorted(DTYPES)}")
    with torch.device("meta"):
        model = Transformer(args)
    expected = dict(model.state_dict())
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    state = {}
    for name, ref in expected.items():
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name!r} (expected shape {tuple(ref.shape)})")
        t, f = tensors.pop(name), files[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{f}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{f}: tensor {name!r} has dtype {t.dtype}, expected a floating dtype")
        state[name] = t.to(DTYPES[dt])
    if tensors:
        name = sorted(tensors)[0]
        raise ValueError(f"{files[name]}: unexpected tensor {name!r} for Qwen3MoeForCausalLM with these arguments")
    return args, state, dt


def _check_expert_shapes(args: ModelArgs, pre: str, e: int, shapes: dict, f: Path) -> None:
    d, i = args.hidden_size, args.moe_intermediate_size
    want = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
    for p, s in shapes.items():
        if s != want[p]:
            raise ValueError(f"{f}: tensor {pre}.{e}.{p}.weight has shape {s}, expected {want[p]}")


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our state dict in HF's per-expert layout (contiguous CPU tensors)."""
    args = model.args
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, 0)
                out[f"{pre}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{pre}.{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            pre = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def save_hf(model: Transformer, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors atomically (temp dir, then rename into place)."""
    dtype = {v: k for k, v in DTYPES.items()}[model.dtype]
    entries = [(k, t.numel() * t.element_size(), lambda t=t: t) for k, t in hf_state_dict(model).items()]
    write_hf_dir(path, model.args.to_hf_config(dtype), entries)


INDEX = "model.safetensors.index.json"
HFEntry = tuple[str, int, Callable[[], torch.Tensor]]  # (HF tensor name, bytes, load)


def _shards(entries: list[HFEntry], shard_bytes: int) -> list[list[HFEntry]]:
    """Consecutive groups of at most shard_bytes (a larger tensor: a group of its own)."""
    groups: list[list[HFEntry]] = []
    filled = 0
    for e in entries:
        if not groups or (filled and filled + e[1] > shard_bytes):
            groups.append([])
            filled = 0
        groups[-1].append(e)
        filled += e[1]
    return groups


def _save_file(tensors: dict[str, torch.Tensor], path: Path, shown: Path) -> None:
    """safetensors' save_file; its I/O errors (a full disk) raised as the OSError they are, naming `shown`
    (the file's path once the directory is in place)."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        n = re.search(r"os error (\d+)", str(e))
        if n is None:
            raise
        raise OSError(int(n.group(1)), os.strerror(int(n.group(1))), str(shown)) from None


def write_hf_dir(path: str | os.PathLike, config: dict, entries: list[HFEntry], shard_bytes: int | None = None,
                 files: Iterable[Path] = (), on_bytes: Callable[[int], None] | None = None) -> None:
    """A Hugging Face model directory at `path`, atomically (a temp dir renamed into place, replacing
    `path`): config.json; the entries as safetensors, read one shard at a time (`load` is called when
    its shard is written) — one model.safetensors when shard_bytes is None, else
    model-0000i-of-0000n.safetensors of at most shard_bytes each and model.safetensors.index.json;
    `files` copied in (a tokenizer's). on_bytes(n): the tensor bytes written so far. The directory and
    its files get the modes the umask gives (as `mkdir` and `cp` would), so that another user (a
    server) can read them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    file_mode = stat.S_IMODE(tmp.stat().st_mode) & 0o666
    try:
        groups = _shards(entries, shard_bytes) if shard_bytes else [entries]
        names = (["model.safetensors"] if shard_bytes is None else
                 [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
        written, weight_map = 0, {}
        for name, group in zip(names, groups):
            _save_file({k: load() for k, _, load in group}, tmp / name, path / name)
            os.chmod(tmp / name, file_mode)  # safetensors may create it owner-only
            written += sum(n for _, n, _ in group)
            weight_map.update({k: name for k, _, _ in group})
            if on_bytes is not None:
                on_bytes(written)
        if shard_bytes is not None:
            index = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in files:
            shutil.copyfile(f, tmp / Path(f).name)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        elif old is not None:  # a file or a link that was there: the link goes, not what it points to
            old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
