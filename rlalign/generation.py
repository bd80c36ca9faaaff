"""Native generator: a continuous-batching engine over a paged KV cache, on the same model and
ops as the trainer.

Each step is one `Transformer.step` over a mix of rows: one per decoding sequence, then prompt
chunks of newly admitted sequences within a token budget. A finished sequence frees its slot and
pages at once and the next queued request takes them. Batch invariance is what lets the schedule
vary freely: a row's bits depend only on its sequence, never on what shares its step, how its
prompt was chunked, or which pages hold its keys, so every schedule samples the same tokens with
the same logprob bits, equal to the trainer's rescoring. The token at absolute position p of
sample s is drawn with noise that depends only on (seed, s, p) (kernels.sampling), and its
logprob is `kernels.token_logprobs` of the logits it was sampled from: the function the trainer
applies when it rescores the finished sequence.

On CUDA with the Triton op set, decode-only steps replay CUDA graphs (_DecodeGraphs). The KV cache,
block table and graphs stay on the model between calls (_EngineState; an RL run calls generate()
once per step and captures nothing after its first), valid while the parameters keep their
addresses (weight sync copies into them). With lookahead the next decode step is enqueued before
this step's tokens are read back, so the GPU does not wait for the host's bookkeeping.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from rlalign import kernels
from rlalign.model import PagedKVCache, Transformer
from rlalign.monitor.taps import TapRecorder, set_rows, tap


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    eos_token_id: int | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"generator.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"generator.temperature={self.temperature}: sampling needs a temperature > 0 "
                "(set generator.greedy=true for argmax decoding)"
            )
        if self.top_k < 0:
            raise ValueError(f"generator.top_k={self.top_k}: must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"generator.top_p={self.top_p}: must be in (0, 1]")

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature

    def logprob_kwargs(self) -> dict:
        """What kernels.token_logprobs needs to score tokens under the distribution they were
        sampled from: the generator uses it while sampling, the trainer while rescoring."""
        return {"temperature": self.logprob_temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass
class Rollout:
    sample_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: torch.Tensor | None = None  # [len(tokens)] fp32, the generator's
    finish_reason: str = ""  # "eos" | "length"


@dataclass
class EngineConfig:
    """The native engine's schedule (generator.* keys). None of it changes a token or a bit."""

    max_num_seqs: int = 0  # sequences in flight at once; 0 = every request at once
    max_num_batched_tokens: int = 8192  # rows per step (decode rows first, then prompt chunks); 0 = no limit
    page_size: int = 16  # token slots per KV page
    num_pages: int = 0  # KV pages; 0 = enough for max_num_seqs sequences at their longest
    cuda_graphs: bool = True  # on CUDA, decode-only steps replay graphs captured per batch-size bucket
    # keep the KV cache, block table and captured decode graphs on the model between generate() calls (reused while
    # they fit; an RL run calls generate() once per step); clear_engine_state(model) releases them
    keep_state: bool = True
    # enqueue the next decode step before reading this one's tokens back (no GPU idle for the host's bookkeeping)
    lookahead: bool = True

    def validate(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "num_pages"):
            if getattr(self, key) < 0:
                raise ValueError(f"generator.{key}={getattr(self, key)}: must be >= 0 (0 = automatic)")
        if self.page_size < 1:
            raise ValueError(f"generator.page_size={self.page_size}: must be >= 1")
        if self.max_num_batched_tokens and self.max_num_seqs and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"generator.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"generator.max_num_seqs={self.max_num_seqs}: every decoding sequence needs one row per step"
            )


@dataclass
class _Seq:
    """A request in flight: its tokens so far (prompt + sampled), how many have keys/values in the
    cache, its row of the block table and its pages."""

    b: int  # index into the caller's lists
    tokens: list[int]
    n_prompt: int
    slot: int
    pages: list[int]
    n_cached: int = 0
    done: bool = False  # ended (EOS or length): its slot and pages are free

    @property
    def decoding(self) -> bool:
        return self.n_cached >= self.n_prompt


