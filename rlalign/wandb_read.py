"""Read back an offline W&B run (its run-*.wandb file): the logged history rows and the config.

The file is ':W&B' + 3 header bytes, then LevelDB-log records (crc32 4, length 2, type 1, data)
in 32 KiB blocks; each record's data is a wandb Record protobuf. Used by tests and `rlalign report`
to check that what W&B holds is what the run logged.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes):
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:
            break


def read_offline_run(run_path: str | Path) -> tuple[list[dict], dict]:
    """(history rows with '_step', config as a nested dict) of an offline-run-* directory."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_path).glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"{run_path}: no run-*.wandb file")
    history, config = [], {}
    for raw in _records(files[0].read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            history.append(row)
        elif kind in ("config", "run"):
            updates = rec.config.update if kind == "config" else rec.run.config.update
            for item in updates:
                key = item.key or "/".join(item.nested_key)
                val = json.loads(item.value_json)
                config[key] = val.get("value", val) if isinstance(val, dict) and set(val) <= {"value", "desc"} else val
    return history, config
