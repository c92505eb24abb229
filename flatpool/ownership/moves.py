"""The one way flatpool moves tensor objects: batches of journaled moves, each undoable.

Every operation (adopt, readopt, grow/compact, materialize, and rollback itself) moves tensor
objects through the functions here, and only after writing a record of the move to its journal
(write-ahead). An interruption can land between any two bytecodes; because the record exists
before the move and every undo is *absolute* (put the object back where the record says, or
leave it if it is there already), rolling back is correct whether a move happened or not, and
running the rollback twice is harmless.

Two kinds of move keep the object's identity:

* :class:`SetMove`: ``set_`` the TensorImpl onto the new place (the common case). Autograd
  graphs and other C++ holders of the impl follow it.
* :class:`ImplSwap`: exchange the object's TensorImpl with a fresh one on the new place. For
  an autograd view (``set_`` keeps its ``_base``, which pins the original) and for a meta or
  storage-less tensor (``set_`` refuses another device).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import is_
from typing import Any, Union

import torch

from .. import torch_compat as tc

Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]
"""``(element offset, size, stride)``."""


class SetMove:
    """``obj`` came from storage ``key`` at ``(offset, size, stride)`` with counter ``version``."""

    __slots__ = ("obj", "key", "offset", "size", "stride", "version")
    obj: torch.Tensor
    key: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    version: int

    def __init__(
        self, obj: torch.Tensor, key: int, offset: int, size: tuple[int, ...],
        stride: tuple[int, ...], version: int,
    ) -> None:
        self.obj, self.key, self.offset, self.size, self.stride, self.version = (
            obj, key, offset, size, stride, version)


class SetMoves:
    """:class:`SetMove` records of a batch as columns: ``objs[i]`` came from storage
    ``keys[i]`` at ``(offsets[i], sizes[i], strides[i])`` with counter ``versions[i]``, for
    ``lo <= i < hi``. The columns are the batch's own lists (no object per tensor: issue 20's
    heap budget); the batch must not change them while a journal holds this. One append to the
    journal, before the moves, so the write-ahead rule holds for the whole chunk."""

    __slots__ = ("objs", "keys", "offsets", "sizes", "strides", "versions", "lo", "hi")

    def __init__(
        self, objs: Sequence[torch.Tensor], keys: Sequence[int], offsets: Sequence[int],
        sizes: Sequence[tuple[int, ...]], strides: Sequence[tuple[int, ...]],
        versions: Sequence[int], lo: int, hi: int,
    ) -> None:
        self.objs, self.keys, self.offsets, self.sizes, self.strides, self.versions = (
            objs, keys, offsets, sizes, strides, versions)
        self.lo, self.hi = lo, min(hi, len(objs))

    def records(self) -> Iterator[SetMove]:
        """The moves one by one, in order (built on demand: rollback and rare readers)."""
        for i in range(self.lo, self.hi):
            yield SetMove(self.objs[i], self.keys[i], self.offsets[i], self.sizes[i],
                          self.strides[i], self.versions[i])


def set_moves(records: Iterable[Record]) -> Iterator[SetMove]:
    """Every :class:`SetMove` of ``records``, those of :class:`SetMoves` columns included."""
    for rec in records:
        if isinstance(rec, SetMove):
            yield rec
        elif isinstance(rec, SetMoves):
            yield from rec.records()


class ImplSwap:
    """``obj``'s TensorImpl (address ``impl``) is exchanged with ``other``'s.

    After the swap ``other`` holds ``obj``'s old impl; undoing swaps them back. ``key`` is the
    storage the old impl lived on (``None`` for a meta or storage-less one).
    """

    __slots__ = ("obj", "other", "other_ref", "impl", "version", "key", "geometry", "dtype")
    obj: torch.Tensor
    impl: int
    version: int
    key: int | None
    geometry: Geometry | None
    dtype: torch.dtype | None

    def __init__(
        self, obj: torch.Tensor, other: torch.Tensor, key: int | None, version: int,
        geometry: Geometry | None = None, dtype: torch.dtype | None = None,
    ) -> None:
        self.obj = obj
        self.other: torch.Tensor | None = other
        self.other_ref: weakref.ref[torch.Tensor] | None = None
        self.impl = tc.impl_address(obj)
        self.version = version
        self.key = key
        self.geometry = geometry
        """Where the old impl sat on storage ``key``: to rebuild it if it died after commit."""
        self.dtype = dtype

    def old_impl_holder(self) -> torch.Tensor | None:
        """The object that carries ``obj``'s old impl now (``None`` once it died)."""
        if self.other is not None:
            return self.other
        return None if self.other_ref is None else self.other_ref()

    def let_go(self) -> None:
        """Drop the strong reference to the old impl (so the original can die), keep a weak one."""
        if self.other is not None:
            self.other_ref = weakref.ref(self.other)
            self.other = None


