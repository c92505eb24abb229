"""What a pool adopted: for each slice, the tensor objects bound to it and where to find them.

Bindings keep only weak references (to tensors, and to holders' owners where the owner allows
it), so a pool never keeps a model alive. They are what validity checks, re-adoption and
relocation walk. A batch adoption binds thousands of tensors, so a binding is stored as a plain
tuple (:data:`Record`) and turned into a :class:`Binding` only when someone asks for one.

A *parameter* is never given a weak reference of any kind: ``torch.utils.swap_tensors``
refuses a tensor that has a Python weak reference or a C++ weak reference to its TensorImpl, and
``nn.Module._apply`` (``.to``, ``.cpu()``, ``.double()``, ``to_empty``) swaps DTensor
parameters (every parameter under ``torch.__future__.set_swap_module_params_on_conversion(True)``).
A :class:`ParamRef` holds the parameter strongly instead and reads as dead (and lets go) once it
is the parameter's only holder: a Python reference count, no allocation. A parameter dropped by
its model is let go at the pool's next look at that binding (``holds``, ``readopt``,
relocation) or with the pool.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Union

import torch
from attrs import define
from torch import nn

from . import torch_compat as tc
from .holder import Holder

Ref = Callable[[], Any]
Record = tuple[Ref, int, tuple[int, ...], tuple[int, ...], torch.dtype, Union[Ref, None], Any, bool, bool]
"""``(tensor ref, byte offset in the slice, shape, stride, dtype, holder-owner ref or None,
holder key, holder is an item, primary)``."""


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


def tensor_ref(t: torch.Tensor) -> Ref:
    """How a record refers to ``t``: a Python weak reference, a :class:`ParamRef` for a
    parameter (which ``nn.Module._apply`` may have to swap)."""
    if isinstance(t, nn.Parameter):
        return ParamRef(t)
    return weakref.ref(t)


def plain_ref(t: torch.Tensor) -> Ref:
    """:func:`tensor_ref` for an exact ``torch.Tensor`` or ``nn.Parameter`` (no class check)."""
    return weakref.ref(t) if type(t) is torch.Tensor else ParamRef(t)


def _ref(obj: Any) -> Ref:
    if isinstance(obj, torch.Tensor):
        return tensor_ref(obj)
    try:
        return weakref.ref(obj)
    except TypeError:  # dicts, lists: keep strongly, they are what the caller named
        return lambda: obj


def make_record(
    tensor: torch.Tensor, byte_offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
    dtype: torch.dtype, holder: Holder | None, primary: bool,
) -> Record:
    if holder is None:
        return (tensor_ref(tensor), byte_offset, shape, stride, dtype, None, None, False, primary)
    return (tensor_ref(tensor), byte_offset, shape, stride, dtype, _ref(holder.owner),
            holder.key, holder.item, primary)


def record_holder(rec: Record) -> Holder | None:
    owner_ref = rec[5]
    if owner_ref is None:
        return None
    owner = owner_ref()
    return None if owner is None else Holder(owner, rec[6], rec[7])


def current(rec: Record) -> torch.Tensor | None:
    """The object bound by ``rec`` now: what its holder holds, else the weakly held tensor.

    A holder lets re-adoption find a *replacement* object a framework installed there.
    """
    if rec[5] is not None:
        holder = record_holder(rec)
        if holder is None:
            return None
        try:
            value = holder.get()
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
        return value if isinstance(value, torch.Tensor) else None
    tensor: torch.Tensor | None = rec[0]()
    return tensor


@define(frozen=True)
class Geometry:
    """A tensor's placement relative to the start of its slice."""

    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@define(frozen=True, eq=False)
class Binding:
    """One tensor object bound to a slice, and how to find it again (a view of a record)."""

    record: Record

    @property
    def geometry(self) -> Geometry:
        r = self.record
        return Geometry(r[1], r[2], r[3], r[4])

    @property
    def primary(self) -> bool:
        return self.record[8]

    def holder(self) -> Holder | None:
        return record_holder(self.record)

    def current(self) -> torch.Tensor | None:
        return current(self.record)


class AdoptionRegistry:
    """Per-pool map: slice id -> records. Guarded by the pool's lock."""

    def __init__(self) -> None:
        self._records: dict[int, list[Record]] = {}
        self.version = 0
        """Bumped *before* every change (an interrupt in between costs a recheck, never a
        stale answer): what the fast validity check (:mod:`.ownership.quickcheck`) keys on."""

    def holds(self, slice_id: int) -> bool:
        return any(current(r) is not None for r in self._records.get(slice_id, ()))

    def records(self, slice_id: int) -> tuple[Record, ...]:
        return tuple(self._records.get(slice_id, ()))

    def bindings(self, slice_id: int) -> tuple[Binding, ...]:
        return tuple(Binding(r) for r in self._records.get(slice_id, ()))

    def bind(self, slice_id: int, records: list[Record]) -> None:
        self.version += 1
        self._records[slice_id] = records

    def bind_many(self, pairs: Iterable[tuple[int, list[Record]]]) -> None:
        self.version += 1
        self._records.update(pairs)

    def unbind(self, slice_id: int) -> list[Record]:
        self.version += 1
        return self._records.pop(slice_id, [])

    def items(self) -> Iterator[tuple[int, list[Record]]]:
        return iter(list(self._records.items()))

    def __len__(self) -> int:
        return len(self._records)

    def snapshot(self) -> dict[int, list[Record]]:
        return dict(self._records)  # lists are replaced, never mutated in place

    def restore(self, snap: dict[int, list[Record]]) -> None:
        self.version += 1
        self._records = dict(snap)


__all__ = ["AdoptionRegistry", "Binding", "Geometry", "ParamRef", "Record", "current",
           "make_record", "plain_ref", "record_holder", "tensor_ref"]
