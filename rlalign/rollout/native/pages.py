"""The KV cache and block table a NativeEngine keeps between generate() calls."""

from __future__ import annotations

import torch

from rlalign.model import PagedKVCache
from rlalign.rollout.native.arena import ALIGN, DeviceArena
from rlalign.rollout.native.graphs import DecodeGraphs


class KVState:
    """The paged KV cache (`num_pages` pages and one spare), the block table (`rows` slot rows and
    one spare, `width` pages per row) on the device with its host mirror, and the decode graphs
    captured over them. A call reuses it when its pages, slots, width, page size, dtype and device
    fit; else it is replaced (its graphs with it). Stale keys and table entries left by earlier
    calls are never read: a row attends only positions its own sequence wrote in this call. The
    spare page and row are where CUDA-graph padding rows read and write."""

    def __init__(self, args, num_pages: int, page_size: int, rows: int, width: int, dtype, dev,
                 releasable: bool = False):
        self.arena = None  # releasable: the pages in a DeviceArena (release/resume keep their addresses)
        if releasable:
            per = args.num_layers * (num_pages + 1) * page_size * args.num_kv_heads * args.head_dim * dtype.itemsize
            self.arena = DeviceArena(2 * per + 2 * ALIGN, dev)
        self.cache = PagedKVCache(args, num_pages + 1, page_size, dtype, dev,
                                  self.arena.tensor if self.arena is not None else None)
        self.num_pages, self.page_size, self.rows, self.width = num_pages, page_size, rows, width
        self.table_host = torch.full((rows + 1, width), num_pages, dtype=torch.int32)
        self.block_table = self.table_host.to(dev)
        self.graphs: DecodeGraphs | None = None

    def fits(self, num_pages: int, page_size: int, rows: int, width: int, dtype, dev) -> bool:
        return (self.page_size == page_size and self.num_pages >= num_pages and self.rows >= rows
                and self.width >= width and self.cache.k.dtype == dtype and self.cache.k.device == torch.device(dev))

    def set_rows(self, rows: list[tuple[int, list[int]]]) -> None:
        """Block-table rows now list their pages, (slot, pages) each: the host mirror, then the changed rows
        to the device in one copy in stream order (no host sync, so an admission does not wait for the
        steps in flight; one copy for a whole admission instead of one per sequence)."""
        if not rows:
            return
        table = self.table_host.numpy()
        for slot, pages in rows:
            table[slot, : len(pages)] = pages
        if self.block_table.data_ptr() == self.table_host.data_ptr():  # on the CPU the mirror is the table
            return
        slots = torch.tensor([slot for slot, _ in rows], dtype=torch.long)
        changed = self.table_host.index_select(0, slots)
        dev = self.block_table.device
        self.block_table.index_copy_(0, slots.pin_memory().to(dev, non_blocking=True),
                                     changed.pin_memory().to(dev, non_blocking=True))

    def release(self) -> None:
        """The pages' memory back to the device (the graphs and the block table stay)."""
        self.arena.release()

    def resume(self) -> None:
        """The pages back at their addresses, zeroed (stale entries are never attended to, but must be finite)."""
        self.arena.resume()
        self.cache.k.zero_()
        self.cache.v.zero_()

    def close(self) -> None:
        if self.arena is not None:
            self.graphs = None
            self.arena.close()

    def decode_graphs(self) -> DecodeGraphs:
        if self.graphs is None:
            self.graphs = DecodeGraphs(self.cache, self.block_table, self.rows, self.num_pages * self.page_size)
        return self.graphs


def grow(need: int, have: int) -> int:
    """Capacity for `need` when `have` is too small: `need` rounded up to 1/16 of its power of two
    (at most ~6 % spare), so that calls that need a little more than the last one reuse the state."""
    if need <= have:
        return have
    step = max(1, (1 << max(0, need.bit_length() - 1)) // 16)
    return -(-need // step) * step