class ImplSwaps:
    """:class:`ImplSwap` records of a batch as columns: ``objs[i]``'s TensorImpl (address
    ``impls[i]``, read here, before the swap) is exchanged with that of ``others[i]``, a fresh
    tensor, and came from storage ``keys[i]`` at ``geometries[i]`` with counter ``versions[i]``.
    One append to the journal before the swaps (write-ahead for the whole chunk), no object per
    swap. After :meth:`let_go` the old impls are held weakly, as :meth:`ImplSwap.let_go` does."""

    __slots__ = ("objs", "others", "refs", "impls", "keys", "versions", "geometries", "dtypes")

    def __init__(
        self, objs: list[torch.Tensor], others: list[torch.Tensor], keys: list[int],
        versions: list[int], geometries: list[Geometry], dtypes: list[torch.dtype],
    ) -> None:
        self.objs = objs
        self.others: list[torch.Tensor | None] = list(others)
        self.refs: list[weakref.ref[torch.Tensor] | None] | None = None
        self.impls = list(map(tc.impl_key, objs))  # (exact tensors: torch's own read)
        self.keys, self.versions, self.geometries, self.dtypes = keys, versions, geometries, dtypes

    def holders(self) -> list[torch.Tensor | None]:
        """The object that carries each ``objs[i]``'s old impl now (``None`` once it died)."""
        if self.refs is None:
            return list(self.others)
        return [o if o is not None else (None if r is None else r())
                for o, r in zip(self.others, self.refs)]

    def hold(self, i: int, other: torch.Tensor) -> None:
        """``other`` carries ``objs[i]``'s old impl from now on (a rebuilt one), strongly."""
        self.others[i] = other

    def let_go(self) -> None:
        """Drop the strong references to the old impls (so the originals can die), keep weak ones."""
        # (the common case: every one held; by identity, as ``None in`` runs Tensor.__eq__)
        if self.refs is None and not any(map(is_, self.others, repeat(None))):
            self.refs = list(map(weakref.ref, self.others))  # type: ignore[arg-type]
        else:
            refs = self.refs if self.refs is not None else [None] * len(self.others)
            self.refs = [r if o is None else weakref.ref(o) for o, r in zip(self.others, refs)]
        self.others = [None] * len(self.others)

    def containers(self) -> tuple[object, ...]:
        """The lists that refer to the moved objects or their old impls (for pin scans)."""
        return self.objs, self.others


class SlotSet:
    """``setattr(obj, name, ...)`` replaced ``old`` (a DTensor's ``_local_tensor``, say)."""

    __slots__ = ("obj", "name", "old")
    obj: Any
    name: str
    old: Any

    def __init__(self, obj: Any, name: str, old: Any) -> None:
        self.obj, self.name, self.old = obj, name, old


Record = Union[SetMove, SetMoves, ImplSwap, ImplSwaps, SlotSet]
Place = tuple[torch.Tensor, torch.UntypedStorage, int, Sequence[int], Sequence[int]]
"""``(tensor object, storage, element offset, size, stride)``."""


# -- performing moves ------------------------------------------------------------------------
def place_many(moves: Iterable[Place]) -> None:
    """``set_`` every tensor object onto its place, in place (identity and impl kept).

    With :func:`place_columns` (the lean batch's form) the only ``set_`` loops of flatpool:
    adoption, re-adoption, relocation and rollback all come through here.
    """
    with tc.no_torch_function(), tc.outside_inference(), torch.no_grad():
        for obj, storage, offset, size, stride in moves:
            tc.impl_set_(obj, storage, offset, size, stride)


def place_columns(
    objs: Sequence[torch.Tensor], storage: torch.UntypedStorage, offsets: Sequence[int],
    sizes: Sequence[Sequence[int]], strides: Sequence[Sequence[int]],
) -> None:
    """:func:`place_many` for a batch onto one storage, as columns: the ``set_`` calls run in
    one C-level pass (no bytecode per tensor)."""
    with tc.no_torch_function(), tc.outside_inference(), torch.no_grad():
        deque(map(tc.impl_set_, objs, repeat(storage), offsets, sizes, strides), maxlen=0)


