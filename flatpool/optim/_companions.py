"""Companion pools: a parameter pool's optimizer state, at the same byte offsets.

One pool per state kind (``<pool>/<kind>``), so a segment's range is one flat kernel call.
Companions hold no slices, so they have no reference cycle and die with their last reference;
bytes outside members stay zero, a fixed point of every flat rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _torch_compat as tc
from ..pool import FlatPool, contiguous_strides
from ._layout import Member


def new_pool(name: str, nbytes: int, device: torch.device, zeroed: bool = True) -> FlatPool:
    """A zeroed (unless ``zeroed`` is false: a collective writes it whole) slice-less pool of
    ``nbytes``, allocated on the current stream as ``torch.empty`` is."""
    pool = FlatPool(device, alignment=1, capacity=nbytes, name=name)
    pool.materialize()
    if nbytes and zeroed:
        pool.view_bytes(0, nbytes).zero_()
    return pool


def views(pool: FlatPool, offsets: Sequence[int], shapes: Sequence[Sequence[int]],
          dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Base-less views (each its own version counter) at byte ``offsets`` of ``pool``."""
    storage = pool.storage
    device = pool.device
    out = []
    with tc.outside_inference(), torch.no_grad():
        for offset, shape, dtype in zip(offsets, shapes, dtypes):
            t = torch.empty(0, dtype=dtype, device=device)
            t.set_(storage, offset // dtype.itemsize, tuple(shape), contiguous_strides(shape))
            out.append(t)
    return out


class Companions:
    """One companion per (parameter pool, kind), made anew when the pool's storage changes."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, str], tuple[tuple[object, ...], FlatPool]] = {}

    def get(self, pool: FlatPool, kind: str) -> FlatPool:
        sig = (pool.storage_key, pool.capacity)
        have = self._made.get((id(pool), kind))
        if have is not None and have[0] == sig:
            return have[1]
        made = new_pool(f"{pool.name}/{kind}", pool.capacity, pool.device)
        self._made[(id(pool), kind)] = (sig, made)
        return made

    def pools(self) -> list[FlatPool]:
        return [m for _, m in self._made.values()]


class StepSlots:
    """``<pool>/step``: one element per member in storage order, so a segment's counts are one
    range (checked equal and incremented with one operation)."""

    def __init__(self, pool: FlatPool, members: Sequence[Member], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.index = {id(m): i for i, m in enumerate(members)}
        self.pool = new_pool(f"{pool.name}/step", max(1, len(members)) * dtype.itemsize, device)
        self.all = self.pool.view_at(0, (len(members),), dtype)

    def views(self, ks: Sequence[int]) -> list[torch.Tensor]:
        """The step tensors of members ``ks``: 0-d views of their elements."""
        size = self.dtype.itemsize
        return views(self.pool, [k * size for k in ks], [()] * len(ks), [self.dtype] * len(ks))

    def span(self, a: int, b: int) -> torch.Tensor:
        return self.all[a:b]
