"""The top-p cut's launches (kernels/triton/topp.py filter_cut: the first window and its exact pass; the key search
over the window where it holds the cut; the retries where it missed), each launch's device time from the torch
profiler, against variants of the same code: the search and the retries in one launch (WINDOW_LAUNCHES), other
warps and chunks (CUT_WARPS, CUT_STREAM), and optionally a
baseline module (an older topp.py, e.g. the one-launch cut) loaded from a file. Every variant's cut is checked
bit for bit against the product's. Beside it, the draw through the cut (whose chunks the cut filtered whole draw
no noise) against the draw without a cut.

    python experiments/kernels/probe_topp_split.py [--rows 1024] [--baseline FILE] [--out DIR]

Logits (bf16, 151,936 columns): normal(0, 1) (flat), normal(0, 4) (peaked), student-t(3), zipf, three spikes over
a flat row; T 0.8 top-p 0.95, and the spikes at T 0.6 top-p 0.9. Writes results/probe_topp_split_<gpu>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402
from bench_topp_cut import logits_of  # noqa: E402

from rlalign.kernels import inverse_temperature, sampling  # noqa: E402
from rlalign.kernels.triton import common, topp  # noqa: E402
from rlalign.kernels.triton import sampling as sampling_tr  # noqa: E402

KNOBS = ("WINDOW_LAUNCHES", "CUT_WARPS", "CUT_STREAM")
VARIANTS = {"one_window_launch": dict(WINDOW_LAUNCHES=((True, True),)),
            "w4": dict(CUT_WARPS=4), "w16_s2048": dict(CUT_WARPS=16, CUT_STREAM=2048),
            "w16_s4096": dict(CUT_WARPS=16, CUT_STREAM=4096), "w8_s2048": dict(CUT_STREAM=2048)}


def load_baseline(path: str, name: str = "topp_baseline"):
    """A kernel file (an older topp.py, a variant) as the module `name` of rlalign.kernels.triton (its relative imports
    resolve there)."""
    spec = importlib.util.spec_from_file_location(f"rlalign.kernels.triton.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def topp_at(rev: str) -> str:
    """kernels/triton/topp.py at a git revision, written to a temporary file (for load_baseline): its path."""
    src = subprocess.run(["git", "show", f"{rev}:kernels/triton/topp.py"], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    return f.name


def kernel_times(fn, reps: int = 20) -> dict:
    """Mean device ms per call of each kernel fn launches (the torch profiler's CUDA events)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time / 1000.0 / reps
    return {k: round(v, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def passes_of(z, p, scale) -> tuple[torch.Tensor, dict]:
    passes = torch.empty(z.shape[0], dtype=torch.int32, device=z.device)
    cut = topp.filter_cut(z, 0, p, scale, passes=passes)
    return cut, {str(int(n)): int(c) for n, c in zip(*passes.unique(return_counts=True))}


def probe(z: torch.Tensor, temp: float, p: float, baseline) -> dict:
    scale = inverse_temperature(temp)
    cut, by_passes = passes_of(z, p, scale)
    res = {"cut_ms": triton.testing.do_bench(lambda: topp.filter_cut(z, 0, p, scale)), "rows_by_passes": by_passes,
           "kernels_ms": kernel_times(lambda: topp.filter_cut(z, 0, p, scale)), "variants": {}}
    ids = torch.arange(z.shape[0], device=z.device)
    # the draw through the cut (chunks the cut filtered whole draw no noise) against the draw without one
    res["kept_chunks_frac"] = float(torch.nn.functional.pad(
        sampling.order_keys(sampling.temper(z, scale)) >= cut[:, None], (0, -z.shape[1] % sampling_tr.DRAW_BLOCK))
        .view(z.shape[0], -1, sampling_tr.DRAW_BLOCK).any(-1).float().mean())
    res["draw_cut_ms"] = triton.testing.do_bench(lambda: sampling_tr.gumbel_argmax(z, 1, ids, ids, scale, cut=cut))
    res["draw_plain_ms"] = triton.testing.do_bench(lambda: sampling_tr.gumbel_argmax(z, 1, ids, ids, scale))
    saved = {k: getattr(topp, k) for k in KNOBS}
    for name, knobs in VARIANTS.items():
        try:
            for k, v in knobs.items():
                setattr(topp, k, v)
            vcut, vpasses = passes_of(z, p, scale)
            res["variants"][name] = {"cut_ms": triton.testing.do_bench(lambda: topp.filter_cut(z, 0, p, scale)),
                                     "cut_equal": bool(torch.equal(vcut, cut)), "rows_by_passes": vpasses}
        except Exception as e:  # one variant's failure (e.g. out of resources) is recorded, the others still run
            res["variants"][name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for k, v in saved.items():
                setattr(topp, k, v)
    if baseline is not None:
        bcut = baseline.filter_cut(z, 0, p, scale)
        res["baseline"] = {"cut_ms": triton.testing.do_bench(lambda: baseline.filter_cut(z, 0, p, scale)),
                           "cut_equal": bool(torch.equal(bcut, cut)),
                           "kernels_ms": kernel_times(lambda: baseline.filter_cut(z, 0, p, scale))}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--baseline", default="", help="an older topp.py to time beside the product")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    assert not common.INTERPRET, "a GPU timing"
    baseline = load_baseline(a.baseline) if a.baseline else None
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for kind, s, temp, p in (("normal", 1.0, 0.8, 0.95), ("normal", 4.0, 0.8, 0.95), ("student_t", 1.0, 0.8, 0.95),
                             ("zipf", 1.0, 0.8, 0.95), ("spikes", 1.0, 0.8, 0.95), ("spikes", 1.0, 0.6, 0.9)):
        torch.manual_seed(0)
        z = logits_of(g, kind, a.rows, a.vocab, s)
        r = {"kind": kind, "logit_scale": s, "rows": a.rows, "vocab": a.vocab, "temperature": temp, "top_p": p,
             **probe(z, temp, p, baseline)}
        cases.append(r)
        print(kind, s, temp, p, f"cut {r['cut_ms']:.3f} ms", r["rows_by_passes"], r["kernels_ms"],
              f"draw: cut {r['draw_cut_ms']:.3f} ms, plain {r['draw_plain_ms']:.3f}, chunks kept "
              f"{r['kept_chunks_frac']:.2f}",
              {n: (round(v["cut_ms"], 3), v["cut_equal"], v["rows_by_passes"]) if "error" not in v else v["error"]
               for n, v in r["variants"].items()}, r.get("baseline", {}), flush=True)
    equal = all(v.get("cut_equal", False) for c in cases for v in [*c["variants"].values(), c.get("baseline", {})]
                if v)
    shows = "; ".join(f"{c['kind']} s{c['logit_scale']:g} T{c['temperature']} p{c['top_p']}: cut {c['cut_ms']:.3f} ms"
                      + (f" (baseline {c['baseline']['cut_ms']:.3f})" if "baseline" in c else "")
                      + f", rows by passes {c['rows_by_passes']}, draw through the cut {c['draw_cut_ms']:.3f} ms "
                      f"against {c['draw_plain_ms']:.3f} without ({c['kept_chunks_frac']:.2f} of chunks kept)"
                      for c in cases)
    record.write(f"probe_topp_split_{record.gpu_tag()}", {
        "cases": cases, "baseline_file": a.baseline, "all_cuts_equal": equal,
        "what_it_shows": f"filter_cut's top-p launches at {a.rows} x {a.vocab} bf16 and its variants; every cut equal "
                         f"to the product's: {equal}. " + shows}, a.out)


if __name__ == "__main__":
    main()
