"""The fixed-capacity all-to-all of expert-parallel decode: sizes stay on the device.

Every rank sends every destination a buffer of exactly `capacity` rows (its rows for that rank's
experts first, zero rows after them) and the per-expert counts as a device tensor, so both
collectives have equal split sizes that the host knows without reading a tensor: nothing waits for
the device and a decode step that holds them can be captured in a CUDA graph. The receiver finds
each row's expert from the counts on the device; the rows come back to the slots they were sent
from. A rank's buffers hold at most `rows * min(top_k, experts per rank)` real rows for `rows`
tokens (a token picks distinct experts), so a capacity of that size never overflows; a step that
overflows anyway (its rows bound was wrong) sets a device flag instead of being cut silently.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlalign import kernels


def capacity(rows: int, top_k: int, num_local: int) -> int:
    """Rows per destination that `rows` tokens, each routed to top_k distinct experts, can fill."""
    return rows * min(top_k, num_local)


def send_rows(x_sorted: torch.Tensor, send: torch.Tensor, cap: int, group
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_sorted [N, d] (rows sorted by global expert, so by destination rank), send [W, El] counts
    (device) -> (received rows [W * cap, d]: source s's rows at [s * cap, s * cap + its count),
    received counts [W, El], overflow flag [] (some destination got more than cap rows))."""
    W = send.shape[0]
    n = send.sum(1)  # [W] rows for each destination
    start = torch.cumsum(n, 0) - n
    i = torch.arange(cap, device=send.device)
    src = torch.where(i < n[:, None], start[:, None] + i, x_sorted.shape[0])  # [W, cap]; N: the zero row
    x_pad = torch.cat([x_sorted, x_sorted.new_zeros(1, x_sorted.shape[1])])
    buf = x_pad.index_select(0, src.view(-1))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.reshape(-1).contiguous(), group=group)
    out = torch.empty_like(buf)
    dist.all_to_all_single(out, buf, group=group)
    return out, recv.view(W, -1), (n > cap).any()


def by_expert(recv: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The received slots [W * cap] grouped by local expert: (order, its inverse, counts [El]). Within
    an expert the rows keep (source rank, position) order, as the host-sized path lays them out;
    the padding slots go last, outside every group (kernels.moe_dispatch, the MoE layer's counting sort)."""
    W, El = recv.shape
    ends = torch.cumsum(recv.clamp(max=cap), 1)  # [W, El]: past each local expert's rows, per source
    i = torch.arange(cap, device=recv.device).expand(W, cap).contiguous()
    expert = torch.searchsorted(ends, i, right=True)  # [W, cap]: local expert of each slot, El: padding
    order, dest, counts = kernels.moe_dispatch(expert.view(-1), El + 1)
    return order, dest, counts[:El]


def return_rows(y_recv: torch.Tensor, send: torch.Tensor, cap: int, num_rows: int, group) -> torch.Tensor:
    """The outputs of the received slots [W * cap, d] back to their senders, in x_sorted's order
    [num_rows, d] (a row that did not fit the capacity reads a zero row: see send_rows' flag)."""
    W = send.shape[0]
    back = torch.empty_like(y_recv)
    dist.all_to_all_single(back, y_recv.contiguous(), group=group)  # back[r * cap + i]: my row i sent to rank r
    n = send.sum(1)
    ends = torch.cumsum(n, 0)
    j = torch.arange(num_rows, device=send.device)
    r = torch.searchsorted(ends, j, right=True).clamp(max=W - 1)  # destination rank of row j
    i = j - (ends - n).index_select(0, r)
    idx = torch.where(i < cap, r * cap + i, W * cap)
    back = torch.cat([back, back.new_zeros(1, back.shape[1])])
    return back.index_select(0, idx)
