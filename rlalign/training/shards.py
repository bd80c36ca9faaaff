"""Dense sharding (trainer.shard_dense, ZeRO-1/2 style): the dense (non-expert) fp32 masters and
AdamW moments split across the trainer ranks in units (`dense_units`: row blocks of at most
trainer.shard_unit_numel elements, starting at 64-element offsets; their identity depends on the
shapes and that budget, never on the number of ranks), contiguous runs of units per rank
(`assign_units`). After the update, the compute-dtype weights are all-gathered (`gather_dense`)
so that every rank's model is the same bits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_UNIT_NUMEL = 4 * 1024 * 1024  # trainer.shard_unit_numel's default (16 MiB of fp32)
UNIT_ALIGN = 64  # every unit starts at a multiple of this many elements of its parameter


@dataclass(frozen=True)
class Unit:
    """Rows [lo, hi) of dense parameter `name` (elements of a 1-d one): the unit of dense sharding.
    `key` names it in checkpoints and traces: the parameter's own name when one unit covers the
    whole parameter, else 'NAME/rows{lo}-{hi}'."""

    name: str
    lo: int
    hi: int
    numel: int
    key: str


def dense_units(shapes: list[tuple[str, tuple[int, ...]]], budget: int) -> list[Unit]:
    """Every parameter of `shapes` (in that order) cut into row blocks of at most `budget`
    elements (at least one row), each block a whole number of UNIT_ALIGN-element groups except a
    parameter's last: a unit's elements sit at the same offsets, modulo the vector width, as in
    the whole tensor, so a vectorised kernel with a scalar tail treats them alike. Depends only on
    the shapes and the budget, never on the number of ranks."""
    out = []
    for name, shape in shapes:
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if shape else 1
        step = UNIT_ALIGN // math.gcd(row, UNIT_ALIGN) if row else 1
        per = max(step, (budget // max(1, row)) // step * step)
        cuts = list(range(0, rows, per)) + [rows]
        for lo, hi in zip(cuts, cuts[1:]):
            key = name if (lo, hi) == (0, rows) else f"{name}/rows{lo}-{hi}"
            out.append(Unit(name, lo, hi, (hi - lo) * row, key))
    return out


def assign_units(sizes: list[int], world: int) -> list[int]:
    """The owner rank of each unit: contiguous runs in unit order, unit i to the rank whose
    1/world of the total its midpoint falls in (integer arithmetic; balanced to within one unit
    at each boundary)."""
    total, off, out = sum(sizes), 0, []
    for s in sizes:
        out.append(min(world - 1, (2 * off + s) * world // (2 * total)) if total else 0)
        off += s
    return out


def unit_rows(t: torch.Tensor, u: Unit) -> torch.Tensor:
    """Unit u's rows of t (the whole of a 0-d t as one row)."""
    return (t if t.dim() else t.reshape(1))[u.lo : u.hi]


def gather_dense(model, master: dict[str, torch.Tensor], units: list[Unit], owners: list[int], rank: int, world: int,
                 group) -> None:
    """Every rank's updated dense units, rounded to the model's dtype on their owner, all-gathered
    as bytes (one buffer per rank, padded to the largest) into every rank's model: the same bits as
    rounding the whole master on every rank."""
    params = dict(model.named_parameters())

    def raw(u: Unit) -> torch.Tensor:
        return master[u.key].detach().to(params[u.name].dtype).reshape(-1).view(torch.uint8)

    def put(u: Unit, data: torch.Tensor) -> None:
        p = params[u.name]
        dst = unit_rows(p.data, u)
        dst.copy_(data.view(p.dtype).view(dst.shape))

    per_rank = [[u for u, r in zip(units, owners) if r == k] for k in range(world)]
    if world == 1:
        for u in per_rank[0]:
            put(u, raw(u))
        return
    nbytes = lambda u: u.numel * params[u.name].element_size()  # noqa: E731
    size = max(sum(nbytes(u) for u in us) for us in per_rank)
    local = torch.zeros(size, dtype=torch.uint8, device=model.lm_head.weight.device)
    off = 0
    for u in per_rank[rank]:
        local[off : off + nbytes(u)] = raw(u)
        off += nbytes(u)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    for k, us in enumerate(per_rank):
        off = 0
        for u in us:
            put(u, parts[k][off : off + nbytes(u)])
            off += nbytes(u)
