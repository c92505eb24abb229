"""Value types of ownership transfer: what to adopt, where its views live, what came of it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, cast

import torch
from attrs import define, field

from ..errors import InvalidRequestError, InvalidTypeError
from .._holder import Holder
from ..slices import Slice

OnPinned = Literal["raise", "warn", "force"]
"""What to do when an original storage is still referenced after rebinding: ``"raise"``
(default) rolls back and raises :class:`PinnedStorageError` naming the holders; ``"warn"`` keeps
the adoption and warns; ``"force"`` also rebinds every Python tensor a gc scan finds on it. No
mode frees memory something still uses (the pool keeps such an original alive).
"""


def check_policy(on_pinned: object) -> OnPinned:
    """``on_pinned`` checked: one of the :data:`OnPinned` values."""
    if on_pinned not in ("raise", "warn", "force"):
        raise InvalidRequestError(
            f"on_pinned must be 'raise', 'warn' or 'force', got {on_pinned!r}")
    return on_pinned


def _sequence(value: object, what: str) -> tuple[object, ...]:
    if type(value) is tuple:  # (what most callers pass: nothing to check or copy)
        return value
    if isinstance(value, torch.Tensor):  # a tensor iterates over rows; a 0-d one raises
        fix = "views=[t]" if what == "views" else "holders=[Holder(owner, key)] for its places"
        raise InvalidTypeError(
            f"AdoptSpec.{what} must be a sequence, got a single tensor (it would be split into "
            f"rows): pass {fix}")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidTypeError(
            f"AdoptSpec.{what} must be a list or tuple, got {type(value).__name__}")
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
                f"AdoptSpec.holders must hold flatpool.Holder, got {type(h).__name__}")
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


REPR_ITEMS = 8
"""How many items ``repr(AdoptionReport)`` lists, one a line, under its summary."""


@define(frozen=True)
class AdoptionReport:
    """The result of :meth:`FlatPool.adopt`: one item per original storage, in input order."""

    items: Sequence[AdoptedItem]

    @property
    def all_released(self) -> bool:
        return all(i.released for i in self.items)

    @property
    def freed_bytes(self) -> int:
        return sum(i.freed_bytes for i in self.items)

    @property
    def slices(self) -> tuple[Slice, ...]:
        return tuple([i.slice for i in self.items])  # (see adopt.adopt_in: not a generator)

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
    """Bytes as :func:`flatpool.memory.fmt_bytes` writes them (importing it would be a circle)."""
    for unit, name in _UNITS:
        if n >= unit:
            return f"{n // unit} {name}" if n % unit == 0 else f"{n / unit:.2f} {name}"
    return f"{n} B"
