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

On CUDA with the Triton op set, decode steps replay CUDA graphs (DecodeGraphs), and so do steps with
prompt-chunk rows of up to graph_rows(max_num_seqs) rows (an episode's observation or an admitted prompt
beside the decode rows): every row runs as a decode row, a row's bits are those of its eager step, and
only the draws of the rows that sample are kept. Larger steps (a first prefill of many prompts) run
eagerly, their chunks as prefill tiles. The KV cache, block table and graphs stay with the engine
between calls (KVState; an RL run calls generate() once per step and captures nothing after its
first), valid while the parameters keep their addresses (weight sync copies into them). With
lookahead the next step (decode rows, admissions and prompt chunks) is enqueued before this step's
tokens are read back, so the GPU does not wait for the host's bookkeeping.

Multi-turn episodes (generate's `episodes`, rlalign.rollout.types.Continuations): a sequence whose turn
ends keeps its slot and KV pages, runs no rows while its environment works, and goes on with its
observation prefilled onto it (EpisodeScheduler); positions go on counting, so a continued turn has
the bits of a fresh prefill of its whole history.

Under expert parallelism the group's ranks step in lockstep (rlalign.parallel.launch.Lockstep): before
each step they agree on the most rows any rank runs and whether every rank's step is decode-only;
then the MoE layers' all-to-all has a fixed capacity from that bound (rlalign.parallel.alltoall), so
those steps replay decode graphs and take lookahead steps as a single GPU does. The group's loop ends
when no rank has rows and none waits for an episode's answer.
"""

from __future__ import annotations

import gc
import itertools

import numpy as np
import torch

from rlalign import kernels
from rlalign.kernels import torch_default as _default
from rlalign.model import Transformer
from rlalign.parallel.ep import capacity_overflowed, set_step_rows
from rlalign.parallel.launch import Lockstep
from rlalign.rollout.native.arena import ALIGN, DeviceArena
from rlalign.rollout.native.episodes import EpisodeScheduler, spread_logprobs
from rlalign.rollout.native.graphs import bucket, graph_rows
from rlalign.rollout.native.pages import KVState, grow
from rlalign.rollout.native.runner import Launched, ModelRunner
from rlalign.rollout.native.scheduler import Scheduler, Step
from rlalign.rollout.types import Continuations, EngineConfig, check_prompts
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout


class NativeEngine:
    """Generates with `model` itself (weight sync writes into its parameters). `lockstep` (expert
    parallelism): the rank's group; a rank with nothing left keeps stepping with empty batches so
    that collectives inside the model stay in lockstep."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None, lockstep: Lockstep | None = None,
                 releasable: bool = False):
        self.model, self.config, self.lockstep = model, config or EngineConfig(), lockstep
        self.state: KVState | None = None  # kept between calls when config.keep_state
        # the last call's: steps, lookahead_steps, graph_steps (replays), mixed_graph_steps (replays of steps with
        # prompt-chunk rows), discarded_rows, fixed_capacity_steps
        self.stats: dict = {}
        # releasable (CUDA): the weights and the KV cache in DeviceArenas, so that release_memory gives
        # their memory back and resume_memory maps it at the same addresses (the graphs stay valid)
        self.weights: DeviceArena | None = _weights_arena(model) if releasable else None
        self.released = False
        self.stale = False  # released since the weights were last written (load_weights)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams,
                 episodes: Continuations | None = None) -> list[Rollout]:
        """Sample continuations of `prompts`; rollouts in input order. `episodes`: multi-turn episodes
        (EpisodeScheduler): params.max_new_tokens limits each turn, episodes.max_len(b) the whole
        episode; each Rollout holds every token after its prompt (sampled and observed) with its turns,
        and returns once every episode is over."""
        params.validate()
        if self.stale:
            raise RuntimeError("generate: the engine's weights were released (release_memory) and not written since; "
                               "a weight sync (then load_weights) must come first")
        self.resume_memory()
        cfg = self.config
        cfg.validate_schedule()
        if not prompts and self.lockstep is None:
            raise ValueError("generate: empty prompt batch")
        max_lens = self._max_lens(prompts, sample_ids, params, episodes)
        pages_of = [-(-n // cfg.page_size) for n in max_lens]  # at the longest
        max_seqs = min(cfg.max_num_seqs or len(prompts), len(prompts)) or 1
        num_pages = cfg.num_pages or max(1, sum(sorted(pages_of, reverse=True)[:max_seqs]))
        for b, n in enumerate(pages_of):
            if n > num_pages:
                need, lower = ((f"max_new_tokens={params.max_new_tokens}", "task.max_new_tokens, agree.max_new_tokens")
                               if episodes is None else (f"the rest of its episode (max_len={max_lens[b]})",
                                                         "the episode's context limit"))
                raise ValueError(
                    f"sample {sample_ids[b]}: prompt of {len(prompts[b])} tokens + {need} needs {n} KV pages of "
                    f"{cfg.page_size} tokens; the cache has {num_pages} (raise generator.num_pages or lower the "
                    f"completion length: {lower})"
                )
        state = self._state_for(num_pages, max_seqs, max(pages_of, default=1))
        graphs = state.decode_graphs() if self.graphs_allowed() else None
        if episodes is None:
            sched = Scheduler(prompts, sample_ids, params, state, max_seqs, max_lens, cfg.max_num_batched_tokens)
        else:
            sched = EpisodeScheduler(prompts, sample_ids, params, state, max_seqs, max_lens,
                                     cfg.max_num_batched_tokens, episodes, self.model.args.vocab_size)
        self.stats = {"steps": 0, "lookahead_steps": 0, "graph_steps": 0, "mixed_graph_steps": 0, "discarded_rows": 0,
                      "fixed_capacity_steps": 0}
        runner = ModelRunner(self.model, state, sched, sample_ids, params, graphs, self.stats, graph_rows(max_seqs))
        if graphs is not None:
            graphs.begin(self.model, params)
        collecting = gc.isenabled()
        gc.disable()  # a full collection scans every object of the process (~0.1 s with torch loaded): not mid-loop
        try:
            lps, lp_rows = self._loop(sched, runner, episodes)
        finally:
            if collecting:
                gc.enable()
            if graphs is not None:
                graphs.end()
            if self.lockstep is not None:
                set_step_rows(self.model, None)
            self.stats["discarded_rows"] = sched.discarded_rows
            if state is not self.state:  # not kept (keep_state=false): an arena's memory goes back now
                state.close()
        if self.lockstep is not None and capacity_overflowed(self.model):
            raise RuntimeError("generate: a step sent an expert-parallel rank more rows than the fixed capacity "
                               "agreed for it (rlalign.parallel.alltoall): expert outputs were lost")
        out = _assemble(sched.out, lps, lp_rows)
        return out if episodes is None else spread_logprobs(out)

    def _max_lens(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams,
                  episodes: Continuations | None) -> list[int]:
        """Each request's longest length (prompt and everything after it: its pages), its input checked."""
        args = self.model.args
        if episodes is None:
            check_prompts(args, prompts, sample_ids, params.max_new_tokens)
            return [len(p) + params.max_new_tokens for p in prompts]
        check_prompts(args, prompts, sample_ids, 0)
        max_lens = [episodes.max_len(b) for b in range(len(prompts))]
        for p, sid, n in zip(prompts, sample_ids, max_lens):
            if not isinstance(n, int) or not len(p) < n <= args.max_position_embeddings:
                raise ValueError(f"sample {sid}: Continuations.max_len={n!r} must be an int above its prompt's "
                                 f"{len(p)} tokens and within the model's context of {args.max_position_embeddings}")
        return max_lens

    def _loop(self, sched: Scheduler, runner: ModelRunner, episodes: Continuations | None = None
              ) -> tuple[list[torch.Tensor], list[list[int]]]:
        """schedule -> run -> postprocess until no request is left (with lookahead, the next step is
        run before this one's tokens are read back). Episodes: after each step the engine applies
        episodes.poll's answers (EpisodeScheduler.resume); while an episode waits for its answer the
        loop goes on, and when no rank has rows to run it blocks in poll(wait=True)."""
        lps, lp_rows = [], []  # per step: logprobs on the device, and the request index of each (-1: discarded)
        taps = getattr(self.model, "taps", None)
        ahead_ok = self.config.lookahead and (taps is None or getattr(taps, "inert", False))
        pending: Launched | None = None  # a step enqueued whose tokens are not read back yet
        while True:
            if pending is not None:
                nxt = sched.lookahead(pending.step) if ahead_ok else None
                after = self._launch(runner, nxt, pending)[2] if nxt is not None else None
                lps.append(pending.logprobs)
                lp_rows.append(sched.postprocess(pending.step, pending.read_tokens()))
                pending = after
                if episodes is not None:
                    sched.resume(episodes.poll(False), in_flight=pending is not None)
                if pending is not None:
                    continue
            waiting = episodes is not None and sched.waiting()
            most, waits, pending = self._launch(runner, sched.schedule(), waiting=waiting)
            if most == 0 and not waits:
                break
            if waiting and pending is None:  # nothing in flight: the answers now, waiting for one if no rank ran rows
                sched.resume(episodes.poll(most == 0), in_flight=False)
        if episodes is not None and episodes.pending():
            raise RuntimeError(f"generate: every episode is over but Continuations.pending() is {episodes.pending()}")
        return lps, lp_rows

    def _launch(self, runner: ModelRunner, step: Step, previous: Launched | None = None, waiting: bool = False
                ) -> tuple[int, bool, Launched | None]:
        """Run `step`: (the most rows any rank's step holds, 0: nothing ran; whether any rank `waiting`
        for an episode's answer; the launched step or None). On one GPU the runner picks a graph or an
        eager step (ModelRunner.run). Under expert parallelism the ranks first agree on the step
        (Lockstep); when every rank's step is decode-only, the MoE all-to-all gets a fixed capacity from
        the agreed bucket and the step replays that bucket's graph (all ranks capture a missing one
        together); else (prompt chunks on any rank) it runs eagerly with exact sizes."""
        if self.lockstep is None:
            return len(step.rows), waiting, runner.run(step, previous) if step.rows else None
        most, decode_only, waits = self.lockstep.agree(len(step.rows), len(step.sample_at) == len(step.rows),
                                                       waiting)
        if most == 0:
            return 0, waits, None
        size = bucket(most) if decode_only else None
        set_step_rows(self.model, size)
        self.stats["fixed_capacity_steps"] += size is not None
        recapture = size is not None and runner.graphs is not None and self.lockstep.any(not runner.graphs.has(size))
        return most, waits, runner.run(step, previous, size, recapture, eager=size is None)

    def graphs_allowed(self) -> bool:
        """Graphs replay kernels, not Python: only with an op set that never syncs with the host (the
        Triton kernels on CUDA) and when no tap does host work (row fingerprints, per-op traces and
        injected faults run eagerly)."""
        taps, w = getattr(self.model, "taps", None), self.model.lm_head.weight
        if self.config.cuda_graphs and kernels.current()["mode"] == "default" and _default.graphs_missing(w):
            _default.fallback("engine steps", _default.graphs_missing(w), "eager steps")
        return (self.config.cuda_graphs and kernels.capturable(w)
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
            old.close()
            del old
        try:
            state = KVState(self.model.args, num_pages, ps, rows, width, dtype, dev, self.weights is not None)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"KV cache of {num_pages} pages x {ps} tokens does not fit on {dev}: lower generator.num_pages or "
                "generator.max_num_seqs"
            ) from e
        if keep:
            self.state = state
        return state

    def weights_stale(self) -> bool:
        return self.stale

    def resident_bytes(self) -> int:
        """Device memory resident in this engine's arenas (not counted by torch's allocator)."""
        arenas = [self.weights, self.state.arena if self.state is not None else None]
        return sum(a.nbytes for a in arenas if a is not None and a.resident)

    def load_weights(self) -> None:
        """The weights were written (weight sync writes the rank's model in place: same addresses, so
        kept decode graphs replay with the new values)."""
        self.stale = False

    def release_memory(self, weights: bool = True) -> None:
        """Give the engine's device memory back between steps. Releasable: the KV cache's memory and,
        with `weights`, the weights' (their addresses and the decode graphs are kept; released weights
        must be written again before the next generate); otherwise the KV cache and decode graphs are
        freed (the next call allocates and captures again)."""
        if self.weights is None:
            if self.state is not None:
                self.state.close()
            self.state = None
            return
        if self.state is not None:
            self.state.release()
        if weights:
            self.weights.release()
            self.stale = True
        self.released = True
        torch.cuda.empty_cache()  # what torch's allocator keeps for this process too

    def resume_memory(self) -> None:
        """Map the released memory back (the KV cache zeroed; the weights' contents undefined until a
        weight sync writes them). Without release: nothing to do."""
        if not self.released:
            return
        self.weights.resume()  # (nothing to do when the weights were kept)
        if self.state is not None:
            self.state.resume()
        self.released = False

    def close(self) -> None:
        if self.state is not None:
            self.state.close()
        self.state = None


def _weights_arena(model: Transformer) -> DeviceArena:
    """Move every parameter of `model` into one DeviceArena (same values; new addresses, before any
    graph is captured)."""
    params = list(model.parameters())
    nbytes = sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in params)
    arena = DeviceArena(nbytes, params[0].device)
    with torch.no_grad():
        for p in params:
            t = arena.tensor(tuple(p.shape), p.dtype)
            t.copy_(p.data)
            p.data = t
    torch.cuda.empty_cache()
    return arena


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
