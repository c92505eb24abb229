"""Which slice handles of one pool are live, by id and by offset, with batches kept as columns.

A batch is one :class:`SliceRun` (first id, starts, shapes, dtypes; handles made on first
access, then kept, so an id always gives the same object); slices allocated one at a time are
*singles*. Runs are placed past every existing slice, so they are in id and offset order at
once; a freed run member is only marked gone. Every change is one step or has an absolute undo,
so an interrupt between two lines leaves it repairable.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterator, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, overload

import torch

from .slices import Slice, slice_run

if TYPE_CHECKING:
    from .pool import FlatPool


class SliceRun(Sequence[Slice]):
    """The slices of one batch, as columns (position ``i`` is slice id ``first + i``); as a
    sequence, the handles, made on first access and then kept."""

    __slots__ = ("pool", "first", "starts", "shapes", "dtypes", "_made")

    def __init__(self, pool: FlatPool, first: int, starts: array[int],
                 shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> None:
        self.pool, self.first, self.starts = pool, first, starts
        self.shapes, self.dtypes = shapes, dtypes
        self._made: list[Slice | None] | None = None

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> Slice: ...
    @overload
    def __getitem__(self, i: slice) -> list[Slice]: ...
    def __getitem__(self, i: int | slice) -> Slice | list[Slice]:
        if isinstance(i, slice):
            return [self.handle(k) for k in range(*i.indices(len(self.starts)))]
        n = len(self.starts)
        if not -n <= i < n:
            raise IndexError(f"slice run index {i} out of range for {n} slices")
        return self.handle(i % n)

    def handle(self, i: int) -> Slice:
        """The handle at position ``i`` (0 <= i < len), made once."""
        made = self._made
        if made is None:
            made = self._made = [None] * len(self.starts)
        slc = made[i]
        if slc is None:
            slc = made[i] = Slice(self.pool, self.first + i, self.starts[i], self.shapes[i],
                                  self.dtypes[i])
        return slc

    def handles(self) -> list[Slice]:
        """Every handle, in order (the missing ones made in one pass)."""
        made = self._made
        if made is None:
            ids = range(self.first, self.first + len(self.starts))
            out = slice_run(self.pool, ids, self.starts, self.shapes, self.dtypes)
            self._made = list(out)
            return out
        return [self.handle(i) for i in range(len(made))]

    def __contains__(self, slc: object) -> bool:
        return (isinstance(slc, Slice) and slc.pool is self.pool
                and 0 <= slc.slice_id - self.first < len(self.starts)
                and self.handle(slc.slice_id - self.first) == slc)

    def __repr__(self) -> str:
        return f"SliceRun(first={self.first}, slices={len(self.starts)})"


_first_id = attrgetter("first")


def _first_start(run: SliceRun) -> int:
    return run.starts[0]


_NO_OFFSETS: tuple[int, ...] = ()
_NO_IDS: frozenset[int] = frozenset()


class SliceIndex:
    """The live handles of one pool: singles in dicts, batches as :class:`SliceRun` columns.

    The runs are a tuple replaced on change, and the singles' sorted offsets and the gone ids
    are made on first use: an index without them holds no container the cycle collector must
    scan (empty dicts are not tracked), which counts when a fusion makes a pool per group.
    """

    __slots__ = ("_by_id", "_by_offset", "_offsets", "_runs", "_gone")

    def __init__(self) -> None:
        self._by_id: dict[int, Slice] = {}
        self._by_offset: dict[int, Slice] = {}
        self._offsets: list[int] | tuple[int, ...] = _NO_OFFSETS  # sorted starts of the singles
        self._runs: tuple[SliceRun, ...] = ()  # id order == offset order; never empty runs
        self._gone: set[int] | frozenset[int] = _NO_IDS  # ids of run members removed since

    def copy(self) -> SliceIndex:
        """An independent index of the same handles (runs are shared: never changed in place)."""
        out = SliceIndex()
        out._by_id, out._by_offset = dict(self._by_id), dict(self._by_offset)
        if self._offsets:
            out._offsets = list(self._offsets)
        out._runs = self._runs
        if self._gone:
            out._gone = set(self._gone)
        return out

    def _offset_list(self) -> list[int]:
        """The singles' sorted offsets as a list to change (made on first use)."""
        if not isinstance(self._offsets, list):
            self._offsets = list(self._offsets)
        return self._offsets

    def _gone_set(self) -> set[int]:
        """The gone ids as a set to change (made on first use)."""
        if not isinstance(self._gone, set):
            self._gone = set(self._gone)
        return self._gone

    # -- reads ------------------------------------------------------------------------------
    def _run_of(self, slice_id: int) -> tuple[SliceRun, int] | None:
        runs = self._runs
        if not runs:
            return None
        j = bisect.bisect_right(runs, slice_id, key=_first_id) - 1
        if j < 0:
            return None
        run = runs[j]
        i = slice_id - run.first
        return (run, i) if i < len(run.starts) else None

    def get(self, slice_id: int) -> Slice | None:
        """The live handle with id ``slice_id``, or ``None``."""
        slc = self._by_id.get(slice_id)
        if slc is not None or not self._runs or not isinstance(slice_id, int):
            return slc
        if slice_id in self._gone:
            return None
        found = self._run_of(slice_id)
        return None if found is None else found[0].handle(found[1])

    def __len__(self) -> int:
        return len(self._by_id) + sum(len(r.starts) for r in self._runs) - len(self._gone)

    def _live_positions(self, run: SliceRun) -> Iterator[int]:
        gone = self._gone
        if not gone:
            return iter(range(len(run.starts)))
        first = run.first
        return (i for i in range(len(run.starts)) if first + i not in gone)

    def handles(self) -> list[Slice]:
        """Every live handle, in no particular order (run handles are made)."""
        out = list(self._by_id.values())
        for run in self._runs:
            if self._gone:
                out += [run.handle(i) for i in self._live_positions(run)]
            else:
                out += run.handles()
        return out

    def ordered(self) -> list[Slice]:
        """Every live handle in storage order."""
        out = self.handles()
        if self._runs and self._by_id:
            out.sort(key=attrgetter("offset"))
        elif not self._runs:
            out = [self._by_offset[o] for o in self._offsets]
        return out

    def used_bytes(self) -> int:
        """Bytes inside live slices, without making run handles."""
        total = sum(s.nbytes for s in self._by_id.values())
        prod = math.prod
        for run in self._runs:
            shapes, dtypes = run.shapes, run.dtypes
            total += sum(prod(shapes[i]) * dtypes[i].itemsize for i in self._live_positions(run))
        return total

    def dtypes(self) -> set[torch.dtype]:
        """The dtypes of the live slices, without making run handles."""
        out = {s.dtype for s in self._by_id.values()}
        for run in self._runs:
            if self._gone:
                out.update(run.dtypes[i] for i in self._live_positions(run))
            else:
                out.update(run.dtypes)
        return out

    def floor(self, offset: int) -> Slice | None:
        """The live slice with the greatest start <= ``offset``, or ``None``."""
        best: Slice | None = None
        offsets = self._offsets
        i = bisect.bisect_right(offsets, offset) - 1
        if i >= 0:
            best = self._by_offset[offsets[i]]
        runs, gone = self._runs, self._gone
        j = bisect.bisect_right(runs, offset, key=_first_start) - 1
        while j >= 0:
            run = runs[j]
            starts = run.starts
            k = bisect.bisect_right(starts, offset) - 1
            while k >= 0 and (best is None or starts[k] > best.offset):
                if run.first + k not in gone:
                    return run.handle(k)
                k -= 1
            if best is not None and starts[0] <= best.offset:
                break  # every earlier run lies below the single found
            j -= 1
        return best

    def consistent(self) -> bool:
        """The singles' three structures agree and the runs' gone counts fit: O(runs)."""
        n = len(self._by_id)
        if len(self._offsets) != n or len(self._by_offset) != n:
            return False
        return len(self._gone) <= sum(len(r.starts) for r in self._runs)

    def gone_are_members(self) -> bool:
        """Every gone id names a run member (O(gone log runs): for tests)."""
        return all(self._run_of(i) is not None for i in self._gone)

    # -- changes ------------------------------------------------------------------------------
    def insert(self, slc: Slice) -> None:
        """Add a single (undo: :meth:`unindex`)."""
        self._by_id[slc.slice_id] = slc
        bisect.insort(self._offset_list(), slc.offset)
        self._by_offset[slc.offset] = slc

    def add_run(self, run: SliceRun) -> None:
        """Add a batch placed past every live slice: one assignment (all or nothing)."""
        if len(run.starts):
            self._runs = (*self._runs, run)

    def remove(self, slc: Slice) -> None:
        """Take out a live handle (undo: :meth:`reindex`)."""
        if self._by_id.get(slc.slice_id) is not None:
            del self._by_id[slc.slice_id]
            i = bisect.bisect_left(self._offsets, slc.offset)
            del self._offset_list()[i]
            del self._by_offset[slc.offset]
        elif self._run_of(slc.slice_id) is not None:
            self._gone_set().add(slc.slice_id)
        else:
            raise KeyError(slc.slice_id)

    def unindex(self, slc: Slice) -> None:
        """Undo :meth:`insert` however far it got (absolute: each entry removed if there)."""
        if self._by_id.get(slc.slice_id) is slc:
            del self._by_id[slc.slice_id]
        if self._by_offset.get(slc.offset) is slc:
            del self._by_offset[slc.offset]
        if slc.offset not in self._by_offset:
            i = bisect.bisect_left(self._offsets, slc.offset)
            if i < len(self._offsets) and self._offsets[i] == slc.offset:
                del self._offset_list()[i]

    def reindex(self, slc: Slice) -> None:
        """Undo :meth:`remove` however far it got (absolute: each entry put back if missing)."""
        if self._run_of(slc.slice_id) is not None and slc.slice_id not in self._by_id:
            self._gone_set().discard(slc.slice_id)
            return
        self._by_id[slc.slice_id] = slc
        self._by_offset[slc.offset] = slc
        i = bisect.bisect_left(self._offsets, slc.offset)
        if i == len(self._offsets) or self._offsets[i] != slc.offset:
            self._offset_list().insert(i, slc.offset)
