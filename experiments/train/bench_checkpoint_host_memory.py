"""Peak host memory of a checkpoint save against the state's size, through the real save path.

    python experiments/train/bench_checkpoint_host_memory.py --model qwen3-30b-a3b-rehearsal --device cuda \
        [--bucket-mb 512 ...] [--modes async sync] [--dir /tmp/runs/bench-ckpt] [--out DIR]

Builds one trainer rank (EP 1) of the model config on the device, takes its checkpoint_state() (bf16
weights, fp32 masters, both AdamW moments: what a checkpoint holds) and saves it per bucket size
and mode: `async` is rlalign.checkpoint.AsyncSaver streaming (checkpoint.staging=stream: what
TrainerWorker.save runs when the host has no room to stage; a staged save holds the state once more,
by design), `sync` is save_shards; then complete() publishes it and verify() checks its files.
Each save is measured in this process: resident memory before (VmRSS) and the peak during the save
(VmHWM after resetting it through /proc/self/clear_refs; else the maximum of a 2 ms sampler); the
difference is the save's host memory. --bucket-mb 0 means one bucket of the whole state (the
memory a save without buckets needs). Writes bench_checkpoint_host_memory_<model>_<machine>.json
(experiments/record.py's record) and prints a table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py

import record  # noqa: E402
import torch  # noqa: E402


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRSS:
    """Peak resident bytes of this process while the block runs: VmHWM after clear_refs (kernel
    4.0+), else a sampler thread's maximum of VmRSS."""

    def __enter__(self):
        self.before = _status_kb("VmRSS") << 10
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.how = "VmHWM after clear_refs"
        except OSError:
            self.how = "VmRSS sampled every 2 ms"
        self.sampled, self._stop = self.before, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.sampled = max(self.sampled, _status_kb("VmRSS") << 10)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        hwm = _status_kb("VmHWM") << 10 if self.how.startswith("VmHWM") else 0
        self.peak = max(hwm, self.sampled)
        self.extra = self.peak - self.before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[512], help="0: one bucket of the whole state")
    ap.add_argument("--modes", nargs="+", default=["async", "sync"], choices=["async", "sync"])
    ap.add_argument("--dir", default="/tmp/runs/bench-checkpoint-host-memory")
    ap.add_argument("--out", default=None, help="results directory (default experiments/results)")
    ap.add_argument("--name", default=None)
    a = ap.parse_args()

    from rlalign import checkpoint as ckpt
    from rlalign import kernels
    from rlalign.config import load_config
    from rlalign.training.trainer import Trainer, checkpoint_nbytes

    cfg = load_config([f"model={a.model}", f"device={a.device}"])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    t0 = time.perf_counter()
    tr = Trainer(cfg)
    state = tr.checkpoint_state()
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    state_bytes = sum(v.numel() * v.element_size() for v in state.values())
    largest = max(v.numel() * v.element_size() for v in state.values())
    assert state_bytes == sum(checkpoint_nbytes(cfg).values()), "the start-up estimate is the state's size"
    run_dir = Path(a.dir)
    rows = []
    for mb in a.bucket_mb:
        bucket = (mb << 20) if mb else state_bytes
        for mode in a.modes:
            shutil.rmtree(run_dir, ignore_errors=True)
            tmp = ckpt.tmp_path(run_dir, 0)
            tmp.parent.mkdir(parents=True)
            t = time.perf_counter()
            with PeakRSS() as m:
                if mode == "async":
                    saver = ckpt.AsyncSaver(staging="stream", say=lambda line: None)
                    saver.save(state, tmp, bucket_bytes=bucket)
                    returned_s = time.perf_counter() - t
                    saver.wait()
                else:
                    ckpt.save_shards(state, tmp, bucket_bytes=bucket)
                    returned_s = time.perf_counter() - t
            write_s = time.perf_counter() - t
            final = ckpt.complete(run_dir, 0, {"data_position": 1}, keep=0)
            meta = ckpt.verify(final)
            written = sum(f["bytes"] for f in meta["files"].values())
            rows.append({"mode": mode, "bucket_mb": mb, "bucket_bytes": bucket, "files": len(meta["files"]),
                         "written_bytes": written, "rss_before_bytes": m.before, "rss_peak_bytes": m.peak,
                         "save_host_bytes": m.extra, "save_host_over_state": m.extra / state_bytes,
                         "save_host_over_bucket": m.extra / max(bucket, largest), "returned_s": round(returned_s, 3),
                         "write_s": round(write_s, 3), "write_gb_per_s": round(written / write_s / 1e9, 3),
                         "peak_measured_by": m.how})
            print(f"{mode:5s} bucket {mb or 'state':>5} MB  files {len(meta['files']):4d}  "
                  f"state {state_bytes / 1e9:7.3f} GB  save host {m.extra / 1e9:7.3f} GB = "
                  f"{m.extra / state_bytes:6.1%} of the state"
                  f" = {m.extra / max(bucket, largest):5.2f}x bucket  write {write_s:6.1f} s", flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    bucketed = [r["save_host_over_state"] for r in rows if r["bucket_mb"]]
    worst = max(bucketed) if bucketed else None
    machine = (torch.cuda.get_device_name(0).split()[-1] if a.device.startswith("cuda") else "cpu").lower()
    name = a.name or f"bench_checkpoint_host_memory_{a.model}_{machine}"
    per_bucket = []
    for mb in a.bucket_mb:
        worst_row = max((r for r in rows if r["bucket_mb"] == mb), key=lambda r: r["save_host_bytes"])
        per_bucket.append(f"{f'{mb} MB buckets' if mb else 'one bucket of the whole state'}: "
                          f"{worst_row['save_host_bytes'] / 1e9:.2f} GB = {worst_row['save_host_over_bucket']:.1f} "
                          f"buckets = {worst_row['save_host_over_state']:.1%} of the state")
    payload = {
        "what_it_shows": (f"{a.model} on {a.device}: peak host memory of a checkpoint save (async and sync, the "
                          f"worse) of one trainer rank's state of {state_bytes / 1e9:.2f} GB; "
                          + "; ".join(per_bucket)),
        "model": a.model, "device": a.device, "state_bytes": state_bytes, "largest_tensor_bytes": largest,
        "tensors": len(state), "build_s": round(build_s, 2), "rows": rows,
        "summary": {"state_bytes": state_bytes, "worst_save_host_over_state_bucketed": worst},
    }
    print(f"wrote {record.write(name, payload, a.out)}")


if __name__ == "__main__":
    main()
