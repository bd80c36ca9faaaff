"""A checkpoint's write against the disk, an async save's stall on training, and a SIGTERM at the default
grace, measured in one call.

    python experiments/bench_checkpoint_speed.py --model bench-moe --bytes 4e9 --reps 5     # CPU
    python3 experiments/bench_checkpoint_speed.py --model qwen3-30b-a3b-rehearsal --device cuda ...
                                                 # one H200: the full command in experiments/README.md

Write. A state of the model config's checkpoint tensors (the keys, shapes and dtypes of
Trainer.checkpoint_state() built on the meta device: bf16 weights, fp32 masters, AdamW moments and
steps; random values, on --device; --bytes cycles or cuts those tensors to that size) is saved --reps
times by rlalign.checkpoint.AsyncSaver with checkpoint.staging=host, each save beside
`dd if=/dev/zero bs=64M count=N conv=fdatasync` of the same size into the same directory, in turn.
write_gbps: the files' bytes over the background write (save() returned -> wait() returned: the files,
one fsync each, and the fingerprints of CPU tensors beside them); dd_gbps: dd's bytes over its time;
write_over_dd: the median of each rep's ratio (the two back to back; goal >= 0.8). staging_s: the copy
into the host buffers; async_stall_s: what training waits, save()'s return (device fingerprints and the
copy) plus the next update's wait for the write (AsyncSaver.wait_tensors right after). Medians over the
reps; a first save, not timed, allocates the host buffers (first_save_return_s). A synchronous streamed save
(save_shards: the tensors written where they lie, no copy) is timed per rep too.

SIGTERM (--train-model; default tiny-moe on CPU, --model on CUDA): `rlalign train` with checkpoint.every=1
and run.stop_grace_s at its default gets SIGTERM once step --term-after's metrics line is written.
sigterm_default_grace_checkpoint_complete: it exits 143 and the newest complete checkpoint passes
verify(tensors=True) and is at most checkpoint.every steps behind the last step logged. resume_bitwise:
resumed (checkpoint.resume=auto) to run.steps, its metrics.jsonl without time/ keys equals an
uninterrupted run's, and `rlalign compare` finds every trace identical.
Writes results/checkpoint_speed_<machine>.json (record.py's environment record).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # experiments/: record.py

import record  # noqa: E402
import torch  # noqa: E402

from rlalign.gates import MEASURED  # noqa: E402

DD_BLOCK = 64 << 20


def synthetic_state(model: str, nbytes: int | None, device: str) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors (meta-device trainer: keys, shapes, dtypes) with random values on
    `device`; nbytes: the tensors cycled (keys suffixed '#2', '#3', ...) or cut until that size."""
    from omegaconf import OmegaConf

    from rlalign.config import load_config
    from rlalign.training.trainer import Trainer

    cfg = load_config([f"model={model}"])
    shapes = [(k, t.shape, t.dtype) for k, t in Trainer(OmegaConf.merge(cfg, {"device": "meta"})).checkpoint_state()
              .items()]
    g = torch.Generator(device=device).manual_seed(0)
    out, total, lap = {}, 0, 1
    while True:
        added = False
        for k, shape, dtype in shapes:
            n = shape.numel() * dtype.itemsize
            if nbytes is not None and total + n > nbytes:
                continue
            t = torch.empty(shape, dtype=torch.float32 if dtype.is_floating_point else dtype, device=device)
            if dtype.is_floating_point:
                t.normal_(generator=g)
            else:
                t.fill_(lap)
            out[k if lap == 1 else f"{k}#{lap}"] = t.to(dtype)
            total, added = total + n, True
        lap += 1
        if nbytes is None or not added:
            return out


def dd_rate(directory: Path, nbytes: int) -> tuple[float, int]:
    """(bytes/s, bytes) of dd writing zeros in 64 MiB blocks with conv=fdatasync into `directory`."""
    count = max(1, round(nbytes / DD_BLOCK))
    target = directory / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", f"bs={DD_BLOCK}", f"count={count}", "conv=fdatasync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    target.unlink()
    return count * DD_BLOCK / seconds, count * DD_BLOCK


def _files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".safetensors"))