_M64 = (1 << 64) - 1
GRAPH_SEED = 0  # the seed the decode graphs are captured with; a call's own seed enters through rekeyed sample ids


def rekey_sample_ids(sample_ids: torch.Tensor, seed: int, base: int = GRAPH_SEED) -> torch.Tensor:
    """Sample ids that draw, under seed `base`, exactly the noise `sample_ids` draw under `seed`. The noise
    hash starts h = mix64(mix64(seed) ^ sample_id) (kernels.sampling.uniform, the Triton gumbel_argmax):
    with id' = id ^ mix64(seed) ^ mix64(base), mix64(base) ^ id' = mix64(seed) ^ id bit for bit. So a graph
    captured once with `base` as a kernel argument samples any seed from ids copied in each step
    (tests/test_engine.py checks the identity on the hash and on the sampled tokens)."""
    s64 = [(c & _M64) - (1 << 64) if c & _M64 >= 1 << 63 else c & _M64 for c in (seed, base)]  # the kernels' int64 seed
    mix = kernels.sampling.mix64(torch.tensor(s64, dtype=torch.long))
    return sample_ids.long() ^ (mix[0] ^ mix[1]).to(sample_ids.device)


def _graph_inputs(model: Transformer) -> tuple:
    """What a captured step reads by address or has baked in, apart from the engine's own buffers:
    every parameter and buffer (address, shape, strides, dtype), the rope table and the op set.
    Weight sync copies into the same tensors (GeneratorWorker.load_weights, weight_sync.receive):
    the signature holds and the graphs replay with the new values; a rebound or moved parameter
    changes it and the graphs are captured again."""
    ts = itertools.chain(model.named_parameters(), model.named_buffers(),
                         enumerate(getattr(model, "_rope_table", ())))
    return (tuple(sorted(kernels.current().items())),
            *((n, t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride()) for n, t in ts))


def _kernel_buffers() -> list:
    """Device buffers that the Triton wrappers keep in module-level caches (work tables, launch
    plans, the split-K ticket counters): a graph reads them by address, so the graphs hold a
    reference to each, and an LRU eviction or a regrown buffer cannot free memory a graph still reads."""
    try:
        from rlalign.kernels.triton import attention, common
    except ImportError:  # no Triton: no graphs either
        return []
    return [*common._CACHE.values(), *attention._TICKETS.values()]


