"""The native engine: a continuous-batching generator over a paged KV cache, on the same model
and ops as the trainer.

Each step is one `Transformer.step` over a mix of rows: one per decoding sequence, then prompt
chunks of newly admitted sequences within a token budget (Scheduler). A finished sequence frees
its slot and pages at once and the next queued request takes them. Batch invariance is what lets
the schedule vary freely: a row's bits depend only on its sequence, never on what shares its
step, how its prompt was chunked, or which pages hold its keys, so every schedule samples the same
tokens with the same logprob bits, equal to the trainer's rescoring. The token at absolute
position p of sample s is drawn with noise that depends only on (seed, s, p) (kernels.sampling),
and its logprob is `kernels.token_logprobs` of the logits it was sampled from: the function the
trainer applies when it rescores the finished sequence.

On CUDA with the Triton op set, decode-only steps replay CUDA graphs (DecodeGraphs). The KV cache,
block table and graphs stay with the engine between calls (KVState; an RL run calls generate()
once per step and captures nothing after its first), valid while the parameters keep their
addresses (weight sync copies into them). With lookahead the next decode step is enqueued before
this step's tokens are read back, so the GPU does not wait for the host's bookkeeping.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from rlalign import kernels
from rlalign.model import Transformer
from rlalign.rollout.native.pages import KVState, grow
from rlalign.rollout.native.runner import Launched, ModelRunner
from rlalign.rollout.native.scheduler import Scheduler
from rlalign.rollout.types import EngineConfig, Rollout, SamplingParams, check_prompts


class NativeEngine:
    """Generates with `model` itself (weight sync writes into its parameters). `any_live(local_live)`
    (expert parallelism) returns whether any rank still has work; a rank with nothing left keeps
    stepping with empty batches so that collectives inside the model stay in lockstep."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None,
                 any_live: Callable[[bool], bool] | None = None):
        self.model, self.config, self.any_live = model, config or EngineConfig(), any_live
        self.state: KVState | None = None  # kept between calls when config.keep_state
        self.stats: dict = {}  # the last call's: steps, lookahead_steps, discarded_rows

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams) -> list[Rollout]:
        """Sample continuations of `prompts`; rollouts in input order."""
        params.validate()
        cfg = self.config
        cfg.validate_schedule()
        if not prompts and self.any_live is None:
            raise ValueError("generate: empty prompt batch")
        check_prompts(self.model.args, prompts, sample_ids, params.max_new_tokens)
        pages_of = [-(-(len(p) + params.max_new_tokens) // cfg.page_size) for p in prompts]  # at the longest
        max_seqs = min(cfg.max_num_seqs or len(prompts), len(prompts)) or 1
        num_pages = cfg.num_pages or max(1, sum(sorted(pages_of, reverse=True)[:max_seqs]))
        for b, n in enumerate(pages_of):
            if n > num_pages:
                raise ValueError(
                    f"sample {sample_ids[b]}: prompt of {len(prompts[b])} tokens + max_new_tokens="
                    f"{params.max_new_tokens} needs {n} KV pages of {cfg.page_size} tokens; the cache has {num_pages} "
                    "(raise generator.num_pages or lower generator.max_new_tokens)"
                )
        state = self._state_for(num_pages, max_seqs, max(pages_of, default=1))
        graphs = state.decode_graphs() if self.graphs_allowed() and self.any_live is None else None
        sched = Scheduler(prompts, sample_ids, params, state, max_seqs, pages_of, cfg.max_num_batched_tokens)
        self.stats = {"steps": 0, "lookahead_steps": 0, "discarded_rows": 0}
        runner = ModelRunner(self.model, state, sched, sample_ids, params, graphs, self.stats)
        if graphs is not None:
            graphs.begin(self.model, params)
        try:
            lps, lp_rows = self._loop(sched, runner)
        finally:
            if graphs is not None:
                graphs.end()
            self.stats["discarded_rows"] = sched.discarded_rows
        return _assemble(sched.out, lps, lp_rows)

    def _loop(self, sched: Scheduler, runner: ModelRunner) -> tuple[list[torch.Tensor], list[list[int]]]:
        """schedule -> run -> postprocess until no request is left (with lookahead, the next decode
        step is run before this one's tokens are read back)."""
        lps, lp_rows = [], []  # per step: logprobs on the device, and the request index of each (-1: discarded)
        taps = getattr(self.model, "taps", None)
        ahead_ok = self.config.lookahead and self.any_live is None and (taps is None or getattr(taps, "inert", False))
        pending: Launched | None = None  # a step enqueued whose tokens are not read back yet
        while True:
            if pending is not None:
                nxt = sched.lookahead(pending.step) if ahead_ok else None
                after = runner.run(nxt, pending) if nxt is not None else None
                lps.append(pending.logprobs)
                lp_rows.append(sched.postprocess(pending.step, pending.read_tokens()))
                pending = after
                if pending is not None:
                    continue
            step = sched.schedule()
            if self.any_live is not None:
                if not self.any_live(bool(step.rows)):
                    break
            elif not step.rows:
                break
            pending = runner.run(step)
        return lps, lp_rows

    def graphs_allowed(self) -> bool:
        """Graphs replay kernels, not Python: only with an op set that never syncs with the host (the
        Triton kernels on CUDA) and when no tap does host work (row fingerprints, per-op traces and
        injected faults run eagerly)."""
        taps = getattr(self.model, "taps", None)
        return (self.config.cuda_graphs and kernels.capturable(self.model.lm_head.weight)
                and (taps is None or getattr(taps, "inert", False)))

    def _state_for(self, num_pages: int, rows: int, width: int) -> KVState:
        """This call's KV state: the kept one if it fits, else a new one (kept if config.keep_state)."""
        ps, dtype, dev = self.config.page_size, self.model.dtype, self.model.lm_head.weight.device
        keep, old = self.config.keep_state, self.state
        if keep and old is not None:
            if old.fits(num_pages, ps, rows, width, dtype, dev):
                return old
            self.state = None  # free the old cache and graphs before allocating the new ones
            same = old.page_size == ps and old.cache.k.dtype == dtype
            num_pages = grow(num_pages, old.num_pages if same else 0)
            rows, width = max(rows, old.rows if same else 0), max(width, old.width if same else 0)
            del old
        try:
            state = KVState(self.model.args, num_pages, ps, rows, width, dtype, dev)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"KV cache of {num_pages} pages x {ps} tokens does not fit on {dev}: lower generator.num_pages or "
                "generator.max_num_seqs"
            ) from e
        if keep:
            self.state = state
        return state

    def load_weights(self) -> None:
        """Nothing to do: the engine computes with the rank's model, which weight sync writes in place
        (same addresses: kept decode graphs replay with the new values)."""

    def release_memory(self) -> None:
        """Free the KV cache and decode graphs (the next call allocates and captures again)."""
        self.state = None

    def resume_memory(self) -> None:
        """Nothing to do: the next call allocates what it needs."""

    def close(self) -> None:
        self.release_memory()


def generate(model: Transformer, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams,
             engine: EngineConfig | None = None) -> list[Rollout]:
    """One call on a fresh NativeEngine (nothing kept afterwards): scripts, tests, one-off batches."""
    return NativeEngine(model, engine).generate(prompts, sample_ids, params)


def _assemble(out: list[Rollout], lps: list[torch.Tensor], lp_rows: list[list[int]]) -> list[Rollout]:
    """Each request's logprobs, in step order, from the steps' device tensors (one copy to the host)."""
    flat = torch.cat(lps).float().cpu().numpy() if lps else np.zeros(0, np.float32)
    rows = np.fromiter(itertools.chain.from_iterable(lp_rows), dtype=np.int64, count=len(flat))
    keep = rows >= 0
    rows, flat = rows[keep], flat[keep]
    order = np.argsort(rows, kind="stable")  # by request, step order within one
    parts = np.split(flat[order], np.cumsum(np.bincount(rows, minlength=len(out)))[:-1])
    for o, part in zip(out, parts):
        o.logprobs = torch.from_numpy(part.copy())  # its own storage (a view would pickle the whole batch)
    return out