def _sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_rep(state: dict, d: Path, saver, device: str, bucket: int, streamed: bool) -> dict:
    """dd, the staged async save and (streamed) a synchronous streamed save, in turn, into `d` (emptied
    after each)."""
    from rlalign import checkpoint as ckpt

    os.sync()
    dd, dd_bytes = dd_rate(d, sum(t.numel() * t.element_size() for t in state.values()))
    tmp = ckpt.tmp_path(d, 0)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    os.sync()
    _sync_device(device)
    t0 = time.perf_counter()
    saver.save(state, tmp, bucket_bytes=bucket)
    t1 = time.perf_counter()
    next_wait = saver.wait_tensors()
    saver.wait()
    t2 = time.perf_counter()
    written = _files_bytes(tmp)
    shutil.rmtree(tmp)
    os.sync()
    row = {}
    if streamed:
        t3 = time.perf_counter()
        ckpt.save_shards(state, tmp, bucket_bytes=bucket)
        row["streamed_sync_save_s"] = time.perf_counter() - t3
        row["streamed_sync_gbps"] = _files_bytes(tmp) / row["streamed_sync_save_s"] / 1e9
        shutil.rmtree(tmp)
    row["load_avg_1m"] = os.getloadavg()[0]  # the machine's other work (a shared host)
    return {**row, "dd_gbps": dd / 1e9, "dd_bytes": dd_bytes, "written_bytes": written, "save_return_s": t1 - t0,
            "staging_s": saver.staging_s, "next_update_wait_s": next_wait, "write_s": t2 - t1,
            "write_gbps": written / (t2 - t1) / 1e9, "stall_s": (t1 - t0) + next_wait}


def measure_writes(a, state: dict, say) -> tuple[list[dict], dict]:
    """A first save (its staging allocates the buffers), then --reps of one_rep."""
    from rlalign import checkpoint as ckpt

    d = Path(a.dir) / "write"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    lines = []
    saver = ckpt.AsyncSaver(staging="host", writers=a.writers, say=lines.append)
    tmp = ckpt.tmp_path(d, 0)
    saver.save(state, tmp, bucket_bytes=a.bucket_mb << 20)  # the first save allocates the host buffers
    first = {"first_save_return_s": round(saver.staging_s, 4)}
    saver.wait()
    shutil.rmtree(tmp)
    say(f"first save (the host buffers allocated): staging {first['first_save_return_s']:.2f} s")
    rows = []
    for rep in range(a.reps):
        r = one_rep(state, d, saver, a.device, a.bucket_mb << 20, not a.no_streamed)
        rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
        say(f"rep {rep}: write {r['write_gbps']:.3f} GB/s, dd {r['dd_gbps']:.3f} GB/s, staging {r['staging_s']:.2f} s, "
            f"stall {r['stall_s']:.2f} s, streamed sync {r.get('streamed_sync_gbps', 0):.3f} GB/s")
    shutil.rmtree(d, ignore_errors=True)
    return rows, {"staging_line": lines[0] if lines else "", **first}


