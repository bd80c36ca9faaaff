"""CPU tokens/s of the vLLM generator backend vs the native generator on the same prompts, and
whether they sampled the same tokens with the same logprob bits (they must).

    python experiments/rollout/bench_vllm.py [--prompts 256] [--max-new-tokens 48] [--ep-size 1] [--out DIR]

Both sides get the same tiny MoE, seeded prompts of 4-16 tokens (as `rlalign agree`), sample ids
and sampling; each is timed after a warm-up call (vLLM's engine start is reported separately).
Writes experiments/results/vllm_cpu_tokens_per_s[_epN][_TAG].json. The native generator runs
in this process at EP 1 with its own schedule (generator.max_num_seqs etc.: pass them as overrides
to give both engines the same one).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py
import record  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.agree import random_prompts  # noqa: E402
from rlalign.config import EngineConfig, keys_of, load_config, model_args  # noqa: E402
from rlalign.model import build_model, save_hf  # noqa: E402
from rlalign.rollout.native.engine import generate  # noqa: E402
from rlalign.rollout.vllm import check_installed  # noqa: E402
from rlalign.rollout.vllm.engine import ENGINE_KEYS, VllmGenerator  # noqa: E402
from rlalign.sampling_params import SamplingParams  # noqa: E402


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("overrides", nargs="*", help="config overrides (generator.vllm.*, generator.*, model.*)")
    a = ap.parse_args()
    cfg = load_config(["generator.backend=vllm", f"agree.num_prompts={a.prompts}",
                       f"agree.max_new_tokens={a.max_new_tokens}", f"generator.ep_size={a.ep_size}", *a.overrides])
    kernels.configure(cfg.kernels.mode, cfg.kernels.backend, cfg.device)
    model = build_model(model_args(cfg), cfg.model.dtype, seed=cfg.model.init_seed)
    prompts = random_prompts(cfg, model.args.vocab_size)
    ids = list(range(len(prompts)))
    params = SamplingParams.from_config(cfg, model.args.eos_token_id, cfg.seed, cfg.agree.max_new_tokens)

    native_engine = keys_of(EngineConfig, cfg.generator)
    generate(model, prompts[:4], ids[:4], params, engine=native_engine)  # warm-up
    ref, t_native = _timed(lambda: generate(model, prompts, ids, params, engine=native_engine))

    v = cfg.generator.vllm
    options = {k: v[k] for k in ENGINE_KEYS}
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, Path(tmp) / "model")
        gen, t_start = _timed(lambda: VllmGenerator(str(Path(tmp) / "model"), cfg.model.dtype, options,
                                                    ep_size=a.ep_size, device=cfg.device))
        gen.generate(prompts[:4], ids[:4], params)  # warm-up
        out, t_vllm = _timed(lambda: gen.generate(prompts, ids, params))
        gen.shutdown()

    tokens = sum(len(r.tokens) for r in ref)
    same_tokens = [o.tokens for o in out] == [r.tokens for r in ref]
    same_bits = same_tokens and all(torch.equal(o.logprobs.view(torch.int32), r.logprobs.view(torch.int32))
                                    for o, r in zip(out, ref))
    result = {
        "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "generated_tokens": tokens,
        "generator_ep": a.ep_size, "model": cfg.model.name, "dtype": cfg.model.dtype,
        "native": {"seconds": round(t_native, 3), "tokens_per_s": round(tokens / t_native, 1),
                   "engine": {"max_num_seqs": native_engine.max_num_seqs,
                              "max_num_batched_tokens": native_engine.max_num_batched_tokens,
                              "page_size": native_engine.page_size}},
        "vllm": {"seconds": round(t_vllm, 3), "tokens_per_s": round(tokens / t_vllm, 1),
                 "engine_start_s": round(t_start, 1), "options": options},
        "vllm_over_native": round(t_native / t_vllm, 3),
        "same_tokens": same_tokens, "same_logprob_bits": same_bits,
        "vllm_version": check_installed(),
    }
    name = "vllm_cpu_tokens_per_s" + (f"_ep{a.ep_size}" if a.ep_size > 1 else "") + (f"_{a.tag}" if a.tag else "")
    command = shlex.join(["python", "experiments/rollout/bench_vllm.py", *sys.argv[1:]])
    print(result)
    print("wrote", record.write(name, {"result": result}, a.out, command))


if __name__ == "__main__":
    main()
