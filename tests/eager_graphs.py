"""The native engine's graph path on CPU (tests' double for CUDA graphs): DecodeGraphs whose "capture"
keeps the step's computation (`DecodeGraphs._run` over the graph's static inputs) and whose replay runs
it eagerly into the captured outputs. Everything else is the product's: which steps replay
(ModelRunner.run), their inputs (padding, rekeyed sample ids, lookahead tokens taken on the device),
the picking of the sampled rows, the graphs kept per bucket and distribution."""

from __future__ import annotations

import torch

from rlalign.rollout.native.engine import NativeEngine
from rlalign.rollout.native.graphs import DecodeGraphs
from rlalign.rollout.native.pages import KVState


class Replay:
    def __init__(self, graphs: DecodeGraphs, static: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]):
        self.graphs, self.static, self.out = graphs, static, out

    def replay(self) -> None:
        for o, r in zip(self.out, self.graphs._run(self.static)):
            o.copy_(r)


class EagerGraphs(DecodeGraphs):
    def _capture(self, size: int):
        static = self._pad(torch.zeros(6, 0, dtype=torch.long), size)
        out = self._run(static)
        self.captures += 1
        return Replay(self, static, out), static, out


def use_eager_graphs(monkeypatch) -> None:
    """NativeEngine replays graphs on CPU (EagerGraphs); host copies skip pinning (no accelerator)."""
    monkeypatch.setattr(NativeEngine, "graphs_allowed", lambda self: True)
    monkeypatch.setattr(KVState, "decode_graphs", lambda self: self.graphs or _keep(self))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)


def _keep(state: KVState) -> EagerGraphs:
    state.graphs = EagerGraphs(state.cache, state.block_table, state.rows, state.num_pages * state.page_size)
    return state.graphs