def _cli(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rlalign.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def _rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    lines = p.read_text().splitlines() if p.is_file() else []
    return [json.loads(x) for x in lines if x.strip()]


def _strip(rows: list[dict]) -> list[dict]:
    """What the gates compare: every metric but time/* and memory/* (rlalign.gates.MEASURED)."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]


def _differences(a: list[dict], b: list[dict]) -> list[list]:
    """[step, key, a, b] of the metrics that differ (time/* left out), the first 12."""
    out = [[ra.get("step"), k, ra.get(k), rb.get(k)] for ra, rb in zip(a, b) for k in sorted(set(ra) | set(rb))
           if not k.startswith("time/") and ra.get(k) != rb.get(k)]
    return out[:12]


def sigterm_and_resume(a, say) -> dict:
    """The interrupted run (SIGTERM after step --term-after is logged), its resume, an uninterrupted twin."""
    from rlalign import checkpoint as ckpt

    model = a.train_model or (a.model if a.device.startswith("cuda") else "tiny-moe")
    base = [f"model={model}", f"device={a.device}", f"run.steps={a.train_steps}", "checkpoint.every=1",
            "checkpoint.keep=1", *a.train_overrides]
    root = Path(a.dir) / "train"
    shutil.rmtree(root, ignore_errors=True)
    part, full = root / "interrupted", root / "uninterrupted"
    p = _cli(["train", *base, f"run.dir={part}"])
    while p.poll() is None and len(_rows(part)) <= a.term_after:
        time.sleep(0.2)
    sent = p.poll() is None
    if sent:
        p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=3600)
    done = max((r["step"] for r in _rows(part)), default=-1)
    newest = ckpt.newest_intact(part, tensors=True)
    step = ckpt.step_of(newest) if newest is not None else None
    complete = bool(sent and p.returncode == 128 + signal.SIGTERM and step is not None and done - step <= 1)
    say(f"SIGTERM after step {a.term_after}: exit {p.returncode}, last step logged {done}, newest complete "
        f"checkpoint {newest}")
    attempts = []
    for wait_s in (0, 30):  # a failed resume is recorded and tried once more after a pause (the stderr says why)
        time.sleep(wait_s)
        r = _cli(["train", *base, f"run.dir={part}", "checkpoint.resume=auto"])
        r_out, r_err = r.communicate(timeout=3600)
        attempts.append({"after_s": wait_s, "exit_code": r.returncode, "stderr_tail": r_err.strip().splitlines()[-6:]})
        if r.returncode == 0:
            break
    shutil.rmtree(part / "checkpoints", ignore_errors=True)  # the disk holds one run's checkpoints at a time
    f = _cli(["train", *base, f"run.dir={full}"])
    f_out, f_err = f.communicate(timeout=3600)
    c = subprocess.run([sys.executable, "-m", "rlalign.cli", "compare", str(full), str(part)], capture_output=True,
                       text=True, timeout=600)
    same_metrics = _strip(_rows(full)) == _strip(_rows(part)) and len(_rows(full)) == a.train_steps
    bitwise = r.returncode == 0 and f.returncode == 0 and c.returncode == 0 and same_metrics
    say(f"resume: exit {r.returncode}, uninterrupted exit {f.returncode}, compare exit {c.returncode}, "
        f"metrics equal {same_metrics}")
    tail = lambda s: s.strip().splitlines()[-3:]  # noqa: E731
    stalls = [x.get("time/checkpoint_stall_s") for x in _rows(full)]
    staging = [x.get("time/checkpoint_staging_s") for x in _rows(full)]
    return {"train_model": model, "overrides": base, "term_after_step": a.term_after, "signal_sent": sent,
            "exit_code": p.returncode, "last_step_logged": done, "newest_complete_step": step,
            "stderr_tail": tail(err), "resume_exit_code": r.returncode, "resume_attempts": attempts,
            "uninterrupted_exit_code": f.returncode, "uninterrupted_stderr_tail": tail(f_err),
            "compare_exit_code": c.returncode, "compare_out": tail(c.stdout), "metrics_equal": same_metrics,
            "metrics_differing": _differences(_rows(full), _rows(part)),
            "uninterrupted_time_checkpoint_stall_s": stalls, "uninterrupted_time_checkpoint_staging_s": staging,
            "sigterm_default_grace_checkpoint_complete": complete, "resume_bitwise": bitwise}


def merge_parts(write_json: str, train_json: str, name: str, out: str | None) -> None:
    """The summary of a --part write result and of a --part train result, one file: the write part's keys,
    then the train part's SIGTERM and resume keys; each part's whole record (command, date, commit) under
    `parts`."""
    w, t = (json.loads(Path(p).read_text()) for p in (write_json, train_json))
    if w["args"]["part"] != "write" or t["args"]["part"] != "train":
        raise SystemExit(f"--merge takes a --part write result then a --part train result "
                         f"(got {w['args']['part']}, {t['args']['part']})")
    summary = {**w["summary"], **{k: t["summary"][k] for k in
                                  ("sigterm_default_grace_checkpoint_complete", "resume_bitwise")}}
    if w["summary"].get("gpu") != t["summary"].get("gpu"):  # the parts ran on different cards: name both
        summary["gpu"] = f"{w['summary'].get('gpu')} (write), {t['summary'].get('gpu')} (train)"
    what = f"{w['what_it_shows']}; {t['what_it_shows'].lstrip('; ')} (two calls: --part write, --part train)"
    print(json.dumps(summary))
    both = lambda k: w[k] if w.get(k) == t.get(k) else f"{w.get(k)} (write), {t.get(k)} (train)"  # noqa: E731
    ran = {"date": max(w["date"], t["date"]), "machine": {**w["machine"], "gpu": summary.get("gpu")},
           "versions": w["versions"] if w["versions"] == t["versions"] else {"write": w["versions"],
                                                                               "train": t["versions"]}}
    ran.update({k: both(k) for k in ("git_commit", "git_describe")}, command=f"{w['command']} && {t['command']}")
    payload = {**ran, "what_it_shows": what, "summary": summary, "parts": {"write": w, "train": t}}
    print(f"wrote {record.write(name, payload, out)}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-moe", help="the config whose checkpoint tensors the state takes")
    ap.add_argument("--bytes", type=float, default=None, help="the state's size (default: the model's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--dir", default="/tmp/runs/bench-checkpoint-speed", help="where the files and runs go")
    ap.add_argument("--train-model", default=None)
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--term-after", type=int, default=1, help="SIGTERM once this step's metrics are logged")
    ap.add_argument("--train-overrides", nargs="*", default=[])
    ap.add_argument("--part", choices=["all", "write", "train"], default="all",
                    help="all: the train runs first (the GPU free), then the writes")
    ap.add_argument("--no-streamed", action="store_true", help="skip the synchronous streamed save of each rep")
    ap.add_argument("--out", default=None, help="results directory (default experiments/results)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--merge", nargs=2, metavar=("WRITE_JSON", "TRAIN_JSON"), default=None,
                    help="one result of a --part write and a --part train result (two device calls where one "
                         "would pass a call's time limit): their summaries together, each part's record kept")
    a = ap.parse_args()
    if a.merge:
        merge_parts(*a.merge, a.name or "checkpoint_speed_h200", a.out)
        return

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    train = None if a.part == "write" else sigterm_and_resume(a, say)  # first: nothing of ours on the GPU
    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"
    summary: dict = {"gpu": gpu}
    rows, first, nbytes, tensors = [], {}, 0, 0
    if a.part != "train":
        state = synthetic_state(a.model, int(a.bytes) if a.bytes else None, a.device)
        nbytes, tensors = sum(t.numel() * t.element_size() for t in state.values()), len(state)
        say(f"state: {tensors} tensors of {a.model}'s checkpoint, {nbytes / 1e9:.2f} GB on {a.device}")
        rows, first = measure_writes(a, state, say)
        del state
        med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
        for r in rows:
            r["write_over_dd"] = round(r["write_gbps"] / r["dd_gbps"], 3)
        first["write_over_dd_of_the_medians"] = round(med("write_gbps") / med("dd_gbps"), 3)
        summary.update({"write_gbps": round(med("write_gbps"), 3), "dd_gbps": round(med("dd_gbps"), 3),
                        "write_over_dd": round(med("write_over_dd"), 3),
                        "async_stall_s": round(med("stall_s"), 3), "staging_s": round(med("staging_s"), 3)})
    if train is not None:
        summary["sigterm_default_grace_checkpoint_complete"] = train["sigterm_default_grace_checkpoint_complete"]
        summary["resume_bitwise"] = train["resume_bitwise"]
    machine = "cpu" if gpu == "cpu" else gpu.split()[-1].lower()
    what = "" if not rows else (
        f"{a.model}'s checkpoint tensors, {nbytes / 1e9:.2f} GB on {a.device}: AsyncSaver writes "
        f"{summary['write_gbps']} GB/s vs dd {summary['dd_gbps']} GB/s on the same file system "
        f"(x{summary['write_over_dd']}, medians of {a.reps}); training stalls {summary['async_stall_s']} s "
        f"(staging copy {summary['staging_s']} s)")
    if train is not None:
        what += (f"; {train['train_model']}: SIGTERM at the default grace left a complete checkpoint: "
                 f"{train['sigterm_default_grace_checkpoint_complete']}, resume bitwise: {train['resume_bitwise']}")
    payload = {"what_it_shows": what, "summary": summary, "state_bytes": nbytes, "tensors": tensors,
               **first, "reps": rows, "train": train, "args": vars(a)}
    print(json.dumps(summary))
    say(f"wrote {record.write(a.name or f'checkpoint_speed_{machine}', payload, a.out)}")


if __name__ == "__main__":
    main()
