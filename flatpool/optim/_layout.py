"""Where each parameter of an optimizer lives, and the byte ranges one flat kernel may step.

Glossary (the other modules cite these names):

* A **member** is a parameter of a param group whose data (its local tensor, for a DTensor) is
  one contiguous run of elements inside a live slice of one of the given pools.
* A **segment** is a maximal sequence of members of one param group, pool and dtype, in storage
  order, with nothing between consecutive slices but *alignment padding* (bytes where no slice
  can ever start). A flat kernel steps its whole byte range; a free gap or another slice ends
  it, as those bytes belong, or may later, to someone else. So does a slice's byte that its member
  does not hold (another parameter on the slice, the rest of a bigger adopted tensor, a padded
  shard's tail): another live tensor can see it, and only torch's step may write it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch
from attrs import define

from .. import _torch_compat as tc
from .._aliasing import local_tensor
from ..pool import FlatPool
from ..slices import Slice

FLAT_DTYPES = (torch.float32, torch.float64)
"""Dtypes whose flat step is bit-identical to the per-parameter one: torch's CPU half-precision
kernels round differently in the vectorized body and the scalar tail (docs/optim.md)."""


@define(frozen=True, eq=False)
class Member:
    """One parameter at its pooled place (``offset``: bytes into its pool's storage)."""

    param: torch.Tensor
    group: int
    index: int
    pool: FlatPool
    slice: Slice
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def end(self) -> int:
        return self.offset + self.numel * self.dtype.itemsize


@define(frozen=True, eq=False)
class Segment:
    """Members of one (pool, dtype, param group) a flat kernel steps as one range (glossary)."""

    pool: FlatPool
    dtype: torch.dtype
    group: int
    members: tuple[Member, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return (self.end - self.start) // self.dtype.itemsize

    @property
    def flat(self) -> bool:
        """Stepped as one range; other dtypes are stepped per parameter (:data:`FLAT_DTYPES`)."""
        return self.dtype in FLAT_DTYPES


class Places:
    """The given pools by storage identity (planning stays linear); a slice by bisection."""

    def __init__(self, pools: Sequence[FlatPool]) -> None:
        self.pools = list(pools)
        self.by_key = {p.storage_key: p for p in self.pools if p.storage_key is not None}
        self._starts: dict[int, tuple[list[int], tuple[Slice, ...]]] = {}

    def _slice_at(self, pool: FlatPool, start: int, nbytes: int) -> Slice | None:
        """The live slice holding bytes ``[start, start + nbytes)`` of ``pool``."""
        got = self._starts.get(id(pool))
        if got is None:
            slices = pool.slices()  # in storage order
            got = self._starts[id(pool)] = ([s.offset for s in slices], slices)
        k = bisect.bisect_right(got[0], start) - 1
        if k < 0:
            return None
        slc = got[1][k]
        return slc if start + nbytes <= slc.offset + slc.nbytes else None

    def of(self, param: torch.Tensor) -> tuple[FlatPool, Slice, int] | str:
        """``(pool, slice, byte offset)`` of ``param``'s data, or why it has no flat place."""
        local = local_tensor(param)
        if local.layout != torch.strided:
            return f"layout {local.layout}: not one strided run"
        if local.is_complex():
            return "a complex parameter"
        if local.numel() == 0:
            return "no elements (an empty shard): nothing to pool"
        if local.device.type == "meta":
            return "a meta tensor (not materialized yet)"
        pool = self.by_key.get(tc.storage_address(local))
        if pool is None:
            return "in none of the given pools (adopt it first)"
        if not local.is_contiguous():
            return "not contiguous in its slice"
        start = int(local.storage_offset()) * local.dtype.itemsize
        slc = self._slice_at(pool, start, local.numel() * local.dtype.itemsize)
        if slc is None:
            return f"in pool {pool.name!r} but in no live slice"
        if slc.dtype != local.dtype:
            return f"its slice holds {slc.dtype}, the parameter is {local.dtype}"
        return pool, slc, start


def plan_group(g: int, group: dict[str, Any], places: Places,
               taken: dict[tuple[int, int], Member]) -> tuple[list[Member], dict[int, str]]:
    """The members of ``param_groups[g]``, and why each other parameter has no flat place.
    ``taken``: ``(id(pool), slice_id)`` to its member, across groups (one member a slice)."""
    members: list[Member] = []
    others: dict[int, str] = {}
    params = group["params"]
    aliased = None
    if len(set(map(id, params))) != len(params):
        aliased = "a parameter listed twice in the group"
    for i, p in enumerate(params):
        where = places.of(p)
        if isinstance(where, str):
            others[i] = where
            continue
        pool, slc, offset = where
        key = (id(pool), slc.slice_id)
        local = local_tensor(p)
        m = Member(p, g, i, pool, slc, offset, local.shape, local.dtype)
        other = taken.get(key)
        if other is not None:
            others[i] = f"shares slice {slc.slice_id} of pool {pool.name!r} with another parameter"
            if aliased is None and other.group == g and other.offset < m.end \
                    and m.offset < other.end:
                aliased = f"params[{other.index}] and params[{i}] share bytes"
            continue
        taken[key] = m
        members.append(m)
    if aliased is not None:  # torch's step of aliased tensors depends on the whole group's
        for m in members:
            del taken[(id(m.pool), m.slice.slice_id)]
        return [], {i: others.get(i, f"{aliased}: torch steps it per listing, and what each "
                                     "listing sees depends on the rest of the group")
                    for i in range(len(params))}
    return members, others


def segments_of(members: Sequence[Member]) -> list[Segment]:
    """The segments (glossary) of ``members``, pool by pool in storage order."""
    by_pool: dict[int, list[Member]] = {}
    for m in members:
        by_pool.setdefault(id(m.pool), []).append(m)
    out: list[Segment] = []
    for ms in by_pool.values():
        ms.sort(key=lambda m: m.offset)
        run = [ms[0]]
        for m in ms[1:]:
            last = run[-1]
            if m.group == last.group and m.dtype == last.dtype and _adjacent(last, m):
                run.append(m)
            else:
                out.append(_segment(run))
                run = [m]
        out.append(_segment(run))
    return out


def _adjacent(a: Member, b: Member) -> bool:
    """No multiple of the pool's alignment lies in ``[a.slice.end, b.slice.offset)``, and the
    bytes between ``a`` and ``b`` are no slice's (``a`` ends its slice, ``b`` starts its own)."""
    align = a.pool.alignment
    if b.slice.offset < a.slice.end or a.end != a.slice.end or b.offset != b.slice.offset:
        return False
    return -(-a.slice.end // align) * align >= b.slice.offset


def _segment(run: list[Member]) -> Segment:
    first, last = run[0], run[-1]
    return Segment(first.pool, first.dtype, first.group, tuple(run), first.offset, last.end)


def multi_dim(members: Sequence[Member]) -> list[int]:
    """Indices of ``members`` of two or more dimensions: the places whose contiguity the step
    checks (``t.data = t.data.t()`` keeps the address). A 1-D place re-viewed at its address
    (``t.data = t.data[::2]``) pairs its elements with the gradient's and state's as the flat
    step does, or torch raises on the shapes, unless a hand-made stride re-views one of them."""
    return [i for i, m in enumerate(members) if len(m.shape) > 1]
