"""Value types of ownership transfer: what to adopt, where its views live, what came of it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import chain, repeat, starmap
from operator import is_
from typing import Literal, cast, overload

import torch
from attrs import define, field

from ..errors import InvalidTypeError
from ..holder import Holder
from ..slice_index import SliceRun
from ..slices import Slice

OnPinned = Literal["raise", "warn", "force"]
"""What to do when an original storage is still referenced after rebinding.

``"raise"`` (default) rolls the adoption back and raises :class:`PinnedStorageError` naming
the holders. ``"warn"`` keeps the adoption and warns; the original lives on until its holders
drop it. ``"force"`` also rebinds every Python-visible tensor found on the original by a gc scan,
then behaves like ``"warn"`` for what is left (C++ holders). No mode ever frees memory that
something still uses: an original that only something outside Python holds (a DLPack consumer)
is kept alive by the pool until that holder lets go.
"""


def _sequence(value: object, what: str) -> tuple[object, ...]:
    if isinstance(value, torch.Tensor):  # a tensor iterates over rows; a 0-d one raises
        fix = "views=[t]" if what == "views" else "holders=[Holder(owner, key)] for its places"
        raise InvalidTypeError(
            f"AdoptSpec.{what} must be a sequence, got a single tensor (it would be split into "
            f"rows): pass {fix}"
        )
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidTypeError(
            f"AdoptSpec.{what} must be a list or tuple, got {type(value).__name__}"
        )
    return tuple(value)


# The converters' parameter types are what type checkers take for AdoptSpec's own: precise, so
# ``views=t`` (one tensor) and ``holders=[(m, "w")]`` fail type-checking, not only at run time.
def _tensors(value: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = _sequence(value, "views")
    for v in out:
        if not isinstance(v, torch.Tensor):
            raise InvalidTypeError(f"AdoptSpec.views must hold tensors, got {type(v).__name__}")
    return cast("tuple[torch.Tensor, ...]", out)


def _holders(value: Sequence[Holder]) -> tuple[Holder, ...]:
    out = _sequence(value, "holders")
    for h in out:
        if not isinstance(h, Holder):
            raise InvalidTypeError(
                f"AdoptSpec.holders must hold flatpool.Holder, got {type(h).__name__}"
            )
    return cast("tuple[Holder, ...]", out)


@define(frozen=True)
class AdoptSpec:
    """One original to adopt. Adoption never changes a spec.

    Args:
        tensor: the primary tensor. Its bytes move; it defines the slice (its shape and dtype
            when contiguous, else a flat run of its strided extent).
        views: other tensor objects on the same storage, moved in place.
        holders: places (attributes, items) that hold a tensor on the same storage: that
            tensor is moved in place, and re-adoption looks there for a replacement a framework
            installed later.
        slice: adopt into this existing slice instead of allocating one.
    """

    tensor: torch.Tensor
    views: tuple[torch.Tensor, ...] = field(default=(), converter=_tensors)
    holders: tuple[Holder, ...] = field(default=(), converter=_holders)
    slice: Slice | None = None


_set_field = object.__setattr__


def specs_of_columns(
    tensors: Sequence[torch.Tensor], views: Sequence[tuple[torch.Tensor, ...]],
    holders: Sequence[tuple[Holder, ...]], slices: Sequence[Slice | None],
) -> list[AdoptSpec]:
    """``AdoptSpec(tensors[i], views[i], holders[i], slices[i])`` for every ``i``, from columns
    already in the converted form (tuples of tensors, tuples of :class:`Holder`), built in
    C-level passes (a fusion group makes one spec per member: the converters cost more than
    the rest of its planning). Columns of any other form go through the validating ``__init__``."""
    n = len(tensors)
    if not (len(views) == len(holders) == len(slices) == n
            and all(map(isinstance, tensors, repeat(torch.Tensor)))
            and all(map(is_, map(type, views), repeat(tuple)))
            and all(map(is_, map(type, holders), repeat(tuple)))
            and all(map(isinstance, chain.from_iterable(views), repeat(torch.Tensor)))
            and all(map(is_, map(type, chain.from_iterable(holders)), repeat(Holder)))
            and set(map(type, slices)) <= {type(None), Slice}):
        return list(map(AdoptSpec, tensors, views, holders, slices))
    out = list(starmap(object.__new__, repeat((AdoptSpec,), n)))
    for name, column in (("tensor", tensors), ("views", views), ("holders", holders),
                         ("slice", slices)):  # attrs sets a frozen class's slots this way
        deque(map(_set_field, out, repeat(name), column), maxlen=0)
    return out


@define(frozen=True)
class AdoptedItem:
    """What became of one adopted original."""

    slice: Slice
    original_nbytes: int
    """Bytes of the original storage."""
    released: bool
    """The original storage is proven dead (its weak reference expired)."""
    rebound: int
    """Tensor objects moved onto the pool."""
    pinned_by: tuple[str, ...] = ()
    """With ``on_pinned`` "warn"/"force": what still holds the original."""
    external: bool = False
    """The original's memory belongs to another owner (``torch.from_numpy``,
    ``torch.frombuffer``): the tensor no longer shares it, and freeing it is that owner's job."""

    @property
    def freed_bytes(self) -> int:
        return self.original_nbytes if self.released and not self.external else 0


