"""The sampling step's passes over [rows, vocab] on one GPU: the composition that upcasts first (an fp32
copy of the bf16 logits, the temperature as a division pass, then the top-k/top-p filter, the Gumbel-max
draw and the logprob on fp32) against kernels.tempered / sample_tempered_logprobs (the consumers read the
bf16 logits in place, upcast and scale them in registers; the draw and its logprob in one launch). Bits: the tokens, the
logprobs (generator's step and trainer's token_logprobs) and the filtered values, compared exactly.
Time: each step under a CUDA graph (CALLS steps per replay), the two graphs replayed in turn (REPS
rounds, median: sweep_grouped_sched.interleaved_us).

    python experiments/bench_sampler_passes.py [--reference DIR] [--quick] [--out DIR]

--reference DIR: the upcasting composition's kernels from DIR/sampling.py and DIR/logprob.py (copies
of kernels/triton/ at the commit to compare with), loaded beside this tree's; by default this tree's
kernels on the fp32 copy. A reference with in-place kernels (logprob.tempered_logprobs) is also timed
as `separate`: its draw and logprob in two launches. Writes results/bench_sampler_passes_<gpu>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import write  # noqa: E402
from sweep_grouped_sched import CALLS, capture, interleaved_us  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.kernels.triton import logprob as tlogprob  # noqa: E402
from rlalign.kernels.triton import sampling as tsampling  # noqa: E402

CONFIGS = {"T1": (1.0, 0, 1.0), "T0.8 top-p 0.95": (0.8, 0, 0.95), "T0.8": (0.8, 0, 1.0),
           "T0.7 top-k 50 top-p 0.9": (0.7, 50, 0.9)}
SEED = 2**63 + 11
EQUAL = ("tokens_equal", "logprobs_equal", "trainer_logprobs_equal", "values_equal")


def load_reference(folder: str | None):
    """(sampling, logprob) modules of the upcasting composition."""
    if folder is None:
        return tsampling, tlogprob
    mods = []
    for name in ("sampling", "logprob"):
        spec = importlib.util.spec_from_file_location(f"rlalign.kernels.triton._reference_{name}",
                                                      Path(folder) / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return tuple(mods)


def upcast_step(ref, logits, ids, pos, temperature, top_k, top_p):
    """(tokens, logprobs, values): the step as composed before the consumers read bf16 (the division by
    a Python scalar: torch's CUDA kernel multiplies by the fp32 reciprocal)."""
    rs, rl = ref
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if (top_k and top_k < z.shape[-1]) or top_p < 1.0:
        z = rs.filter_logits(z, top_k, top_p)
    tok = rs.gumbel_argmax(z, SEED, ids, pos)
    return tok, rl.log_softmax_gather(z, tok), z


def separate_step(ref, logits, ids, pos, temperature, top_k, top_p):
    """The reference's in-place kernels with the draw and the logprob in two launches (a reference that
    has them: tempered_logprobs)."""
    rs, rl = ref
    scale = 1.0 if temperature == 1.0 else kernels.inverse_temperature(temperature)
    z = logits
    if (top_k and top_k < z.shape[-1]) or top_p < 1.0:
        z, scale = rs.filter_logits(z, top_k, top_p, scale), 1.0
    tok = rs.gumbel_argmax(z, SEED, ids, pos, scale)
    return tok, rl.tempered_logprobs(z, scale, tok), kernels.Tempered(z, scale)


def fused_step(logits, ids, pos, temperature, top_k, top_p):
    """rollout.sampling.sample_next's kernels (the decode graphs' step)."""
    z = kernels.tempered(logits, temperature, top_k, top_p)
    return (*kernels.sample_tempered_logprobs(z, SEED, ids, pos), z)


def bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))
    return bool(torch.equal(a, b))


