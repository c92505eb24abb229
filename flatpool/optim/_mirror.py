"""``mirror``: a zeroed pool with another pool's byte layout, for gradients and optimizer state.

The allocator has no "allocate at", so requests are made with ``alignment=1`` in offset order
with ``uint8`` fillers in the gaps; fillers stay zero, a fixed point of every flat rule.
"""

from __future__ import annotations

import torch

from ..errors import PoolInvariantError
from ..pool import FlatPool
from ..slices import Slice


def mirror(pool: FlatPool, name: str) -> tuple[FlatPool, dict[int, Slice]]:
    """A zeroed pool with ``pool``'s slices at the same offsets, and ``{slice_id: its slice}``."""
    slices = sorted(pool.slices(), key=lambda s: s.offset)
    requests: list[tuple[tuple[int, ...], torch.dtype]] = []
    owners: list[int | None] = []
    end = 0
    for s in slices:
        if s.offset > end:
            requests.append(((s.offset - end,), torch.uint8))
            owners.append(None)
        requests.append((tuple(s.shape), s.dtype))
        owners.append(s.slice_id)
        end = s.end
    if pool.capacity > end:
        requests.append(((pool.capacity - end,), torch.uint8))
        owners.append(None)
    out = FlatPool(pool.device, alignment=1, name=name)
    made = out.allocate_many(requests) if requests else []
    by_id: dict[int, Slice] = {}
    for owner, m in zip(owners, made):
        if owner is not None:
            by_id[owner] = m
    for s in slices:
        if by_id[s.slice_id].offset != s.offset:
            raise PoolInvariantError(
                f"mirror {name!r}: slice {s.slice_id} planned at byte {by_id[s.slice_id].offset}, "
                f"not {s.offset} as in pool {pool.name!r} (a bug: please report it)")
    out.materialize()
    if out.capacity:
        out.view_bytes(0, out.capacity).zero_()
    return out, by_id
