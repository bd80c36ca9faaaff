"""Static SASS of the Gumbel-max draw for sm_90, without a GPU (sass.py: the launches captured at 1,024 rows of
151,936 bf16 logits, T 0.8, specialised as at run time): the product's (kernels/triton/sampling.py, the noise only
where a value may reach the row's best) beside the full draw draw_full.py (every value's noise): registers and the
instructions a chunk streams on each of the chunk loop's paths. The product's loop has three: a chunk none of whose
values comes within the noise's
reach of the row's best (no hash), a chunk whose values are hashed and ruled out (may_reach), and a chunk that
computes the exact noise. The paths are read off the loop's straight-line code: the two conditional branches that
jump to the loop's tail (the skips), taken or not; other forward branches (division's slow paths) not taken.

    /tmp/t36/bin/python experiments/kernels/sass_draw.py [--variant FILE] [--full FILE] [--out DIR]

Run with the Triton the GPU machine has (3.6; see sass.py). Writes results/sass_draw_sm90.json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402
from probe_draw_prune import FULL  # noqa: E402
from probe_topp_split import load_baseline  # noqa: E402
from sass import CUOBJDUMP, captured, cpu_tensor, sass_stats  # noqa: E402

from rlalign.kernels.triton import sampling as product_sampling  # noqa: E402

ROWS, VOCAB, SCALE = 1024, 151936, 1.25


def sass_lines(kernel) -> list[tuple[int, str]]:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        text = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return [(int(m.group(1), 16), m.group(2).strip()) for line in text.splitlines()
            if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line))]


def loop_paths(lines: list[tuple[int, str]]) -> dict:
    """Instructions on each path through the chunk loop (the first backward branch closes it)."""
    addr = [a for a, _ in lines]
    back = next((a, int(m.group(1), 16)) for a, t in lines
                if (m := re.search(r"BRA (?:!?U?P\w+, )?0x([0-9a-f]+)", t)) and int(m.group(1), 16) <= a)
    end, start = back
    body = [(a, t) for a, t in lines if start <= a <= end]
    branches = [(a, int(m.group(1), 16)) for a, t in body
                if t.startswith("@") and (m := re.search(r"BRA 0x([0-9a-f]+)", t)) and int(m.group(1), 16) > a]
    tail = max((tgt for _, tgt in branches), default=end + 1)
    skips = [a for a, tgt in branches if tgt == tail]

    def count(taken: int | None) -> int:
        """Straight-line instructions from start to end, jumping to the tail at skip `taken` (None: no skip)."""
        n, a = 0, start
        while a <= end:
            n += 1
            if a == taken:
                a = tail
                continue
            a = addr[addr.index(a) + 1]
        return n
    paths = {"loop_instructions": len(body), "skips": [hex(a) for a in skips]}
    names = ("no_hash", "hashed_ruled_out")
    for name, skip in zip(names, skips):
        paths[name] = count(skip)
    paths["exact_noise"] = count(None)
    return paths


def launches(mod) -> dict:
    ids, pos = torch.zeros(ROWS, dtype=torch.long), torch.zeros(ROWS, dtype=torch.long)
    out = {}
    with mock.patch.object(torch, "_assert_async", lambda *a, **k: None):
        for name, fn in (("draw", mod.gumbel_argmax), ("draw_logprob", mod.gumbel_argmax_logprobs)):
            with captured() as got:
                fn(cpu_tensor(ROWS, VOCAB), 1, ids, pos, SCALE)
            out[name] = got[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="", help="a sampling.py for the pruned draw (default: the product's)")
    ap.add_argument("--full", default=FULL, help="the full draw's file")
    ap.add_argument("--blocks", default="512,1024", help="the pruned draw's DRAW_BLOCK values compiled")
    ap.add_argument("--out", default=str(record.RESULTS))
    a = ap.parse_args()
    kernels = {}
    full = load_baseline(a.full, "draw_full")
    sampling = load_baseline(a.variant, "draw_variant") if a.variant else product_sampling
    for name, launch in launches(full).items():
        k = launch.compile()
        st = sass_stats(k)
        body = loop_paths(sass_lines(k))
        per_thread = full.DRAW_BLOCK // (32 * launch.options.get("num_warps", 4))
        kernels[f"full:{name}"] = {"reg": st["reg"], "draw_block": full.DRAW_BLOCK, "loop": body,
                                   "per_value": {"every_value": round(body["exact_noise"] / per_thread, 1)}}
    kept = sampling.DRAW_BLOCK
    try:
        for block in (int(b) for b in a.blocks.split(",")):
            sampling.DRAW_BLOCK = block
            for name, launch in launches(sampling).items():
                k = launch.compile()
                st = sass_stats(k)
                paths = loop_paths(sass_lines(k))
                per_thread = block // (32 * launch.options.get("num_warps", 4))
                kernels[f"product:{name}:{block}"] = {
                    "reg": st["reg"], "local": st.get("local", 0), "draw_block": block, "loop": paths,
                    "per_value": {p: round(paths[p] / per_thread, 1) for p in ("no_hash", "hashed_ruled_out",
                                                                              "exact_noise") if p in paths}}
    finally:
        sampling.DRAW_BLOCK = kept
    for n, k in kernels.items():
        print(n, k["reg"], "registers; instructions a value:", k["per_value"], flush=True)
    shows = "; ".join(f"{n}: {k['per_value']}" for n, k in kernels.items())
    record.write("sass_draw_sm90", {
        "triton": triton.__version__, "target": "sm_90", "rows": ROWS, "vocab": VOCAB, "scale": SCALE,
        "variant_file": a.variant, "full_file": a.full, "kernels": kernels,
        "what_it_shows": "Static SASS of the draw's chunk loop (Triton " + triton.__version__ + ", sm_90, the JIT's "
                         "specialisation): instructions a value on each path, the full draw (every value's noise) "
                         "against the product's pruned draw: " + shows}, a.out)


if __name__ == "__main__":
    main()