def run_case(ref, B: int, V: int, cname: str, g: torch.Generator) -> dict:
    temperature, top_k, top_p = CONFIGS[cname]
    logits = (torch.randn(B, V, generator=g, device="cuda") * 2.0).bfloat16()
    logits[1, ::3] = float("-inf")
    ids = torch.randint(0, 2**40, (B,), generator=g, device="cuda")
    pos = torch.randint(0, 4096, (B,), generator=g, device="cuda")
    t_old, lp_old, z_old = upcast_step(ref, logits, ids, pos, temperature, top_k, top_p)
    t_new, lp_new, z_new = fused_step(logits, ids, pos, temperature, top_k, top_p)
    lp_trainer = kernels.token_logprobs(logits, t_new, temperature, top_k, top_p)
    row = {"rows": B, "vocab": V, "config": cname,
           "tokens_equal": bits(t_old, t_new), "logprobs_equal": bits(lp_old, lp_new),
           "trainer_logprobs_equal": bits(lp_trainer, lp_new),
           "values_equal": bits(z_old, z_new.values()),
           "negative_twin_next_scale_differs": None}
    if temperature != 1.0:  # the twin: the neighbouring fp32 factor scores other bits
        s = kernels.inverse_temperature(temperature)
        s2 = torch.nextafter(torch.tensor(s), torch.tensor(2.0)).item()
        twin = tlogprob.tempered_logprobs(logits, s2, t_new) if z_new.scale != 1.0 else None
        row["negative_twin_next_scale_differs"] = None if twin is None else not bits(twin, lp_new)
    graphs = {"upcast": capture(lambda: upcast_step(ref, logits, ids, pos, temperature, top_k, top_p)),
              "fused": capture(lambda: fused_step(logits, ids, pos, temperature, top_k, top_p))}
    if hasattr(ref[1], "tempered_logprobs"):
        t_sep, lp_sep, z_sep = separate_step(ref, logits, ids, pos, temperature, top_k, top_p)
        row["separate_equal"] = bits(t_sep, t_new) and bits(lp_sep, lp_new) and bits(z_sep.values(), z_new.values())
        graphs["separate"] = capture(lambda: separate_step(ref, logits, ids, pos, temperature, top_k, top_p))
    us = interleaved_us(graphs)
    for name, t in us.items():
        row[f"{name}_us"] = t
    del graphs
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", default=None)
    ap.add_argument("--quick", action="store_true", help="T1 and T0.8 top-p 0.95 only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ref = load_reference(a.reference)
    g = torch.Generator(device="cuda").manual_seed(0)
    names = ["T1", "T0.8 top-p 0.95"] if a.quick else list(CONFIGS)
    gpu = torch.cuda.get_device_name().split()[-1].lower()
    rows = []
    with kernels.use(mode="deterministic", backend="triton"):
        for V in (32000, 151936):
            for B in (256, 2048):
                for cname in names:
                    r = run_case(ref, B, V, cname, g)
                    rows.append(r)
                    ok = all(r[k] for k in EQUAL)
                    ok = ok and r.get("separate_equal", True)
                    sep = f"  separate {r['separate_us']:8.1f} us" if "separate_us" in r else ""
                    print(f"B={B:5d} V={V:6d} {cname:24s} upcast {r['upcast_us']:8.1f} us{sep}  fused "
                          f"{r['fused_us']:8.1f} us  ratio {r['fused_us'] / r['upcast_us']:.3f}  bits "
                          f"{'equal' if ok else 'DIFFER ' + str(r)}", flush=True)
                    out = {"rows": rows, "calls_per_replay": CALLS,
                           "reference": a.reference or "this tree's kernels on the fp32 copy",
                           "what_it_shows": "one sampling step (tempered + Gumbel draw + logprob), upcast-first vs "
                                            "in-register, bf16 logits normal(0, 2), seed past 2**63; us per step"}
                    path = write(f"bench_sampler_passes_{gpu}", out, a.out)
                    torch.cuda.empty_cache()
    print("wrote", path)


if __name__ == "__main__":
    main()
