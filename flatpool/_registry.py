"""What a pool adopted: for each slice, its bindings (the members bound to it, and where to find
them again). See [Note: flatpool terms] in :mod:`flatpool.ownership`.

A binding refers to its member so that the pool never keeps a model alive: a tensor subclass
by a weak reference, and holders' owners weakly where the owner allows it. They are what
validity checks, re-adoption and relocation walk.

A *parameter* is never given a weak reference of any kind: ``torch.utils.swap_tensors``
refuses a tensor that has a Python weak reference or a C++ weak reference to its TensorImpl, and
``nn.Module._apply`` (``.to``, ``.cpu()``, ``.double()``, ``to_empty``) swaps DTensor
parameters (every parameter under ``torch.__future__.set_swap_module_params_on_conversion(True)``).
A :class:`ParamRef` holds the parameter strongly instead and reads as dead (and lets go) once it
is the parameter's only holder: a Python reference count, no allocation. A plain
``torch.Tensor`` that is its original's only member (and has no holder) is held the same way
(:class:`TensorRef`), so ``swap_tensors`` works on it too; with other members on the same
original (views of it, wrappers) the rule could not tell a view's autograd link to it from
the pool's own hold, so those are weak references. A member dropped by its owner is let go
at the pool's next look at that binding (``holds``, ``is_valid``, ``readopt``, relocation) or
with the pool. A member bound with a holder is found through the holder's place.
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
    """A reference to a parameter that ``torch.utils.swap_tensors`` does not refuse.

    Strong, but it answers ``None`` (and drops the parameter) when nothing else holds it: no
    Python reference beside its own, and none torch keeps for a C++ owner of the impl.
    """

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
    """:class:`ParamRef` for a plain tensor (not a parameter): the same rule; only a dropped
    *parameter* makes its slice orphaned (:func:`flatpool.ownership._validity.orphaned`), so the
    two are told apart by class."""

    __slots__ = ()


def tensor_ref(t: torch.Tensor) -> Ref:
    """How a binding refers to ``t``: a :class:`ParamRef` for a parameter (which
    ``nn.Module._apply`` may have to swap), else a Python weak reference."""
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
    """One member bound to a slice, and how to find it again: through its holder's place when it
    has one (re-adoption then finds a *replacement* object a framework put there), else through
    ``ref``."""

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
"""``Binding(*fields)`` without the named tuple's generated ``__new__``, a Python frame that
costs as much as the rest of a binding (an adoption makes one a member)."""


class AdoptionRegistry:
    """Per-pool map: slice id -> its bindings. Guarded by the pool's lock; every change replaces
    a slice's list (never mutates one), so a snapshot is a shallow copy."""

    def __init__(self) -> None:
        self._bindings: dict[int, list[Binding]] = {}
        self.version: int = 0
        """Bumped *before* every change (an interrupt in between costs a recheck, never a
        stale answer)."""

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


__all__ = ["AdoptionRegistry", "Binding", "Geometry", "ParamRef", "Ref", "TensorRef", "binding",
           "tensor_ref"]
