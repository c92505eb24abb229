"""What a pool adopted: for each slice, the tensor objects bound to it and where to find them.

Bindings keep only weak references (to tensors, and to holders' owners where the owner allows
it), so a pool never keeps a model alive. They are what validity checks, re-adoption and
relocation walk.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch
from attrs import define

from ..slices import Slice
from .spec import Holder

if TYPE_CHECKING:
    from ..pool import FlatPool


def _ref(obj: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(obj)
    except TypeError:  # dicts, lists: keep strongly, they are what the caller named
        return lambda: obj


@define(frozen=True)
class Geometry:
    """A tensor's placement relative to the start of its slice."""

    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@define(frozen=True, eq=False)
class Binding:
    """One tensor object bound to a slice, and how to find it again.

    ``holder`` is set when the object sits at a known place (a DTensor's ``_local_tensor``,
    an FSDP param's ``_sharded_param_data``): re-adoption then looks there, which also finds a
    *replacement* object a framework installed.
    """

    tensor_ref: Callable[[], torch.Tensor | None]
    geometry: Geometry
    holder_owner: Callable[[], Any] | None = None
    holder_key: Any = None
    holder_item: bool = False
    primary: bool = False

    @staticmethod
    def make(
        tensor: torch.Tensor, geometry: Geometry, holder: Holder | None, primary: bool
    ) -> Binding:
        if holder is None:
            return Binding(weakref.ref(tensor), geometry, primary=primary)
        return Binding(
            weakref.ref(tensor), geometry, _ref(holder.owner), holder.key, holder.item, primary
        )

    def holder(self) -> Holder | None:
        if self.holder_owner is None:
            return None
        owner = self.holder_owner()
        return None if owner is None else Holder(owner, self.holder_key, self.holder_item)

    def current(self) -> torch.Tensor | None:
        """The object bound here now: what the holder holds, else the weakly held tensor."""
        holder = self.holder()
        if holder is not None:
            try:
                value = holder.get()
            except (AttributeError, KeyError, IndexError):
                return None
            return value if isinstance(value, torch.Tensor) else None
        return self.tensor_ref()


class AdoptionRegistry:
    """Per-pool map: slice id -> bindings. Guarded by the pool's lock."""

    def __init__(self, pool: FlatPool) -> None:
        self._pool = weakref.ref(pool)
        self._bindings: dict[int, list[Binding]] = {}

    def holds(self, slc: Slice) -> bool:
        return any(b.current() is not None for b in self._bindings.get(slc.slice_id, ()))

    def bindings(self, slc: Slice) -> tuple[Binding, ...]:
        return tuple(self._bindings.get(slc.slice_id, ()))

    def bind(self, slc: Slice, bindings: list[Binding]) -> None:
        self._bindings[slc.slice_id] = bindings

    def unbind(self, slc: Slice) -> list[Binding]:
        return self._bindings.pop(slc.slice_id, [])

    def items(self) -> Iterator[tuple[int, list[Binding]]]:
        return iter(list(self._bindings.items()))

    def rekey(self, mapping: dict[int, int]) -> None:
        """Move bindings to new slice ids (after relocation handed out new handles)."""
        self._bindings = {mapping.get(k, k): v for k, v in self._bindings.items()}

    def snapshot(self) -> dict[int, list[Binding]]:
        return {k: list(v) for k, v in self._bindings.items()}

    def restore(self, snap: dict[int, list[Binding]]) -> None:
        self._bindings = {k: list(v) for k, v in snap.items()}
