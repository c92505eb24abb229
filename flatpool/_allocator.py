"""Byte-range bookkeeping for one pool: best-fit placement with coalescing free lists.

Device-free, so a layout can be planned before any storage exists. While *growable* (planned,
no fixed capacity) a request that fits no gap extends the extent; once fixed, it gets ``None``.
Inside :meth:`RangeAllocator.journaled` each primitive logs its absolute inverse *before* it
acts, so an interrupt at any bytecode is undone exactly. Ranges with no usable byte at the
allocator's alignment (padding gaps) stay out of the best-fit indexes: nothing fits in them.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence
from itertools import repeat
from typing import Any, Literal, Union

AllocSnapshot = tuple[bool, int, "array[int]", "array[int]"]
"""``(growable, extent, starts, ends)``: what :meth:`RangeAllocator.snapshot` gives."""

Undo = Union[tuple[str, int, int], tuple[str, bool, int]]
"""``("add", start, end)``, ``("del", start, end)`` or ``("extent", growable, extent)``."""


def _drop_sorted(values: list[Any], value: Any) -> None:
    i = bisect.bisect_left(values, value)
    if i < len(values) and values[i] == value:
        del values[i]


def _put_sorted(values: list[Any], value: Any) -> None:
    i = bisect.bisect_left(values, value)
    if i == len(values) or values[i] != value:
        values.insert(i, value)


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class RangeAllocator:
    """Free space as sorted, disjoint, coalesced ``[start, end)`` ranges over ``[0, extent)``."""

    def __init__(self, capacity: int | None, alignment: int = 1) -> None:
        self.growable: bool = capacity is None
        self.extent: int = 0 if capacity is None else capacity
        self.alignment = alignment
        self._starts: array[int] = array("q")  # free range starts, sorted
        self._ends: array[int] = array("q")  # matching ends
        # (size, start) of every free range with a usable byte (:meth:`_indexed`), sorted: best
        # fit without scanning every gap.
        self._by_size: list[tuple[int, int]] = []
        # (usable size at ``alignment``, start) of the same ranges: the exact index for requests
        # at the pool's own alignment (the common case). Padding gaps (a slice's end up to the
        # next aligned start) have usable size 0, are in neither index and never cost a scan.
        self._by_usable: list[tuple[int, int]] = []
        self._undo: list[Undo] | None = None  # the journal of the change in progress
        if capacity:
            self._add(0, 0, capacity)

    def _usable(self, start: int, end: int) -> int:
        return max(0, end - align_up(start, self.alignment))

    def _indexed(self, start: int, end: int) -> bool:
        """The range has a usable byte at the allocator's alignment (so is in the indexes)."""
        return end > align_up(start, self.alignment)

    # -- all-or-nothing changes --------------------------------------------------------
    def journaled(self) -> _Journaled:
        """Make the changes inside the block all-or-nothing: an exception undoes every step
        taken, then propagates; the journal is the block's value, for a later :meth:`undo`.
        A class, not a generator: an interrupt in contextlib's exit frames would skip the
        cleanup and leave the journal marked in progress."""
        return _Journaled(self)

    def undo(self, journal: list[Undo]) -> None:
        """Undo ``journal``'s steps, newest first; absolute, so running it twice is harmless."""
        starts, ends = self._starts, self._ends
        for step in reversed(journal):
            kind, a, b = step
            if kind == "extent":
                self.growable, self.extent = bool(a), b
                continue
            rows: list[tuple[Any, Any]] = [(starts, a), (ends, b)]
            if self._indexed(a, b):
                rows += [(self._by_size, (b - a, a)), (self._by_usable, (self._usable(a, b), a))]
            for values, value in rows:
                (_drop_sorted if kind == "add" else _put_sorted)(values, value)
        journal.clear()

    def _log(self, step: Undo) -> None:
        if self._undo is not None:
            self._undo.append(step)

    # -- free-list primitives (keep the three lists in step) ---------------------------
    def _add(self, i: int, start: int, end: int) -> None:
        self._log(("add", start, end))
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        if self._indexed(start, end):
            bisect.insort(self._by_size, (end - start, start))
            bisect.insort(self._by_usable, (self._usable(start, end), start))

    def _delete(self, i: int) -> None:
        start, end = self._starts[i], self._ends[i]
        self._log(("del", start, end))
        del self._starts[i], self._ends[i]
        if not self._indexed(start, end):
            return
        j = bisect.bisect_left(self._by_size, (end - start, start))
        del self._by_size[j]
        j = bisect.bisect_left(self._by_usable, (self._usable(start, end), start))
        del self._by_usable[j]

    # -- queries -----------------------------------------------------------------------
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def largest_free(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends)), default=0)

    def largest_fit(self, alignment: int) -> int:
        """Largest request that would fit now at ``alignment``."""
        best = 0
        for s, e in zip(self._starts, self._ends):
            best = max(best, e - align_up(s, alignment))
        return best

    # -- mutation ----------------------------------------------------------------------
    def find(self, nbytes: int, alignment: int) -> int | None:
        """Best-fit start for ``nbytes`` at ``alignment`` without changing anything."""
        # The smallest range that fits after alignment, the lowest start among equal sizes:
        # ranges in (size, start) order from the first one big enough, first that fits.
        best_start: int | None = None
        if alignment == self.alignment:
            j = bisect.bisect_left(self._by_usable, (nbytes, -1))
            if j < len(self._by_usable):
                best_start = align_up(self._by_usable[j][1], alignment)
        else:
            # Other alignments: from the smallest range big enough; a range of at least
            # nbytes + alignment - 1 bytes always fits, so the scan is bounded by that window.
            by_size = self._by_size
            for j in range(bisect.bisect_left(by_size, (nbytes, -1)), len(by_size)):
                size, s = by_size[j]
                start = align_up(s, alignment)
                if start + nbytes <= s + size:
                    best_start = start
                    break
        if best_start is None and self.growable:
            # Extend: reuse a trailing free range if there is one.
            tail = self._ends[-1] == self.extent if self._ends else False
            base = self._starts[-1] if tail else self.extent
            best_start = align_up(base, alignment)
        return best_start

    def append_many(self, requests: list[tuple[int, int]]) -> array[int] | None:
        """Place ``(nbytes, alignment)`` requests back to back past the extent, in one step:
        only for a growable allocator with no free range, where best fit has nothing to choose.
        Returns ``None`` (nothing changed) otherwise."""
        if any(alignment != self.alignment for _, alignment in requests):
            return None  # a coarser alignment leaves gaps a later, finer request would fill
        return self.append_run([nbytes for nbytes, _ in requests])

    def append_run(self, sizes: Sequence[int]) -> array[int] | None:
        """:meth:`append_many` for ``sizes`` all at the allocator's own alignment."""
        if not self.growable or self._starts:
            return None
        starts: array[int] = array("q")  # (the slice run keeps this column as it is)
        gap_starts: array[int] = array("q")
        gap_ends: array[int] = array("q")
        push, gap, gap_end = starts.append, gap_starts.append, gap_ends.append
        self._log(("extent", self.growable, self.extent))
        pos = self.extent
        a = self.alignment
        for nbytes in sizes:
            start = -(-pos // a) * a
            if start > pos:
                gap(pos)
                gap_end(start)
            push(start)
            pos = start + nbytes
        if self._undo is not None:  # logged first: an interrupt below leaves nothing undone
            self._undo.extend(zip(repeat("add"), gap_starts, gap_ends))
        self.extent = pos
        self._starts, self._ends = gap_starts, gap_ends
        # Each gap ends at an aligned start: none has a usable byte, so both indexes stay empty.
        self._by_size, self._by_usable = [], []
        return starts

    def take(self, start: int, nbytes: int) -> None:
        """Mark ``[start, start + nbytes)`` used; it must lie in free space (or past the extent)."""
        end = start + nbytes
        if end > self.extent:
            if not self.growable:
                raise AssertionError("take() past a fixed extent")
            self._log(("extent", self.growable, self.extent))
            old_extent, self.extent = self.extent, end
            if start >= old_extent:  # placed past every byte: only the gap before it is free
                self.release(old_extent, start)
                return
            self.release(old_extent, end)
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or self._ends[i] < end:
            raise AssertionError(f"take({start}, {nbytes}) outside free space")
        s, e = self._starts[i], self._ends[i]
        self._delete(i)
        if end < e:
            self._add(i, end, e)
        if s < start:
            self._add(i, s, start)

    def release(self, start: int, end: int) -> None:
        """Return ``[start, end)`` to free space, merging with adjacent free ranges."""
        if start >= end:
            return
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] > start or i < len(self._starts) and self._starts[i] < end:
            raise AssertionError(f"release({start}, {end}) overlaps free space")
        if i > 0 and self._ends[i - 1] == start:
            start = self._starts[i - 1]
            i -= 1
            self._delete(i)
        if i < len(self._starts) and self._starts[i] == end:
            end = self._ends[i]
            self._delete(i)
        self._add(i, start, end)

    def fix(self, capacity: int) -> None:
        """Stop growing at ``capacity`` (>= extent); the tail becomes free space."""
        if capacity < self.extent:
            raise AssertionError("capacity below the planned extent")
        self._log(("extent", self.growable, self.extent))
        if capacity > self.extent:
            self.release(self.extent, capacity)
        self.extent = capacity
        self.growable = False

    def snapshot(self) -> AllocSnapshot:
        return (self.growable, self.extent, array("q", self._starts), array("q", self._ends))

    def restore(self, snap: AllocSnapshot) -> None:
        self._undo = None  # a restore ends whatever change was in progress
        self.growable, self.extent, starts, ends = snap
        self._starts, self._ends = array("q", starts), array("q", ends)
        kept = [(s, e) for s, e in zip(starts, ends) if self._indexed(s, e)]
        self._by_size = sorted((e - s, s) for s, e in kept)
        self._by_usable = sorted((self._usable(s, e), s) for s, e in kept)


class _Journaled:
    """:meth:`RangeAllocator.journaled`'s block; a nested one leaves undoing to the outermost."""

    __slots__ = ("_alloc", "_journal", "_outer")

    def __init__(self, alloc: RangeAllocator) -> None:
        self._alloc = alloc
        self._journal: list[Undo] = []
        self._outer = False

    def __enter__(self) -> list[Undo]:
        alloc = self._alloc
        if alloc._undo is not None:  # nested: the outer block undoes everything
            return alloc._undo
        self._outer = True
        alloc._undo = self._journal
        return self._journal

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> Literal[False]:
        if self._outer:
            alloc = self._alloc
            if alloc._undo is self._journal:
                alloc._undo = None
            if exc_type is not None:
                alloc.undo(self._journal)
        return False