class _DecodeGraphs:
    """CUDA graphs of decode-only engine steps — `Transformer.step` and `sample_next` — one per
    batch-size bucket (powers of two) and sampling distribution, captured on first use and kept
    with the engine state across generate() calls. A step of n rows runs the smallest bucket >= n;
    the padding rows read and write only a spare page through a spare block-table row and sample
    from zeroed logits, and batch invariance means they change no bit of the real rows (tests/gpu
    checks graphs == eager bitwise). Inputs per row: token, position, block-table row, cache slot,
    valid flag, sample id rekeyed to GRAPH_SEED (rekey_sample_ids), so the seed is not baked in.
    `begin(model, params)` starts a call; its first decode step re-checks what the graphs read
    (`_graph_inputs`) and drops them all if that changed."""

    def __init__(self, cache: PagedKVCache, block_table: torch.Tensor, pad_row: int, pad_slot: int):
        self.cache, self.block_table = cache, block_table
        self.pad_row, self.pad_slot = pad_row, pad_slot
        self.by_params: dict[tuple, dict] = {}  # (temperature, top_k, top_p, greedy) -> {bucket: entry}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.inputs: tuple | None = None
        self.keep: dict[int, object] = {}
        self.model: Transformer | None = None  # during a call only (the state must not keep the model alive)
        self.params = SamplingParams()
        self.captures = 0  # graphs captured so far (tests, benchmarks)
        self.pool = None
        self._checked, self._key = False, torch.zeros(1, dtype=torch.long)

    def begin(self, model: Transformer, params: SamplingParams) -> None:
        self.model, self.params, self._checked = model, params, False
        self._key = rekey_sample_ids(torch.zeros(1, dtype=torch.long), params.seed)

    def _check(self) -> None:
        """At a call's first decode step (after its prefill moved the rope table to the device):
        drop every graph if what they read changed since they were captured, then pick this call's
        sampling distribution's graphs."""
        inputs = _graph_inputs(self.model)
        if inputs != self.inputs:  # new weights' addresses, a moved model, another op set: capture again
            self.by_params.clear()
            self.keep.clear()
            self.pool = None  # a new memory pool with the next capture
            self.inputs = inputs
        p = self.params
        self.graphs = self.by_params.setdefault((p.logprob_temperature, p.top_k, p.top_p, p.greedy), {})
        self._checked = True

    def end(self) -> None:
        self.model = None

    def _pad(self, meta: torch.Tensor, size: int) -> torch.Tensor:
        pad = torch.tensor([[0], [0], [self.pad_row], [self.pad_slot], [0], [0]], dtype=torch.long)
        pad = pad.expand(6, size - meta.shape[1])
        return torch.cat([meta, pad], 1)

    def _run(self, static: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions, seq_idx, slots, valid, ids = static
        logits = self.model.step(tokens, positions, seq_idx, self.cache, self.block_table, slots)
        logits = torch.where((valid > 0)[:, None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
        # the call's own distribution (every field the eager path uses), the seed moved into the ids
        return sample_next(logits, dataclasses.replace(self.params, seed=GRAPH_SEED), ids, positions + 1)

    def _capture(self, size: int):
        static = self._pad(torch.zeros(6, 0, dtype=torch.long), size).to(self.block_table.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(static)  # warm-up (Triton compiles, launch plans fill) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(static)
        self.keep.update((id(v), v) for v in _kernel_buffers())
        self.captures += 1
        return graph, static, out

    def __call__(self, meta: torch.Tensor, follow: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """meta [5, n] (token, position, block-table row, slot, sample id) -> this step's tokens and
        logprobs [n] on the device (copied out of the graph's memory, which a later replay overwrites).
        follow = (tokens, index [n]): the rows' input tokens are tokens[index], already on the device."""
        if not self._checked:
            self._check()
        n = meta.shape[1]
        size = 1 << max(0, (n - 1).bit_length())
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, static, (tok, lp) = self.graphs[size]
        rows = torch.cat([meta[:4], torch.ones(1, n, dtype=torch.long), meta[4:] ^ self._key])
        static.copy_(self._pad(rows, size).pin_memory(), non_blocking=True)
        if follow is not None:
            static[0, :n] = follow[0].index_select(0, follow[1])
        graph.replay()
        return tok[:n].clone(), lp[:n].clone()


class _EngineState:
    """What generate() keeps between calls on one model (EngineConfig.keep_state): the paged KV cache
    (`num_pages` pages and one spare), the block table (`rows` slot rows and one spare, `width`
    pages per row) on the device with its host mirror, and the decode graphs captured over them.
    A call reuses it when its pages, slots, width, page size, dtype and device fit; else it is
    replaced (its graphs with it). Stale keys and table entries left by earlier calls are never
    read: a row attends only positions its own sequence wrote in this call."""

    def __init__(self, args, num_pages: int, page_size: int, rows: int, width: int, dtype, dev):
        self.cache = PagedKVCache(args, num_pages + 1, page_size, dtype, dev)
        self.num_pages, self.page_size, self.rows, self.width = num_pages, page_size, rows, width
        self.table_host = torch.full((rows + 1, width), num_pages, dtype=torch.int32)
        self.block_table = self.table_host.to(dev)
        self.graphs: _DecodeGraphs | None = None
        self.busy = False
        self.stats: dict = {}  # the last call's: steps, lookahead_steps, discarded_rows

    def fits(self, num_pages: int, page_size: int, rows: int, width: int, dtype, dev) -> bool:
        return (not self.busy and self.page_size == page_size and self.num_pages >= num_pages and self.rows >= rows
                and self.width >= width and self.cache.k.dtype == dtype and self.cache.k.device == torch.device(dev))

    def decode_graphs(self) -> _DecodeGraphs:
        if self.graphs is None:
            self.graphs = _DecodeGraphs(self.cache, self.block_table, self.rows, self.num_pages * self.page_size)
        return self.graphs


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _EngineState


def engine_state(model: Transformer) -> _EngineState | None:
    """The engine state generate() keeps on `model` (None if none)."""
    return _STATES.get(model)


def clear_engine_state(model: Transformer) -> None:
    """Release the KV cache and decode graphs kept on `model` (the next generate() allocates and captures again)."""
    _STATES.pop(model, None)


def _grow(need: int, have: int) -> int:
    """Capacity for `need` when `have` is too small: `need` rounded up to 1/16 of its power of two
    (at most ~6 % spare), so that calls that need a little more than the last one reuse the state."""
    if need <= have:
        return have
    step = max(1, (1 << max(0, need.bit_length() - 1)) // 16)
    return -(-need // step) * step


def _state_for(model: Transformer, engine: EngineConfig, num_pages: int, rows: int, width: int,
               dev) -> _EngineState:
    """This call's engine state: the kept one if it fits, else a new one (kept if engine.keep_state)."""
    ps, dtype = engine.page_size, model.dtype
    old = _STATES.get(model) if engine.keep_state else None
    if old is not None and old.fits(num_pages, ps, rows, width, dtype, dev):
        return old
    if engine.keep_state and old is not None and not old.busy:
        del _STATES[model]  # free the old cache and graphs before allocating the new ones
        same = old.page_size == ps and old.cache.k.dtype == dtype
        num_pages = _grow(num_pages, old.num_pages if same else 0)
        rows, width = max(rows, old.rows if same else 0), max(width, old.width if same else 0)
        del old
    try:
        state = _EngineState(model.args, num_pages, ps, rows, width, dtype, dev)
    except torch.OutOfMemoryError as e:
        raise RuntimeError(
            f"KV cache of {num_pages} pages x {ps} tokens does not fit on {dev}: lower generator.num_pages or "
            "generator.max_num_seqs"
        ) from e
    if engine.keep_state and model not in _STATES:
        _STATES[model] = state
    return state


def graphs_allowed(model: Transformer, engine: EngineConfig) -> bool:
    """Graphs replay kernels, not Python: only with an op set that never syncs with the host (the
    Triton kernels on CUDA) and when no tap does host work (row fingerprints, per-op traces and
    injected faults run eagerly)."""
    taps = getattr(model, "taps", None)
    return (engine.cuda_graphs and kernels.capturable(model.lm_head.weight)
            and (taps is None or getattr(taps, "inert", False)))


def check_prompts(model: Transformer, prompts: list[list[int]], sample_ids: list[int], max_new: int) -> None:
    if len(prompts) != len(sample_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(sample_ids)} sample ids")
    if len(set(sample_ids)) != len(sample_ids):
        raise ValueError("sample ids must be unique: they seed each sample's noise")
    a = model.args
    for p, sid in zip(prompts, sample_ids):
        if not p:
            raise ValueError(f"prompt of sample {sid} is empty")
        if len(p) + max_new > a.max_position_embeddings:
            raise ValueError(
                f"prompt of sample {sid} has {len(p)} tokens; with max_new_tokens={max_new} it exceeds "
                f"the model's context of {a.max_position_embeddings} positions"
            )
        bad = [t for t in p if not 0 <= t < a.vocab_size]
        if bad:
            raise ValueError(f"prompt of sample {sid} has token id {bad[0]} outside [0, {a.vocab_size})")


def sample_next(logits: torch.Tensor, params: SamplingParams, sample_ids: torch.Tensor, positions: torch.Tensor,
                tap_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens at absolute `positions` [B] drawn from logits [B, V], and their fp32 logprobs
    under the distribution they were drawn from: the one sampling step of both engines (this one
    and vLLM's logits processor, rlalign/vllm_engine/sampler.py)."""
    z = kernels.tempered(logits, **params.logprob_kwargs())  # once: the tokens' distribution
    tok = kernels.sample_tempered(z, params.seed, sample_ids, positions, greedy=params.greedy)
    if tap_fn is not None:
        tok = tap_fn(tok)
    return tok, kernels.tempered_logprobs(z, tok)


def _to(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Host metadata to the device without a sync (pinned staging on CUDA)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """t's copy to the host, started now: (pinned host tensor, the event to wait on; None off CUDA).
    Waiting on the event rather than reading t waits for this step alone, not for steps enqueued after it."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    sample_ids: list[int],
    params: SamplingParams,
    any_live: Callable[[bool], bool] | None = None,
    engine: EngineConfig | None = None,
) -> list[Rollout]:
    """Sample continuations of `prompts` (continuous batching; `engine` sets the schedule).
    `any_live(local_live)` (expert parallelism) returns whether any rank still has work; a rank
    with nothing left keeps stepping with empty batches so that collectives inside the model stay
    in lockstep."""
    params.validate()
    engine = engine or EngineConfig()
    engine.validate()
    if not prompts and any_live is None:
        raise ValueError("generate: empty prompt batch")
    check_prompts(model, prompts, sample_ids, params.max_new_tokens)
    dev = model.lm_head.weight.device
    B = len(prompts)
    ps = engine.page_size
    pages_of = [-(-(len(p) + params.max_new_tokens) // ps) for p in prompts]  # at the longest
    width = max(pages_of, default=1)
    max_seqs = min(engine.max_num_seqs or B, B) or 1
    num_pages = engine.num_pages or max(1, sum(sorted(pages_of, reverse=True)[:max_seqs]))
    for b, n in enumerate(pages_of):
        if n > num_pages:
            raise ValueError(
                f"sample {sample_ids[b]}: prompt of {len(prompts[b])} tokens + max_new_tokens={params.max_new_tokens} "
                f"needs {n} KV pages of {ps} tokens; the cache has {num_pages} (raise generator.num_pages or "
                "lower generator.max_new_tokens)"
            )
    # the paged KV cache (one spare page and block-table row: where CUDA-graph padding rows read and write),
    # kept on the model between calls (EngineConfig.keep_state)
    state = _state_for(model, engine, num_pages, max_seqs, width, dev)
    cache, block_table, table_host = state.cache, state.block_table, state.table_host
    graphs = state.decode_graphs() if graphs_allowed(model, engine) and any_live is None else None
    state.busy = True
    try:
        if graphs is not None:
            graphs.begin(model, params)
        state.stats = {"steps": 0, "lookahead_steps": 0, "discarded_rows": 0}
        return _generate(model, prompts, sample_ids, params, any_live, engine, cache, block_table, table_host, graphs,
                         num_pages, max_seqs, pages_of, state.stats)
    finally:
        state.busy = False
        if graphs is not None:
            graphs.end()


def _generate(model, prompts, sample_ids, params, any_live, engine, cache, block_table, table_host, graphs,
              num_pages, max_seqs, pages_of, stats: dict) -> list[Rollout]:
    dev = model.lm_head.weight.device
    B, ps = len(prompts), engine.page_size
    budget = engine.max_num_batched_tokens or float("inf")
    free_pages, free_slots = list(range(num_pages - 1, -1, -1)), list(range(max_seqs - 1, -1, -1))
    queue, running = deque(range(B)), []
    out = [Rollout(s, list(p)) for s, p in zip(sample_ids, prompts)]
    ids_all = torch.tensor(sample_ids, dtype=torch.long, device=dev)
    lps, lp_rows = [], []  # per step: logprobs on the device, and the request index of each (-1: discarded)
    taps = getattr(model, "taps", None)
    record_all = isinstance(taps, TapRecorder) and taps.rows
    # lookahead: the next decode step is enqueued before this one's tokens are read back (see _ahead)
    ahead_ok = engine.lookahead and any_live is None and (taps is None or getattr(taps, "inert", False))

    def slot(seq: _Seq, p: int) -> int:
        return seq.pages[p // ps] * ps + p % ps

    def step(rows: list, sample_at: list, follow: tuple | None = None):
        """Enqueue one engine step over `rows` (seq, position); -> (sample_at, tokens, logprobs on the
        device, the tokens' host copy in flight), or None when it samples nothing. follow = (previous
        step's tokens, index [n]): a decode step whose input tokens are the previous step's, still on
        the device."""
        n = len(rows)
        stats["steps"] += 1
        stats["lookahead_steps"] += follow is not None
        tok_host = [0] * n if follow is not None else [seq.tokens[p] for seq, p in rows]
        meta = torch.tensor([tok_host, [p for _, p in rows], [seq.slot for seq, _ in rows],
                             [slot(seq, p) for seq, p in rows]], dtype=torch.long).reshape(4, n)
        b_idx = [seq.b for seq, _ in sample_at]
        src = None if follow is None else _to(torch.tensor(follow[1], dtype=torch.long), dev)
        if graphs is not None and len(sample_at) == n:  # decode only: rows are the samples, in order
            ids = torch.tensor([sample_ids[b] for b in b_idx], dtype=torch.long)
            meta = torch.cat([meta, ids[None]])
            tok, lp = graphs(meta) if follow is None else graphs(meta, (follow[0], src))
            return sample_at, tok, lp, _to_host(tok)
        tokens, positions, seq_idx, slot_mapping = _to(meta, dev)
        if follow is not None:
            tokens = follow[0].index_select(0, src)
        pick = _to(torch.tensor([r for _, r in sample_at], dtype=torch.long), dev)
        set_rows(model, "gen.step.", [(sample_ids[seq.b], p) for seq, p in rows])
        logits = model.step(tokens, positions, seq_idx, cache, block_table, slot_mapping,
                            logit_rows=None if record_all else pick)
        if not sample_at:
            return None
        if record_all:
            logits = logits.index_select(0, pick)
        b_dev = _to(torch.tensor(b_idx, dtype=torch.long), dev)
        tok, lp = sample_next(logits, params, ids_all[b_dev], positions[pick] + 1, lambda t: tap(model, "sample", t))
        return sample_at, tok, lp, _to_host(tok)

    def _ahead(pending):
        """The decode step after `pending`, enqueued before pending's tokens are read back (the GPU
        never waits for the host's bookkeeping): the rows of pending's samples whose sequences go
        on, each at the position of the token pending samples for it, that token taken on the device.
        Only when the next step could hold nothing else: no request could be admitted and no prompt
        is still being prefilled. A sequence that pending ends with EOS (not known yet) still gets a
        row here: it reads and writes only its own pages at a position below its length limit, and
        its sample is discarded (its pages are freed after this step in stream order). Sequences that
        pending ends by length are left out. Every kept row computes what the step after reading
        pending back would compute for it: the same tokens and logprob bits (batch invariance)."""
        if not ahead_ok or (queue and free_slots and len(free_pages) >= pages_of[queue[0]]):
            return None
        if any(not seq.decoding for seq in running):
            return None
        sample_at, tok, _, _ = pending
        rows, src = [], []
        for j, (seq, _) in enumerate(sample_at):
            if seq.done or len(out[seq.b].tokens) + 1 >= params.max_new_tokens:
                continue
            rows.append((seq, len(seq.tokens)))
            src.append(j)
        if not rows:
            return None
        return step(rows, [(seq, i) for i, (seq, _) in enumerate(rows)], (tok, src))

    def read_back(pending) -> None:
        """Pending's tokens to the host (the step's one host sync) and the bookkeeping: tokens appended,
        finished sequences' slots and pages freed (the next step admits from the queue)."""
        sample_at, _, lp, (tok_host, copied) = pending
        if copied is not None:
            copied.synchronize()  # this step's tokens only: the step enqueued after it keeps the GPU busy
        finished, b_idx = [], []
        for (seq, _), t in zip(sample_at, tok_host.tolist()):
            if seq.done:  # a lookahead row of a sequence that had already ended: discarded
                stats["discarded_rows"] += 1
                b_idx.append(-1)
                continue
            b_idx.append(seq.b)
            seq.tokens.append(t)
            o = out[seq.b]
            o.tokens.append(t)
            if params.eos_token_id is not None and t == params.eos_token_id:
                o.finish_reason = "eos"
            elif len(o.tokens) == params.max_new_tokens:
                o.finish_reason = "length"
            else:
                continue
            seq.done = True
            finished.append(seq)
        lps.append(lp)
        lp_rows.append(b_idx)
        for seq in finished:
            running.remove(seq)
            free_slots.append(seq.slot)
            free_pages.extend(reversed(seq.pages))

    pending = None  # a step enqueued whose tokens are not read back yet
    while True:
        if pending is not None:
            nxt = _ahead(pending)
            read_back(pending)
            pending = nxt
            if pending is not None:
                continue
        while queue and free_slots and len(free_pages) >= pages_of[queue[0]]:  # admit in order
            b = queue.popleft()
            seq = _Seq(b, list(prompts[b]), len(prompts[b]), free_slots.pop(),
                       [free_pages.pop() for _ in range(pages_of[b])])
            table_host[seq.slot, : len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
            block_table[seq.slot].copy_(table_host[seq.slot])
            running.append(seq)
        rows, sample_at = [], []  # rows: (seq, position); sample_at: (seq, row index)
        for seq in running:  # decode rows first: one each
            if seq.decoding:
                sample_at.append((seq, len(rows)))
                rows.append((seq, len(seq.tokens) - 1))
        for seq in running:  # then prompt chunks, in admission order, within the budget
            n = int(min(budget - len(rows), seq.n_prompt - seq.n_cached)) if not seq.decoding else 0
            if n > 0:
                rows.extend((seq, p) for p in range(seq.n_cached, seq.n_cached + n))
                seq.n_cached += n
                if seq.decoding:
                    sample_at.append((seq, len(rows) - 1))
        if any_live is not None:
            if not any_live(bool(rows)):
                break
        elif not rows:
            break
        pending = step(rows, sample_at)
    return _assemble(out, lps, lp_rows)


def _assemble(out: list[Rollout], lps: list[torch.Tensor], lp_rows: list[list[int]]) -> list[Rollout]:
    """Each request's logprobs, in step order, from the steps' device tensors (one copy to the host)."""
    B = len(out)
    flat = torch.cat(lps).float().cpu().numpy() if lps else np.zeros(0, np.float32)
    rows = np.fromiter(itertools.chain.from_iterable(lp_rows), dtype=np.int64, count=len(flat))
    keep = rows >= 0
    rows, flat = rows[keep], flat[keep]
    order = np.argsort(rows, kind="stable")  # by request, step order within one
    parts = np.split(flat[order], np.cumsum(np.bincount(rows, minlength=B))[:-1])
    for o, part in zip(out, parts):
        o.logprobs = torch.from_numpy(part.copy())  # its own storage (a view would pickle the whole batch)
    return out
