"""One native-engine step on the model: the rows' inputs to the device, the forward (a decode
graph's replay or `Transformer.step`), and the sampling of the rows that sample."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlalign.model import Transformer
from rlalign.monitor.taps import TapRecorder, set_rows, tap
from rlalign.rollout.native.graphs import DecodeGraphs
from rlalign.rollout.native.pages import KVState
from rlalign.rollout.native.scheduler import Scheduler, Step
from rlalign.rollout.sampling import sample_next
from rlalign.sampling_params import SamplingParams


@dataclass
class Launched:
    """A step enqueued on the device: its samples' tokens and logprobs there, and the tokens' copy to
    the host in flight (the event to wait on; None off CUDA)."""

    step: Step
    tokens: torch.Tensor
    logprobs: torch.Tensor
    tokens_host: torch.Tensor
    copied: torch.cuda.Event | None

    def read_tokens(self) -> list[int]:
        """The step's tokens on the host: waits for this step only, not for steps enqueued after it."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.tokens_host.tolist()


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Host metadata to the device without a sync (pinned staging on CUDA)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """t's copy to the host, started now: (pinned host tensor, the event to wait on; None off CUDA)."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class ModelRunner:
    """Runs one call's steps on `model` over `state`'s pages; `graphs` (or None: eager) replays
    decode steps, and steps with prompt-chunk rows of up to `graph_rows` rows."""

    def __init__(self, model: Transformer, state: KVState, sched: Scheduler, sample_ids: list[int],
                 params: SamplingParams, graphs: DecodeGraphs | None, stats: dict, graph_rows: int = 0):
        self.model, self.state, self.sched, self.params, self.graphs = model, state, sched, params, graphs
        self.sample_ids, self.stats, self.graph_rows = sample_ids, stats, graph_rows
        self.dev = model.lm_head.weight.device
        taps = getattr(model, "taps", None)
        self.record_all = isinstance(taps, TapRecorder) and taps.rows

    def _meta(self, step: Step, ahead: int) -> np.ndarray:
        """[5, n] int64: each row's input token (0 for the first `ahead`: taken on the device), position,
        block-table row, KV slot and its sequence's sample id. Decode rows one by one; a prompt chunk's
        rows (step.runs: consecutive positions of one sequence) as array slices (a prefill step's 8,192
        rows without a Python loop)."""
        rows, n = step.rows, len(step.rows)
        meta = np.empty((5, n), dtype=np.int64)
        n_dec = step.runs[0][0] if step.runs else n
        dec = rows[:n_dec]
        if n_dec:
            meta[0, :n_dec] = [0] * ahead + [seq.tokens[p] for seq, p in dec[ahead:]]
            meta[1, :n_dec] = [p for _, p in dec]
            meta[2, :n_dec] = [seq.slot for seq, _ in dec]
            meta[3, :n_dec] = [self.sched.slot(seq, p) for seq, p in dec]
            meta[4, :n_dec] = [self.sample_ids[seq.b] for seq, _ in dec]
        ps = self.state.page_size
        for row0, cnt, pos0, table_row in step.runs:
            seq, span = rows[row0][0], slice(row0, row0 + cnt)
            pos = np.arange(pos0, pos0 + cnt, dtype=np.int64)
            meta[0, span] = seq.tokens[pos0:pos0 + cnt]
            meta[1, span] = pos
            meta[2, span] = table_row
            meta[3, span] = np.asarray(seq.pages, dtype=np.int64)[pos // ps] * ps + pos % ps
            meta[4, span] = self.sample_ids[seq.b]
        return meta

    def run(self, step: Step, previous: Launched | None = None, size: int | None = None, recapture: bool = False,
            eager: bool = False) -> Launched | None:
        """Enqueue `step` (its input tokens taken from `previous` on the device when step.follow is
        set); None when it samples nothing. Unless `eager`, a decode step, or a step with prompt-chunk
        rows of at most graph_rows rows, replays a graph (DecodeGraphs: `size`, `recapture`)."""
        rows, n, dev = step.rows, len(step.rows), self.dev
        self.stats["steps"] += 1
        self.stats["lookahead_steps"] += step.follow is not None
        ahead = 0 if step.follow is None else len(step.follow)  # the first rows' tokens come from `previous`
        meta = torch.from_numpy(self._meta(step, ahead))
        src = None if step.follow is None else to_device(torch.tensor(step.follow, dtype=torch.long), dev)
        if self.graphs is not None and not eager and (len(step.sample_at) == n or n <= self.graph_rows):
            return self._replay(step, meta, None if src is None else (previous.tokens, src), size, recapture)
        tokens, positions, seq_idx, slot_mapping, ids = to_device(meta, dev)
        if src is not None:
            tokens[:ahead] = previous.tokens.index_select(0, src)
        pick = self._sampling_rows(step)
        set_rows(self.model, "gen.step.", [(self.sample_ids[seq.b], p) for seq, p in rows])
        logits = self.model.step(tokens, positions, seq_idx, self.state.cache, self.state.block_table, slot_mapping,
                                 logit_rows=None if self.record_all else pick, runs=step.runs or None)
        if not step.sample_at:
            return None
        if self.record_all:
            logits = logits.index_select(0, pick)
        tok, lp = sample_next(logits, self.params, ids[pick], positions[pick] + 1,
                              lambda t: tap(self.model, "sample", t))
        return Launched(step, tok, lp, *to_host(tok))

    def _replay(self, step: Step, meta: torch.Tensor, follow: tuple[torch.Tensor, torch.Tensor] | None,
                size: int | None, recapture: bool) -> Launched | None:
        """`step` as a graph replay: every row fed as a decode row (a prompt chunk's rows draw with their
        sequence's sample id at their position + 1, as the row that samples does), then the samples of
        step.sample_at's rows kept, in its order; the other rows' draws are discarded."""
        tok, lp = self.graphs(meta, follow, size, recapture)
        self.stats["graph_steps"] += 1
        self.stats["mixed_graph_steps"] += bool(step.runs)
        if len(step.sample_at) < len(step.rows):  # prompt rows that do not sample
            if not step.sample_at:
                return None
            pick = self._sampling_rows(step)
            tok, lp = tok.index_select(0, pick), lp.index_select(0, pick)
        return Launched(step, tok, lp, *to_host(tok))

    def _sampling_rows(self, step: Step) -> torch.Tensor:
        """The rows of `step` that sample (step.sample_at's order), on the device."""
        return to_device(torch.tensor([r for _, r in step.sample_at], dtype=torch.long), self.dev)
