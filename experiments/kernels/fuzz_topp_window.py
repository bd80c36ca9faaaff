"""A fuzz of the top-p / top-k cut under the Triton interpreter: kernels/triton/topp.py filter_cut against the torch
reference (sampling.filter_cut), key for key, on random batches of rows of many shapes (normal at several scales,
student-t, zipf, spikes over a flat row, integer levels, a 4-step ladder, bimodal, a 1e-3 range, +-30 sigma, a
-inf here and there) in bf16 / fp16 / fp32, V 64 to 20,000, top-k 0 / 1 / 5 / 50 / V - 1, top-p 0.1 to 0.999999,
four temperatures; under the product's window, windows of no width (adjacent windows, the exact bins), small
windows with one retry, and the key search by levels alone. Counts the rows by setting and path (filter_cut's
passes); saves each mismatching case to /tmp/fuzz_bad_<n>.pt.

    python experiments/kernels/fuzz_topp_window.py [SEED] [SECONDS]
"""

import os
import random
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from rlalign.kernels import sampling  # noqa: E402
from rlalign.kernels.triton import topp  # noqa: E402

SETTINGS = ("product", "tiny", "small_one_retry", "levels")


def row(rng: random.Random, g: torch.Generator, V: int) -> torch.Tensor:
    kind = rng.choice(["normal", "t", "zipf", "spikes", "ints", "ladder", "bimodal", "tiny_range", "huge"])
    if kind == "normal":
        z = torch.randn(V, generator=g) * rng.choice([0.3, 1, 2, 4, 8])
    elif kind == "t":
        z = torch.distributions.StudentT(rng.choice([1.5, 3.0])).sample((V,)) * rng.choice([1, 3])
    elif kind == "zipf":
        rank = torch.randperm(V, generator=g).float()
        z = -rng.choice([0.5, 1, 2]) * torch.log1p(rank) + 0.5 * torch.randn(V, generator=g)
    elif kind == "spikes":
        z = torch.randn(V, generator=g)
        n = rng.randint(1, 30)
        z[torch.randint(0, V, (n,), generator=g)] = 3 + 10 * torch.rand(n, generator=g)
    elif kind == "ints":
        z = torch.randint(-rng.randint(1, 20), 3, (V,), generator=g).float()
    elif kind == "ladder":
        z = torch.tensor([0.0, -0.5, -1.0, -1.5])[torch.randint(0, 4, (V,), generator=g)]
    elif kind == "bimodal":
        z = torch.where(torch.rand(V, generator=g) < 0.01, 5.0, 0.0) + torch.randn(V, generator=g) * 0.3
    elif kind == "tiny_range":
        z = 3 + torch.rand(V, generator=g) * 1e-3
    else:
        z = torch.randn(V, generator=g) * 30
    if rng.random() < 0.1:
        z[rng.randrange(V)] = float("-inf")
    return z


NAMES = ("EST_RANK", "EST_DMIN", "EST_DTYPE_FLOOR", "EST_RETRIES", "PAIR_MAX")


def settings(rng: random.Random, name: str) -> tuple:
    """(EST_RANK, EST_DMIN, EST_DTYPE_FLOOR, EST_RETRIES, PAIR_MAX) of a setting."""
    rank, dmin, floor, retries, pair = (getattr(topp, n) for n in NAMES)
    return {"product": (rank, dmin, floor, retries, pair), "tiny": (0, 0.0, False, retries, pair),
            "small_one_retry": (rng.choice([1, 8, 64]), 0.0, False, 1, pair),
            "levels": (rank, dmin, floor, retries, 0)}[name]


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 600.0
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    product = tuple(getattr(topp, n) for n in NAMES)
    bad, rows, paths, t0 = 0, 0, {}, time.time()
    while time.time() - t0 < seconds:
        V, B = rng.choice([64, 300, 1000, 5000, 20000]), rng.choice([1, 3])
        z = torch.stack([row(rng, g, V) for _ in range(B)]).to(rng.choice([torch.bfloat16, torch.float16,
                                                                          torch.float32]))
        top_k = rng.choice([0, 0, 0, 1, 5, 50, V - 1])
        top_p = rng.choice([0.1, 0.5, 0.9, 0.95, 0.99, 0.999999])
        scale = rng.choice([1.0, 1.25, 1 / 0.6, 0.7])
        name = rng.choice(SETTINGS)
        for n, v in zip(NAMES, settings(rng, name)):
            setattr(topp, n, v)
        try:
            want = sampling.filter_cut(sampling.temper(z, scale), top_k, top_p)
            passes = torch.empty(B, dtype=torch.int32)
            got = topp.filter_cut(z, top_k, top_p, scale, passes=passes)
        finally:
            for n, v in zip(NAMES, product):
                setattr(topp, n, v)
        rows += B
        for p in passes.tolist():
            paths[f"{name}:{p}"] = paths.get(f"{name}:{p}", 0) + 1
        if not torch.equal(got, want):
            bad += 1
            case = {"z": z, "top_k": top_k, "top_p": top_p, "scale": scale, "setting": name}
            torch.save(case, f"/tmp/fuzz_bad_{bad}.pt")
            print("MISMATCH", V, B, z.dtype, top_k, top_p, scale, name, got.tolist(), want.tolist(), flush=True)
    print(f"rows {rows}, mismatching batches {bad}; rows by setting:passes {dict(sorted(paths.items()))}", flush=True)


if __name__ == "__main__":
    main()