def swap_many(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the TensorImpls of each pair (see :func:`flatpool.torch_compat.swap_impl`);
    a leaf's ``.grad`` and hooks go with the object (they lived on its old impl)."""
    for a, b in pairs:
        tc.swap_impl(a, b)
        tc.carry_leaf_state(a, b)


def fresh_on(
    storage: torch.UntypedStorage, offset: int, size: Sequence[int], stride: Sequence[int],
    dtype: torch.dtype, requires_grad: bool = False,
) -> torch.Tensor:
    """A new base-less tensor on ``storage`` at ``(offset, size, stride)`` in elements."""
    with tc.outside_inference():
        out = torch.empty(0, dtype=dtype, device=storage.device)
        with torch.no_grad():
            out.set_(storage, offset, tuple(size), tuple(stride))
        if requires_grad:
            out.requires_grad_(True)
    return out


def fresh_like(
    obj: torch.Tensor, storage: torch.UntypedStorage, offset: int, size: Sequence[int],
    stride: Sequence[int], dtype: torch.dtype, requires_grad: bool = False,
    counter_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fresh_on`, carrying ``obj``'s lazy conj/neg bits: a new impl that is to read as
    ``obj`` reads over the same bytes (a conj view's storage holds the unconjugated values).

    ``counter_of``: a tensor whose version counter the new impl shares (an alias of ``obj``
    before the move), so that autograd still sees an in-place write through either one."""
    if counter_of is None or tc.impl_dtype(counter_of) != dtype:
        out = fresh_on(storage, offset, size, stride, dtype, requires_grad)
    else:
        with tc.outside_inference():
            out = tc.counter_alias(counter_of)
            with torch.no_grad():
                tc.impl_set_(out, storage, offset, tuple(size), tuple(stride))
            if requires_grad:
                out.requires_grad_(True)
    tc.copy_tensor_flags(obj, out)
    return out


def counter_group(t: torch.Tensor) -> int:
    """Which version counter ``t`` uses, as far as autograd links tell: an autograd view shares
    its base's (the impl address of the base names the group), anything else has its own.
    Call under ``no_torch_function()``."""
    base = tc.impl_base(t)
    return tc.impl_address(t if base is None else base)


def geometry_of(t: torch.Tensor) -> Geometry:
    """``t``'s TensorImpl geometry in elements. Call under ``no_torch_function()``."""
    return tc.impl_storage_offset(t), tuple(tc.impl_size(t)), tuple(tc.impl_stride(t))


# -- undoing them --------------------------------------------------------------------------
def undo(
    records: Sequence[Record], originals: Mapping[int, torch.UntypedStorage],
) -> list[BaseException]:
    """Put every object of ``records`` back where its record says; absolute and idempotent.

    Returns the errors of records that could not be undone (a holder whose setter now fails),
    after undoing everything else.
    """
    errors: list[BaseException] = []
    back: list[Place] = []
    swaps: list[tuple[torch.Tensor, torch.Tensor]] = []
    versions: list[tuple[torch.Tensor, int]] = []
    for rec in reversed(records):
        if isinstance(rec, SetMove):
            back.append((rec.obj, originals[rec.key], rec.offset, rec.size, rec.stride))
            versions.append((rec.obj, rec.version))
        elif isinstance(rec, SetMoves):
            for m in reversed(list(rec.records())):
                back.append((m.obj, originals[m.key], m.offset, m.size, m.stride))
                versions.append((m.obj, m.version))
        elif isinstance(rec, ImplSwap):
            other = rec.old_impl_holder()
            if tc.impl_address(rec.obj) != rec.impl and other is not None:
                swaps.append((rec.obj, other))
            if rec.version >= 0:
                versions.append((rec.obj, rec.version))
        elif isinstance(rec, ImplSwaps):
            for obj, other, impl, version in reversed(list(zip(
                    rec.objs, rec.holders(), rec.impls, rec.versions))):
                if tc.impl_address(obj) != impl and other is not None:
                    swaps.append((obj, other))
                if version >= 0:
                    versions.append((obj, version))
    place_many(back)
    swap_many(swaps)
    for rec in reversed(records):
        try:
            if isinstance(rec, SlotSet):
                setattr(rec.obj, rec.name, rec.old)
        except Exception as exc:  # keep undoing the rest; reported together
            errors.append(exc)
    tc.set_versions([t for t, _ in versions], [v for _, v in versions])
    return errors


__all__ = [
    "Geometry", "ImplSwap", "ImplSwaps", "Place", "Record", "SetMove", "SetMoves", "SlotSet", "counter_group", "fresh_like", "fresh_on",
    "geometry_of", "place_many", "set_moves", "swap_many", "undo",
]