class ItemTable(Sequence[AdoptedItem]):
    """The items of a large plain batch, kept as columns and made into :class:`AdoptedItem`
    values only when looked at (a batch of 10,000 would otherwise build 10,000 objects that
    most callers never read)."""

    __slots__ = ("_slices", "_nbytes", "_released", "_pinned", "_made", "_rebound")

    def __init__(
        self, slices: Sequence[Slice], nbytes: Sequence[int], released: Sequence[bool] | Sequence[int],
        pinned: dict[int, tuple[str, ...]], rebound: int = 1,
    ) -> None:
        # A run of slices stays a run (its handles made when read); nbytes stay as given.
        self._slices: tuple[Slice, ...] | SliceRun = (
            slices if isinstance(slices, (tuple, SliceRun)) else tuple(slices))
        self._nbytes, self._released = nbytes, bytes(released)
        self._pinned = pinned  # index -> holders
        self._made: tuple[AdoptedItem, ...] | None = None
        self._rebound = rebound  # tensor objects moved per item (the same for every item)

    def _items(self) -> tuple[AdoptedItem, ...]:
        if self._made is None:
            self._made = tuple(
                AdoptedItem(slice=s, original_nbytes=n, released=bool(r), rebound=self._rebound,
                            pinned_by=self._pinned.get(i, ()))
                for i, (s, n, r) in enumerate(zip(self.slices, self._nbytes, self._released)))
        return self._made

    def __len__(self) -> int:
        return len(self._slices)

    @overload
    def __getitem__(self, i: int) -> AdoptedItem: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[AdoptedItem, ...]: ...
    def __getitem__(self, i: int | slice) -> AdoptedItem | tuple[AdoptedItem, ...]:
        return self._items()[i]

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._items())

    def __repr__(self) -> str:
        return repr(self._items())

    @property
    def all_released(self) -> bool:
        return all(self._released)

    @property
    def freed_bytes(self) -> int:
        return sum(n for n, r in zip(self._nbytes, self._released) if r)

    @property
    def slices(self) -> tuple[Slice, ...]:
        if not isinstance(self._slices, tuple):
            self._slices = tuple(self._slices.handles())
        return self._slices


REPR_ITEMS = 8
"""How many items ``repr(AdoptionReport)`` lists, one a line, under its summary."""


@define(frozen=True)
class AdoptionReport:
    """The result of :meth:`FlatPool.adopt`: one item per original storage, in input order."""

    items: Sequence[AdoptedItem]

    @property
    def all_released(self) -> bool:
        if isinstance(self.items, ItemTable):
            return self.items.all_released
        return all(i.released for i in self.items)

    @property
    def freed_bytes(self) -> int:
        if isinstance(self.items, ItemTable):
            return self.items.freed_bytes
        return sum(i.freed_bytes for i in self.items)

    @property
    def slices(self) -> tuple[Slice, ...]:
        if isinstance(self.items, ItemTable):
            return self.items.slices
        return tuple(i.slice for i in self.items)

    def __repr__(self) -> str:
        """The summary first (tensors, bytes moved, freed, released), then the first items."""
        n = len(self.items)
        if not n:
            return "AdoptionReport(nothing adopted)"
        slices = self.slices
        released = sum(i.released for i in self.items) if not self.all_released else n
        status = "all released" if released == n else f"{n - released} kept alive"
        lines = [f"AdoptionReport({n} tensor{'s' * (n != 1)} into pool {slices[0].pool.name!r}: "
                 f"{_size(sum(s.nbytes for s in slices))} moved, {_size(self.freed_bytes)} "
                 f"freed, {status})"]
        for k, item in enumerate(self.items[:REPR_ITEMS]):
            lines.append(f"  #{k}: {_describe(item)}")
        if n > REPR_ITEMS:
            lines.append(f"  ... {n - REPR_ITEMS} more in .items")
        return "\n".join(lines)


def _describe(item: AdoptedItem) -> str:
    slc = item.slice
    dtype = str(slc.dtype).removeprefix("torch.")
    shape = "x".join(map(str, slc.shape)) or "scalar"
    if item.external:
        fate = "its memory belongs to another owner (not freed here)"
    elif item.released:
        fate = f"original {_size(item.original_nbytes)} released"
    else:
        held = "; ".join(item.pinned_by) or "unknown"
        fate = f"original {_size(item.original_nbytes)} kept alive, held by {held}"
    return f"slice {slc.slice_id} ({dtype} {shape}, {_size(slc.nbytes)}), {fate}"


_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def _size(n: int) -> str:
    """Bytes as :func:`flatpool.memory.units.fmt_bytes` writes them (which this module cannot
    import: :mod:`flatpool.memory` imports the package this module is part of)."""
    for unit, name in _UNITS:
        if n >= unit:
            return f"{n // unit} {name}" if n % unit == 0 else f"{n / unit:.2f} {name}"
    return f"{n} B"


__all__ = ["AdoptSpec", "AdoptedItem", "AdoptionReport", "Holder", "ItemTable", "OnPinned",
           "specs_of_columns"]
