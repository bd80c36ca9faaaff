"""CUDA graphs of the native engine's steps: decode steps, and steps with prompt-chunk rows of up to
`graph_rows` rows (an episode's observation prefilled beside decode rows), every row run as a decode row."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from rlalign import kernels
from rlalign.model import PagedKVCache, Transformer
from rlalign.rollout.sampling import GRAPH_SEED, rekey_sample_ids, sample_next
from rlalign.sampling_params import SamplingParams


def graph_inputs(model: Transformer) -> tuple:
    """What a captured step reads by address or has baked in, apart from the engine's own buffers:
    every parameter and buffer (address, shape, strides, dtype), the rope table and the op set.
    Weight sync copies into the same tensors (weight_sync.receive):
    the signature holds and the graphs replay with the new values; a rebound or moved parameter
    changes it and the graphs are captured again."""
    ts = itertools.chain(model.named_parameters(), model.named_buffers(),
                         enumerate(getattr(model, "_rope_table", ())))
    return (tuple(sorted(kernels.current().items())),
            *((n, t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride()) for n, t in ts))


def kernel_buffers() -> list:
    """Device buffers that the Triton wrappers keep in module-level caches (work tables, launch
    plans, the split-K ticket counters): a graph reads them by address, so the graphs hold a
    reference to each, and an LRU eviction or a regrown buffer cannot free memory a graph still reads."""
    try:
        from rlalign.kernels import triton as triton_kernels
    except ImportError:  # no Triton: no graphs either
        return []
    return triton_kernels.cached_state()


def bucket(n: int) -> int:
    """The batch-size bucket (graph size) of a step of n rows: the next power of two."""
    return 1 << max(0, (n - 1).bit_length())


MIXED_ROWS_PER_SEQ = 8  # graph_rows: rows of a step with prompt chunks that replays, per sequence in flight
MIXED_ROWS_MAX = 2048  # ... but at most this many, or the decode bucket where that is larger (the graph pool: below)


def graph_rows(max_seqs: int) -> int:
    """The most rows of a step with prompt-chunk rows that replays a graph, for `max_seqs` sequences in flight:
    MIXED_ROWS_PER_SEQ per sequence, up to MIXED_ROWS_MAX, never below the decode step's bucket.
    A replay of n rows costs a decode step of bucket(n) rows (every row's logits and draw, per-row attention);
    an eager step pays the host's launch of every kernel on top of its work, which dominates the small steps
    where an episode's observation joins the decode rows. Steps above it (a first prefill of many prompts, its
    chunks of generator.max_num_batched_tokens rows) run eagerly: their work dominates, their prompt chunks
    run as prefill tiles, and no graph is captured for their size. The bound keeps the graph pool small: a
    graph holds every row's logits, 1.2 GB of fp32 at 2,048 rows and a vocabulary of 152 k."""
    decode = bucket(max_seqs)
    return max(decode, min(MIXED_ROWS_PER_SEQ * decode, MIXED_ROWS_MAX))


class DecodeGraphs:
    """CUDA graphs of engine steps whose every row runs as a decode row — `Transformer.step` without
    the prompt-chunk hint, and `sample_next` of every row — one per batch-size bucket (powers of two)
    and sampling distribution, captured on first use and kept with the engine's KVState across
    generate() calls. A step of n rows runs the smallest bucket >= n; the padding rows read and write
    only a spare page through a spare block-table row and sample from a fixed row (Transformer._head's keep:
    one value above zeros, the samplers' cheapest row), and batch invariance means they change no bit of the
    real rows (tests/gpu checks graphs == eager bitwise).
    A prompt chunk's rows run as rows alone (kernels.attention_paged: the bits of its prefill tiles),
    write their keys and values as eagerly, and draw a sample the caller discards unless the row
    samples (ModelRunner). Inputs per row: token, position, block-table row, cache slot, valid flag,
    sample id rekeyed to GRAPH_SEED (rekey_sample_ids), so the seed is not baked in.
    `begin(model, params)` starts a call; its first replayed step re-checks what the graphs read
    (`graph_inputs`) and drops them all if that changed."""

    def __init__(self, cache: PagedKVCache, block_table: torch.Tensor, pad_row: int, pad_slot: int):
        self.cache, self.block_table = cache, block_table
        self.pad_row, self.pad_slot = pad_row, pad_slot
        self.by_params: dict[tuple, dict] = {}  # SamplingParams.graph_key() -> {bucket: entry}
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
        """At a call's first replayed step: drop every graph if what they read changed since they were
        captured, then pick this call's sampling distribution's graphs. The rope table is moved to the
        device first (a call whose first step replays has run no eager step to move it)."""
        self.model.rope_table_to(self.model.lm_head.weight.device)
        inputs = graph_inputs(self.model)
        if inputs != self.inputs:  # new weights' addresses, a moved model, another op set: capture again
            self.by_params.clear()
            self.keep.clear()
            self.pool = None  # a new memory pool with the next capture
            self.inputs = inputs
        self.graphs = self.by_params.setdefault(self.params.graph_key(), {})
        self._checked = True

    def end(self) -> None:
        self.model = None

    def host_rows(self, meta: torch.Tensor, size: int) -> torch.Tensor:
        """The host rows a replay of `size` rows reads for meta [5, n] (token, position, block-table row, slot,
        sample id): each row valid, its sample id rekeyed, padding rows past n."""
        valid = torch.ones(1, meta.shape[1], dtype=torch.long)
        return self._pad(torch.cat([meta[:4], valid, meta[4:] ^ self._key]), size)

    def _pad(self, meta: torch.Tensor, size: int) -> torch.Tensor:
        pad = torch.tensor([[0], [0], [self.pad_row], [self.pad_slot], [0], [0]], dtype=torch.long)
        pad = pad.expand(6, size - meta.shape[1])
        return torch.cat([meta, pad], 1)

    def _run(self, static: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions, seq_idx, slots, valid, ids = static
        logits = self.model.step(tokens, positions, seq_idx, self.cache, self.block_table, slots, keep=valid > 0)
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
        self.keep.update((id(v), v) for v in kernel_buffers())
        self.captures += 1
        return graph, static, out

    def has(self, size: int) -> bool:
        """Whether this call's distribution has a graph of `size` rows captured."""
        if not self._checked:
            self._check()
        return size in self.graphs

    def __call__(self, meta: torch.Tensor, follow: tuple[torch.Tensor, torch.Tensor] | None = None,
                 size: int | None = None, recapture: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """meta [5, n] (token, position, block-table row, slot, sample id) -> every row's token and
        logprob [n] on the device (copied out of the graph's memory, which a later replay overwrites).
        follow = (tokens, index [f]): the first f rows' input tokens are tokens[index], already on the device.
        size: the graph to replay (default: bucket(n)); recapture: capture it again even if it is there
        (expert parallelism: a capture's warm-up runs the collectives, so all ranks capture together)."""
        if not self._checked:
            self._check()
        n = meta.shape[1]
        size = size or bucket(n)
        if recapture or size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, static, (tok, lp) = self.graphs[size]
        static.copy_(self.host_rows(meta, size).pin_memory(), non_blocking=True)
        if follow is not None:
            static[0, : follow[1].shape[0]] = follow[0].index_select(0, follow[1])
        graph.replay()
        return tok[:n].clone(), lp[:n].clone()
