"""Read back an offline W&B run (its run-*.wandb file): the logged history rows and the config.

The file is ':W&B' + 3 header bytes, then LevelDB-log records (crc32 4, length 2, type 1, data)
in 32 KiB blocks; each record's data is a wandb Record protobuf. The tests use it
to check that what W&B holds is what the run logged: the history and config (read_offline_run),
the run summary (read_offline_summary) and a logged table (read_offline_table).
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
        if pos + 7 + length > len(data):  # a record still being written
            break
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


def _run_records(run_path: str | Path, wait_s: float = 30.0) -> list:
    """(kind, record) of every record in an offline-run-* directory's run-*.wandb file.

    wandb.finish() can return before W&B's service process has written the file out, so this
    waits (up to wait_s) for the run's exit record; a run that never finished is read as it is."""
    import time

    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_path).glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"{run_path}: no run-*.wandb file")
    deadline = time.monotonic() + wait_s
    while True:
        out = []
        for raw in _records(files[0].read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(raw)
            out.append((rec.WhichOneof("record_type"), rec))
        if any(k == "exit" for k, _ in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def read_offline_run(run_path: str | Path) -> tuple[list[dict], dict]:
    """(history rows with '_step', config as a nested dict) of an offline-run-* directory."""
    history, config = [], {}
    for kind, rec in _run_records(run_path):
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


def read_offline_summary(run_path: str | Path) -> dict:
    """The run summary as it stands at the end of the file: key -> latest value (a nested key's
    parts joined with '/')."""
    summary = {}
    for kind, rec in _run_records(run_path):
        if kind == "summary":
            for item in rec.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            for item in rec.summary.remove:
                summary.pop(item.key or "/".join(item.nested_key), None)
    return summary


def read_offline_table(run_path: str | Path, key: str) -> tuple[list[str], list[list]]:
    """(columns, rows) of the last table logged under `key` (read from the run's files/)."""
    path = None
    for row in read_offline_run(run_path)[0]:
        if row.get(f"{key}/_type") == "table-file":
            path = row[f"{key}/path"]
    if path is None:
        raise KeyError(f"{run_path}: no table logged under {key!r}")
    t = json.loads((Path(run_path) / "files" / path).read_text())
    return t["columns"], t["data"]


def history_by_step(run_dir: str | Path) -> tuple[dict[int, dict], Path]:
    """The history of the one offline-run-* under RUN_DIR/wandb, its rows of a step merged: ({step:
    row}, the offline-run directory)."""
    (run,) = (Path(run_dir) / "wandb").glob("offline-run-*")
    by_step: dict[int, dict] = {}
    for row in read_offline_run(run)[0]:
        by_step.setdefault(row["_step"], {}).update(row)
    return by_step, run


def logged_table(run_path: str | Path, row: dict, key: str) -> tuple[list[str], list[list]]:
    """(columns, rows) of the table that history row `row` logged under `key`."""
    t = json.loads((Path(run_path) / "files" / row[f"{key}/path"]).read_text())
    return t["columns"], t["data"]
