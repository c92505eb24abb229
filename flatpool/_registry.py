"""What a pool adopted: for each slice, its bindings (the members bound to it, and where to find
them again). See [Note: flatpool terms] in :mod:`flatpool.ownership`.

A binding never keeps a model alive: members and holders' owners are referred to weakly where
possible. A *parameter* never gets a weak reference (``torch.utils.swap_tensors``, which
``nn.Module._apply`` uses on DTensor parameters, refuses one): a :class:`ParamRef` holds it
strongly and reads as dead once it is the only holder. A plain tensor that is its original's
only member is held the same way (:class:`TensorRef`); with other members on the original a
view's autograd link could not be told from the pool's hold, so those are weak references.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable, NamedTuple

import torch
from attrs import define
from torch import nn

from . import _torch_compat as tc
from ._holder import Holder

Ref = Callable[[], Any]
"""How a binding finds an object again: called, it answers the object or ``None``."""


class ParamRef:
    """A reference to a parameter that ``torch.utils.swap_tensors`` does not refuse: strong,
    but it answers ``None`` (and lets go) when nothing else holds the parameter."""

    __slots__ = ("_obj",)

    def __init__(self, t: torch.Tensor) -> None:
        self._obj: torch.Tensor | None = t

    def __call__(self) -> torch.Tensor | None:
        obj = self._obj
        if obj is None:
            return None
        # Ours: the slot and the local above; torch's own while C++ shares the impl.
        ours = 2 + (tc.PRESERVED_TENSOR_REF if tc.tensor_impl_users(obj) > 1 else 0)
        if tc.python_refs(obj) <= ours:
            self._obj = None
            return None
        return obj


class TensorRef(ParamRef):
    """:class:`ParamRef` for a plain tensor: only a dropped *parameter* orphans its slice, so
    the two are told apart by class."""

    __slots__ = ()


def tensor_ref(t: torch.Tensor) -> Ref:
    """How a binding refers to ``t``: a :class:`ParamRef` for a parameter, else a weak reference."""
    cls = type(t)  # (the exact classes first: Parameter's isinstance check runs Python code;
    # a subclass made a parameter, a DTensor's, says so by its ``_is_param`` flag, which is
    # what that check reads first)
    if cls is nn.Parameter or (cls is not torch.Tensor and (
            getattr(t, "_is_param", False) is True or isinstance(t, nn.Parameter))):
        return ParamRef(t)
    return weakref.ref(t)


def _ref(obj: Any) -> Ref:
    if isinstance(obj, torch.Tensor):
        return tensor_ref(obj)
    try:
        return weakref.ref(obj)
    except TypeError:  # dicts, lists: keep strongly, they are what the caller named
        return lambda: obj


@define(frozen=True)
class Geometry:
    """A member's place relative to the start of its slice."""

    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class Binding(NamedTuple):
    """One member bound to a slice, found again through its holder's place (which finds a
    replacement a framework put there) or else ``ref``."""

    ref: Ref
    byte_offset: int
    """Where the member starts, in bytes from the start of its slice."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    owner: Ref | None
    """The holder's owner (``None``: no holder)."""
    key: Any
    """The holder's attribute name or item key."""
    item: bool
    """The holder's place is ``owner[key]``, not ``getattr(owner, key)``."""
    primary: bool
    """The member is its original's primary tensor (the one the spec named)."""

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.byte_offset, self.shape, self.stride, self.dtype)

    def holder(self) -> Holder | None:
        if self.owner is None:
            return None
        owner = self.owner()
        return None if owner is None else Holder(owner, self.key, self.item)

    def current(self) -> torch.Tensor | None:
        """The member bound now: what its holder holds, else what ``ref`` finds."""
        if self.owner is not None:
            holder = self.holder()
            if holder is None:
                return None
            try:
                value = holder.get()
            except (AttributeError, KeyError, IndexError, TypeError):
                return None
            return value if isinstance(value, torch.Tensor) else None
        tensor: torch.Tensor | None = self.ref()
        return tensor


def binding(tensor: torch.Tensor, byte_offset: int, shape: tuple[int, ...],
            stride: tuple[int, ...], dtype: torch.dtype, holder: Holder | None,
            primary: bool, alone: bool = False) -> Binding:
    """The binding of ``tensor`` at ``byte_offset`` of its slice (its holder, if any);
    ``alone``: it is its original's only member (see the module for the reference it gets)."""
    if holder is None:
        strong = alone and type(tensor) is torch.Tensor
        ref = TensorRef(tensor) if strong else tensor_ref(tensor)
        return _make(Binding, (ref, byte_offset, shape, stride, dtype, None, None, False, primary))
    return _make(Binding, (tensor_ref(tensor), byte_offset, shape, stride, dtype,
                           _ref(holder.owner), holder.key, holder.item, primary))


_make = tuple.__new__
"""``Binding(*fields)`` without the named tuple's Python ``__new__`` (one frame a member)."""


class AdoptionRegistry:
    """Slice id -> its bindings, under the pool's lock; lists are replaced, never mutated, so a
    snapshot is a shallow copy."""

    def __init__(self) -> None:
        self._bindings: dict[int, list[Binding]] = {}
        self.version: int = 0
        """Bumped *before* every change: an interrupt costs a recheck, never a stale answer."""

    def holds(self, slice_id: int) -> bool:
        """Some member bound to ``slice_id`` is alive."""
        return any(b.current() is not None for b in self._bindings.get(slice_id, ()))

    def bindings(self, slice_id: int) -> tuple[Binding, ...]:
        return tuple(self._bindings.get(slice_id, ()))

    def bind(self, slice_id: int, bindings: list[Binding]) -> None:
        self.version += 1
        self._bindings[slice_id] = bindings

    def bind_many(self, pairs: Iterable[tuple[int, list[Binding]]]) -> None:
        self.version += 1
        self._bindings.update(pairs)

    def unbind(self, slice_id: int) -> list[Binding]:
        self.version += 1
        return self._bindings.pop(slice_id, [])

    def items(self) -> Iterator[tuple[int, list[Binding]]]:
        return iter(list(self._bindings.items()))

    def __len__(self) -> int:
        return len(self._bindings)

    def snapshot(self) -> dict[int, list[Binding]]:
        return dict(self._bindings)

    def restore(self, snap: dict[int, list[Binding]]) -> None:
        """Put back a :meth:`snapshot` (or install a new map: relocation)."""
        self.version += 1
        self._bindings = dict(snap)
