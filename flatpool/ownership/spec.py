"""Value types of ownership transfer: what to adopt, where its views live, what came of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from attrs import define, field

from ..errors import InvalidTypeError
from ..slices import Slice

OnPinned = Literal["raise", "warn", "force"]
"""What to do when an original storage is still referenced after rebinding.

``"raise"`` (default) rolls the adoption back and raises :class:`PinnedStorageError` naming
the holders. ``"warn"`` keeps the adoption and warns; the original lives on until its holders
drop it. ``"force"`` also rebinds every Python-visible tensor found on the original by a gc scan,
then behaves like ``"warn"`` for what is left (C++ holders). No mode ever frees memory that
something still uses (``resize_(0)`` would make later reads segfault).
"""


@define(frozen=True)
class Holder:
    """A place that references a tensor: ``getattr(owner, key)`` or ``owner[key]`` (``item``).

    Adoption *replaces* the tensor held there by a fresh pool-backed tensor of the same
    geometry. Use it for views with an autograd ``_base``: ``set_`` moves a view's storage but
    its base keeps the original alive, so such a view must be swapped where it is held.
    """

    owner: Any
    key: Any
    item: bool = False

    def get(self) -> Any:
        return self.owner[self.key] if self.item else getattr(self.owner, self.key)

    def set(self, value: Any) -> None:
        if self.item:
            self.owner[self.key] = value
        else:
            setattr(self.owner, self.key, value)

    def describe(self) -> str:
        owner = type(self.owner).__name__
        return f"{owner}[{self.key!r}]" if self.item else f"{owner}.{self.key}"


def _tensors(value: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    out = tuple(value)
    for v in out:
        if not isinstance(v, torch.Tensor):
            raise InvalidTypeError(f"views must be tensors, got {type(v).__name__}")
    return out


def _holders(value: Sequence[Holder]) -> tuple[Holder, ...]:
    out = tuple(value)
    for h in out:
        if not isinstance(h, Holder):
            raise InvalidTypeError(f"holders must be flatpool.Holder, got {type(h).__name__}")
    return out


@define(frozen=True)
class AdoptSpec:
    """One original to adopt.

    Args:
        tensor: the primary tensor. Its bytes move; it defines the slice (its shape and dtype
            when contiguous, else a flat run of its strided extent).
        views: other tensor objects on the same storage, rebound in place with ``set_``.
        holders: places whose tensor (on the same storage) is replaced by a fresh pool view.
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
    """Tensor objects moved onto the pool (in place or through a holder)."""
    pinned_by: tuple[str, ...] = ()
    """With ``on_pinned`` "warn"/"force": what still holds the original."""

    @property
    def freed_bytes(self) -> int:
        return self.original_nbytes if self.released else 0


@define(frozen=True)
class AdoptionReport:
    """The result of :meth:`FlatPool.adopt`: one item per original storage, in input order."""

    items: tuple[AdoptedItem, ...]

    @property
    def all_released(self) -> bool:
        return all(i.released for i in self.items)

    @property
    def freed_bytes(self) -> int:
        return sum(i.freed_bytes for i in self.items)

    @property
    def slices(self) -> tuple[Slice, ...]:
        return tuple(i.slice for i in self.items)
