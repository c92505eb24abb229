"""Where each parameter of an optimizer lives, and the flat ranges one kernel can step.

A *member* is a parameter whose data (its local tensor, for a DTensor) is one contiguous run
inside a slice of a given pool. A *segment* is a maximal run of members of one param group and
one dtype whose slices follow each other in their pool with no other live slice between them:
one byte range ``[start, end)`` of the pool that a flat kernel steps in one call. Free bytes
between two of its slices, and the padding of a slice past its member's elements, ride along;
they hold zero gradient and zero state, which every flat rule leaves at zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import define

from .. import torch_compat as tc
from ..aliasing import local_tensor
from ..pool import FlatPool
from ..slices import Slice


@define(frozen=True, eq=False)
class Member:
    """One parameter at its pooled place (``offset`` in bytes of its pool's storage)."""

    param: torch.Tensor
    group: int
    pool: FlatPool
    slice: Slice
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def in_place(self, key: int) -> bool:
        """Still on the pool storage ``key`` at its offset (two C reads, no Python storage)."""
        local = local_tensor(self.param)
        return bool(tc.storage_address(local) == key
                    and local.storage_offset() * self.dtype.itemsize == self.offset)


@define(frozen=True, eq=False)
class Segment:
    """Members of one (pool, dtype, param group) whose slices are adjacent in the pool."""

    pool: FlatPool
    dtype: torch.dtype
    group: int
    members: tuple[Member, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return (self.end - self.start) // self.dtype.itemsize


def place_of(param: torch.Tensor, pools: Sequence[FlatPool]) -> tuple[FlatPool, Slice, int] | str:
    """``(pool, slice, byte offset)`` of ``param``'s data, or why it has no flat place."""
    if not param.requires_grad:
        return "requires_grad=False: torch skips it (it never has a gradient)"
    local = local_tensor(param)
    if local.is_sparse or local.layout != torch.strided:
        return f"layout {local.layout}: not one strided run"
    if local.is_complex():
        return "complex parameter: a flat step would need view_as_real of the whole range"
    for pool in pools:
        if pool.owns(local):
            slc = pool.slice_of(local)
            if slc is None:
                return f"in pool {pool.name!r} but in no live slice"
            if not local.is_contiguous():
                return "not contiguous in its slice"
            if slc.dtype != local.dtype:
                return f"its slice holds {slc.dtype}, the parameter is {local.dtype}"
            return pool, slc, int(local.storage_offset()) * local.dtype.itemsize
    return "in none of the given pools (adopt it first)"


def plan(
    param_groups: Sequence[dict[str, object]], pools: Sequence[FlatPool]
) -> tuple[list[Segment], dict[int, str]]:
    """Segments of every group that can step flat, and ``{group index: reason}`` for those
    that cannot (every parameter of such a group is stepped per parameter)."""
    reasons: dict[int, str] = {}
    members: list[Member] = []
    owner: dict[tuple[int, int], Member] = {}  # (id(pool), slice_id) -> member
    for g, group in enumerate(param_groups):
        found: list[Member] = []
        params = group["params"]
        assert isinstance(params, list)
        for i, p in enumerate(params):
            where = place_of(p, pools)
            if isinstance(where, str):
                reasons[g] = f"param_groups[{g}]['params'][{i}] {tuple(p.shape)}: {where}"
                break
            pool, slc, offset = where
            if (id(pool), slc.slice_id) in owner or any(
                    m.slice.slice_id == slc.slice_id and m.pool is pool for m in found):
                reasons[g] = (f"param_groups[{g}]['params'][{i}] shares slice {slc.slice_id} of "
                              f"pool {pool.name!r} with another parameter")
                break
            local = local_tensor(p)
            found.append(Member(p, g, pool, slc, offset, local.shape, local.dtype))
        if g not in reasons:
            for m in found:
                owner[(id(m.pool), m.slice.slice_id)] = m
            members.extend(found)
    return _segments(members, owner, pools), reasons


def _segments(members: list[Member], owner: dict[tuple[int, int], Member],
              pools: Sequence[FlatPool]) -> list[Segment]:
    out: list[Segment] = []
    for pool in pools:
        run: list[Member] = []
        for slc in sorted(pool.slices(), key=lambda s: s.offset):
            m = owner.get((id(pool), slc.slice_id))
            if run and (m is None or m.group != run[0].group or m.dtype != run[0].dtype):
                out.append(_segment(run))
                run = []
            if m is not None:
                run.append(m)
        if run:
            out.append(_segment(run))
    return out


def _segment(run: list[Member]) -> Segment:
    first, last = run[0], run[-1]
    return Segment(first.pool, first.dtype, first.group, tuple(run), first.slice.offset,
                   last.slice.end)


def gaps(segment: Segment) -> list[tuple[int, int]]:
    """Free byte ranges inside a segment (between its slices)."""
    out = []
    for a, b in zip(segment.members, segment.members[1:]):
        if b.slice.offset > a.slice.end:
            out.append((a.slice.end, b.slice.offset))
    return out


__all__ = ["Member", "Segment", "gaps", "place_of", "plan"]
